"""The side channel: prefill answers handshakes, claims and releases; decode asks with a
bounded wait. One framed request, one framed reply, over TCP.

It is the door to prefill's KV (a handshake hands out the NIXL metadata that lets a peer
READ the registered memory), so everything a peer sends is bounded before it is buffered
and authenticated before it is acted on (docs/security.md has the threat model):

* framing: a 12-byte header states the body's length; a body over ``max_request_bytes``
  is refused without being read, a connection that stalls mid-request is closed, and the
  number of connections (in all, per address) is capped, so one client holds at most
  ``per_address_connections x max_request_bytes`` of the server's memory;
* with a shared secret every request carries ``nonce | time | HMAC-SHA256`` over its
  payload *and its destination* (the engine id and address it is meant for): a request
  relayed to another engine, replayed, stale or signed with another secret is refused,
  and the reply carries a MAC over the request's nonce, so it answers this request only;
* authenticated requests and refused ones draw on separate per-address budgets, so a
  flood of garbage from a decode's own address cannot starve that decode; a refusal for
  rate says ``busy``, which clients retry instead of taking the peer for dead;
* every refusal is answered with its reason, counted, and logged within a line budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import secrets
import socket
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec

from kvshare_connector.common.log import LogBudget, get_logger

logger = get_logger(__name__)

SECRET_ENV = "KVSHARE_SIDE_CHANNEL_SECRET"
INSECURE_ENV = "KVSHARE_SIDE_CHANNEL_INSECURE"
MAX_REQUEST_BYTES = 1 << 20  # a claim naming ~100k block ids fits
MAX_REPLY_BYTES = 64 << 20  # a handshake reply carries a layout and NIXL metadata
MAX_SKEW_S = 120.0  # clocks of the two hosts may differ this much
MAX_REFUSAL_CHARS = 300  # refusal texts sent and logged
_MAGIC = b"KVSC"
_VERSION = 1
_HEADER = struct.Struct(">4sBBHI")  # magic, version, kind, reserved, body length
_REQUEST, _REPLY = 1, 2
_NONCE, _STAMP, _MAC = 16, 8, 32
_AUTH = _NONCE + _STAMP + _MAC
_REQUEST_DOMAIN = b"kvshare-side-channel-request-v2\0"
_REPLY_DOMAIN = b"kvshare-side-channel-reply-v2\0"
_MAX_NONCES = 1 << 18  # remembered nonces (a replay window; oldest forgotten first)
BUSY = ("busy", "overloaded")  # refusals a client retries: the peer is alive


class SideChannelError(ConnectionError):
    """The peer could not be reached, did not answer in time, or answered unauthenticated.
    ``retryable``: it reset the connection before answering (a server over its connection
    cap closes without reading): alive, worth asking again."""

    retryable = False


class SideChannelReset(SideChannelError):
    retryable = True


class SideChannelRefused(SideChannelError):
    """The peer answered, refusing the request (``code`` says why)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code

    @property
    def busy(self) -> bool:
        return self.code in BUSY


class _Request(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    destination: str  # "<engine id>@<host>:<port>" the sender means
    auth: bytes  # nonce | stamp | mac, or empty without a secret
    payload: bytes


class _Reply(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    code: str  # "ok", or why the request was refused
    mac: bytes  # over the request's nonce and the payload (empty without a secret)
    payload: bytes  # the answer, or the refusal's text


_request_decoder = msgspec.msgpack.Decoder(_Request)
_reply_decoder = msgspec.msgpack.Decoder(_Reply)
_encoder = msgspec.msgpack.Encoder()


def destination(engine_id: str, host: str, port: int) -> str:
    """What a signed request is addressed to (and what a server answers to)."""
    return f"{engine_id}@{host}:{port}"


_warned_no_secret = False


def warn_if_no_secret(secret: bytes | None) -> None:
    """Once per process: the side channel runs unauthenticated."""
    global _warned_no_secret
    if secret is None and not _warned_no_secret:
        _warned_no_secret = True
        logger.warning(
            "KV side channel without a shared secret: any process that reaches it can "
            "handshake (and get the NIXL metadata that lets it READ the registered KV "
            "memory), claim or release requests. Set kv_connector_extra_config "
            "side_channel_secret or %s on every engine (docs/security.md)",
            SECRET_ENV,
        )


def is_loopback(host: str) -> bool:
    """Every address ``host`` stands for is a loopback address."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def check_exposure(host: str, secret: bytes | None, insecure: bool) -> None:
    """Refuse to serve KV beyond loopback without a secret, unless the operator opted in."""
    if secret is None and not insecure and not is_loopback(host):
        raise SideChannelError(
            f"the KV side channel would listen on {host} without side_channel_secret: any "
            "host that reaches it could READ this engine's KV memory. Set "
            f"side_channel_secret (or {SECRET_ENV}) to the same value on every engine, or "
            f"side_channel_insecure: true (or {INSECURE_ENV}=1) to accept that risk on a "
            "private network"
        )


def _mac(secret: bytes, *parts: bytes) -> bytes:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.digest()


def _frame(kind: int, body: bytes) -> bytes:
    return _HEADER.pack(_MAGIC, _VERSION, kind, 0, len(body)) + body


HEADER_BYTES = _HEADER.size


def encode_request(payload: bytes, where: str, secret: bytes | None = None) -> tuple[bytes, bytes]:
    """A framed request to ``where`` (``destination``), signed with ``secret``; with the
    nonce its reply's MAC covers (empty without a secret)."""
    nonce, auth = b"", b""
    if secret is not None:
        nonce = secrets.token_bytes(_NONCE)
        stamp = struct.pack(">Q", int(time.time() * 1000))
        auth = (
            nonce
            + stamp
            + _mac(secret, _REQUEST_DOMAIN, nonce, stamp, where.encode() + b"\0", payload)
        )
    return _frame(_REQUEST, _encoder.encode(_Request(where, auth, payload))), nonce


def encode_reply(code: str, payload: bytes, mac: bytes = b"") -> bytes:
    """A framed reply: ``ok`` with the answer, or a refusal's code with its text."""
    return _frame(_REPLY, _encoder.encode(_Reply(code, mac, payload)))


@dataclass(frozen=True)
class Limits:
    """What one server spends on its peers, at most."""

    max_request_bytes: int = MAX_REQUEST_BYTES
    connections: int = 128  # open at once, all addresses
    per_address_connections: int = 8  # x max_request_bytes: what one client can make us hold
    request_s: float = 5.0  # a started request must arrive whole within this
    idle_s: float = 30.0  # a connection with no request for this long is closed
    rate: float = 2000.0  # accepted requests per second and address, sustained
    burst: float = 4000.0
    refused_rate: float = 100.0  # refused ones per second and address (they cost replies)
    refused_burst: float = 200.0
    log_lines: int = 20  # refusal log lines per ``log_window_s``; the rest are summed up
    log_window_s: float = 10.0


class _Buckets:
    """Token buckets per address, oldest forgotten first."""

    def __init__(self, rate: float, burst: float, size: int = 4096):
        self.rate, self.burst, self.size = rate, burst, size
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, address: str) -> bool:
        now = time.monotonic()
        tokens, last = self._buckets.pop(address, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        allowed = tokens >= 1.0
        self._buckets[address] = (tokens - 1.0 if allowed else tokens, now)
        while len(self._buckets) > self.size:
            self._buckets.popitem(last=False)
        return allowed


Answer = bytes | Callable[[], bytes]  # a reply now, or work that may wait for one


class SideChannelServer:
    """Answers each request with ``handler(payload)``, from an event loop of its own;
    refusals are answered, counted by reason (``refused``) and logged within a budget.

    The handler runs on the loop's thread and returns the reply, or a function that may
    wait (e.g. for device work) and is run on a helper thread. Each hop between threads
    costs up to a GIL switch interval (5 ms) while the engine thread runs Python, so what
    can be answered at once is (``benchmarks/bench_claim_latency.py``); with
    ``inline=False`` every answer takes the helper thread (the comparison's other side).
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Callable[[bytes], Answer],
        secret: bytes | None = None,
        engine_id: str = "",
        limits: Limits | None = None,
        inline: bool = True,
    ):
        self._handler = handler
        self._inline = inline
        self._secret = secret
        self.limits = limits or Limits()
        self._accepted = _Buckets(self.limits.rate, self.limits.burst)
        self._refusals = _Buckets(self.limits.refused_rate, self.limits.refused_burst)
        self._log = LogBudget(self.limits.log_lines, self.limits.log_window_s, logger=logger)
        self._nonces: OrderedDict[bytes, float] = OrderedDict()
        self._connections: Counter[str] = Counter()
        self._refused_lock = threading.Lock()
        self._refused: Counter[str] = Counter()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvshare-side-channel")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(256)
        except OSError as exc:
            sock.close()
            raise SideChannelError(f"cannot listen on {host}:{port}: {exc}") from exc
        self.host, self.port = host, sock.getsockname()[1]
        self.destination = destination(engine_id, host, self.port)
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(sock, started), name="kvshare-side-channel", daemon=True
        )
        self._thread.start()
        started.wait()

    def _run(self, sock: socket.socket, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, sock=sock, limit=1 << 16)
        )
        started.set()
        self._loop.run_forever()
        self._loop.close()

    async def _shutdown(self) -> None:
        """Stop listening, end every connection, then the loop."""
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def refused(self) -> dict[str, int]:
        with self._refused_lock:
            return dict(self._refused)

    def take_refused(self) -> dict[str, int]:
        """Refusals since the last call, by reason (for stats)."""
        with self._refused_lock:
            out, self._refused = dict(self._refused), Counter()
            return out

    def _refuse(self, address: str, code: str, message: str) -> bytes | None:
        """Count and log a refusal; its reply, or None once the address has spent its
        refusal budget (the connection is then closed without one)."""
        with self._refused_lock:
            self._refused[code] += 1
        self._log.log(f"refused a request from {address} ({code}): {message}")
        if not self._refusals.take(address):
            return None
        return encode_reply(code, message[:MAX_REFUSAL_CHARS].encode())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if peer else "?"
        limits = self.limits
        full = sum(self._connections.values()) >= limits.connections
        self._connections[address] += 1
        try:
            if full or self._connections[address] > limits.per_address_connections:
                reply = self._refuse(address, "overloaded", f"too many connections from {address}")
            else:
                reply = await self._requests(address, reader, writer)
            if reply is not None:  # a last refusal, after which the stream is not trusted
                writer.write(reply)
                await asyncio.wait_for(writer.drain(), limits.request_s)
                await self._drain_and_close(reader, writer)
        except (ConnectionError, TimeoutError, asyncio.CancelledError):
            pass  # the peer went away, stalled, or the server is closing
        finally:
            self._connections[address] -= 1
            if not self._connections[address]:
                del self._connections[address]
            writer.close()

    @staticmethod
    async def _drain_and_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Close after a refusal so that the peer gets it: closing with its unread bytes
        still here would reset the connection and lose the reply. So: end our side, then
        read and drop what it sends (at most 1 MiB, for at most half a second)."""
        if writer.can_write_eof():
            writer.write_eof()
        deadline = asyncio.get_running_loop().time() + 0.5
        dropped = 0
        with contextlib.suppress(TimeoutError, ConnectionError):
            while dropped < (1 << 20):
                left = deadline - asyncio.get_running_loop().time()
                chunk = await asyncio.wait_for(reader.read(1 << 16), max(left, 0))
                if not chunk:
                    break
                dropped += len(chunk)

    async def _requests(
        self, address: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bytes | None:
        """Answer requests on one connection until it ends; a refusal that ends it."""
        limits = self.limits
        while True:
            try:
                header = await asyncio.wait_for(reader.readexactly(_HEADER.size), limits.idle_s)
            except (asyncio.IncompleteReadError, TimeoutError):
                return None  # the peer is done (or idle)
            magic, version, kind, _, length = _HEADER.unpack(header)
            if (magic, version, kind) != (_MAGIC, _VERSION, _REQUEST):
                return self._refuse(
                    address, "malformed", f"not a kvshare side-channel request: {header!r}"
                )
            if length > limits.max_request_bytes:  # refused unread
                return self._refuse(
                    address, "oversize", f"request of {length} B exceeds "
                    f"{limits.max_request_bytes} B"
                )  # fmt: skip
            try:
                body = await asyncio.wait_for(reader.readexactly(length), limits.request_s)
            except (asyncio.IncompleteReadError, TimeoutError):
                self._refuse(address, "incomplete", "request not sent whole in time")
                return None
            reply = await self._answer(address, body)
            if reply is None:  # this address spent its refusal budget
                return None
            writer.write(reply)
            await asyncio.wait_for(writer.drain(), limits.request_s)

    async def _answer(self, address: str, body: bytes) -> bytes | None:
        try:
            request = _request_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return self._refuse(address, "malformed", f"undecodable request: {exc}")
        if request.destination != self.destination:
            return self._refuse(
                address,
                "misaddressed",
                f"request addressed to {request.destination[:200]!r}, this is "
                f"{self.destination!r} (a relayed request, or kv_transfer_params naming "
                "another host or port than this prefill advertises)",
            )
        nonce = b""
        if self._secret is None:
            if request.auth:
                return self._refuse(
                    address, "unauthenticated", "signed request, but this side channel has "
                    "no side_channel_secret"
                )  # fmt: skip
        else:
            why = self._authenticate(request)
            if why is not None:
                return self._refuse(address, *why)
            nonce = request.auth[:_NONCE]
        if not self._accepted.take(address):
            return self._refuse(address, "busy", f"{address} sends faster than allowed: retry")
        try:
            payload = await self._handle(request.payload)
        except Exception as exc:  # never let one request stop the listener
            logger.exception("side channel: handler failed")
            return self._refuse(address, "failed", f"the request failed: {exc}")
        mac = _mac(self._secret, _REPLY_DOMAIN, nonce, payload) if self._secret else b""
        return encode_reply("ok", payload, mac)

    async def _handle(self, payload: bytes) -> bytes:
        if not self._inline:
            answer = await self._loop.run_in_executor(self._pool, self._handler, payload)
        else:
            answer = self._handler(payload)
        while callable(answer):  # it has to wait: not on the loop
            answer = await self._loop.run_in_executor(self._pool, answer)
        return answer

    def _authenticate(self, request: _Request) -> tuple[str, str] | None:
        """Why an authenticated request is refused (code, text), or None."""
        assert self._secret is not None
        auth = request.auth
        if len(auth) != _AUTH:
            return "unauthenticated", (
                "request is not authenticated (this side channel requires the shared "
                "side_channel_secret)"
            )
        nonce, stamp, mac = auth[:_NONCE], auth[_NONCE : _NONCE + _STAMP], auth[-_MAC:]
        expected = _mac(
            self._secret, _REQUEST_DOMAIN, nonce, stamp, request.destination.encode() + b"\0",
            request.payload,
        )  # fmt: skip
        if not hmac.compare_digest(mac, expected):
            return "unauthenticated", "request has a wrong MAC (another side_channel_secret?)"
        now = time.time()
        sent = struct.unpack(">Q", stamp)[0] / 1000
        if abs(now - sent) > MAX_SKEW_S:
            return "stale", f"request is {now - sent:+.0f} s old (replay or clock skew)"
        while self._nonces and next(iter(self._nonces.values())) < now:
            self._nonces.popitem(last=False)
        if nonce in self._nonces:
            return "replayed", "request was replayed"
        self._nonces[nonce] = now + 2 * MAX_SKEW_S
        while len(self._nonces) > _MAX_NONCES:
            self._nonces.popitem(last=False)
        return None

    def close(self) -> None:
        if self._thread.is_alive():
            done = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
            with contextlib.suppress(Exception):
                done.result(timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)


def reply_length(header: bytes, where: str, max_reply_bytes: int = MAX_REPLY_BYTES) -> int:
    """The body length a reply's header states (``SideChannelError`` if it is none)."""
    magic, version, kind, _, length = _HEADER.unpack(header)
    if (magic, version, kind) != (_MAGIC, _VERSION, _REPLY) or length > max_reply_bytes:
        raise SideChannelError(
            f"peer at {where} answered something else than a kvshare side-channel reply "
            f"({length} B)"
        )
    return length


def open_reply(body: bytes, nonce: bytes, secret: bytes | None, where: str) -> bytes:
    """The answer a reply body carries, once it is checked to answer the request that
    ``nonce`` was sent with; ``SideChannelRefused`` for a refusal."""
    try:
        reply = _reply_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SideChannelError(f"peer at {where} answered a malformed reply: {exc}") from exc
    if reply.code != "ok":
        text = reply.payload[:MAX_REFUSAL_CHARS].decode(errors="replace")
        raise SideChannelRefused(reply.code, f"peer at {where} refused ({reply.code}): {text}")
    if secret is not None and not hmac.compare_digest(
        reply.mac, _mac(secret, _REPLY_DOMAIN, nonce, reply.payload)
    ):
        raise SideChannelError(
            f"reply from {where} is not authenticated (is side_channel_secret the same on prefill?)"
        )
    return reply.payload
