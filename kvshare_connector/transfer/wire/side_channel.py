"""The side channel: prefill answers handshakes, claims and releases; decode asks with a
bounded wait. One framed request, one framed reply, over TCP.

It is the door to prefill's KV (a handshake hands out the NIXL metadata that lets a peer
READ the registered memory), so everything a peer sends is bounded before it is buffered
and authenticated before it is acted on (docs/security.md has the threat model):

* framing: a 12-byte header states the body's length; a body over ``max_request_bytes``
  is refused without being read, a connection that stalls mid-request is closed, and the
  connections that have not authenticated are capped (in all, per address), so a client
  without the secret holds at most ``per_address_connections x max_request_bytes`` of the
  server's memory (a holder of the secret, ``per_address_authenticated x`` that more);
* a connection over a cap evicts one that has not authenticated (``side_channel_admission``)
  instead of being turned away: held-open connections cannot keep a decode out;
* with a shared secret every request carries ``nonce | time | HMAC-SHA256`` over its
  payload *and its destination* (the engine id and address it is meant for): a request
  relayed to another engine, replayed (``side_channel_replay``: at any rate, within its
  freshness), stale or signed with another secret is refused, and the reply carries a MAC
  over the request's nonce, so it answers this request only;
* authenticated requests and refused ones draw on separate per-address budgets, so a
  flood of garbage from a decode's own address cannot starve that decode; a refusal for
  rate says ``busy``, which clients retry instead of taking the peer for dead;
* every refusal is answered with its reason, counted, and logged within a line budget, and
  so is every failure on a connection (tracebacks within a budget of their own).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import socket
import struct
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from kvshare_connector.common.log import LogBudget, get_logger
from kvshare_connector.transfer.wire.kv_params import is_loopback
from kvshare_connector.transfer.wire.side_channel_admission import (
    Admission,
    Buckets,
    Connection,
    Limits,
)
from kvshare_connector.transfer.wire.side_channel_replay import ReplayWindows
from kvshare_connector.transfer.wire.side_channel_wire import (
    _HEADER,
    _MAGIC,
    _NONCE,
    _REPLY,
    _REPLY_DOMAIN,
    _REQUEST,
    _VERSION,
    BUSY,
    HEADER_BYTES,
    MAX_REFUSAL_CHARS,
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    MAX_SKEW_S,
    SideChannelError,
    SideChannelRefused,
    SideChannelReset,
    _encoder,
    _frame,
    _mac,
    _Reply,
    _request_decoder,
    authenticate,
    destination,
    encode_reply,
    encode_request,
    open_reply,
    reply_length,
)

__all__ = [  # the wire's names, as callers have always imported them from here
    "BUSY", "HEADER_BYTES", "MAX_REFUSAL_CHARS", "MAX_REPLY_BYTES", "MAX_REQUEST_BYTES",
    "MAX_SKEW_S", "Answer", "Limits", "SideChannelError", "SideChannelRefused",
    "SideChannelReset", "SideChannelServer", "check_exposure", "destination", "encode_reply",
    "encode_request", "is_loopback", "open_reply", "reply_length", "warn_if_no_secret",
]  # fmt: skip

logger = get_logger(__name__)

SECRET_ENV = "KVSHARE_SIDE_CHANNEL_SECRET"
INSECURE_ENV = "KVSHARE_SIDE_CHANNEL_INSECURE"
_CHUNK = 1 << 16  # a longer request body is read in pieces of this
_LINGER_0 = struct.pack("ii", 1, 0)  # close with a reset: an evicted peer sees one at once


def _reset(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_0)
    sock.close()


class _Link:
    """A connection's socket, its task and, once built, its writer: what ending it takes."""

    def __init__(self, sock: socket.socket, address: str):
        self.sock = sock
        self.conn = Connection(address, lambda why: None)  # ``end`` bound once admitted
        self.task: asyncio.Task[None] | None = None
        self.writer: asyncio.StreamWriter | None = None


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


Answer = bytes | Callable[[], bytes]  # a reply now, or work that may wait for one


class SideChannelServer:
    """Answers each request with ``handler(payload)``, from an event loop of its own;
    refusals are answered, counted by reason (``refused``; ``evicted``: connections reset
    to make room) and logged within a budget.

    The handler runs on the loop's thread and returns the reply, or a function that may
    wait (e.g. for device work) and is run on a helper thread. Each hop between threads
    costs up to a GIL switch interval (5 ms) while the engine thread runs Python, so what
    can be answered at once is (``lab/benchmarks/bench_claim_latency.py``).
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Callable[[bytes], Answer],
        secret: bytes | None = None,
        engine_id: str = "",
        limits: Limits | None = None,
        advertise: str | None = None,
    ):
        """Listens on ``host``; ``advertise`` (default: ``host``) is the host requests are
        addressed to, which decode dials: a listener on every interface (``0.0.0.0``)
        answers to the host's routable address (``transfer/wire/addresses.py``)."""
        self._handler = handler
        self._secret = secret
        self.limits = lim = limits or Limits()
        self._accepted = Buckets(lim.rate, lim.burst)
        self._refusals = Buckets(lim.refused_rate, lim.refused_burst)
        self._log = LogBudget(lim.log_lines, lim.log_window_s, logger=logger)
        # a traceback is long: one per minute, whatever fails (a handler, a connection)
        self._failures = LogBudget(1, 60.0, logging.ERROR, logger=logger, max_chars=4000)
        self._replays = ReplayWindows(MAX_SKEW_S, lim.senders)
        self._admission = Admission(
            lim.connections, lim.per_address_connections, lim.authenticated_connections,
            lim.per_address_authenticated,
        )  # fmt: skip
        self._refused_lock = threading.Lock()
        self._refused: Counter[str] = Counter()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvshare-side-channel")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP named, so asyncio sets TCP_NODELAY on what it accepts: without, a
        # reply behind another unacknowledged one waited for decode's delayed ACK (40 ms)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(256)
        except OSError as exc:
            sock.close()
            raise SideChannelError(f"cannot listen on {host}:{port}: {exc}") from exc
        self.host, self.port = advertise or host, sock.getsockname()[1]
        self.bind_host = host
        self.destination = destination(engine_id, self.host, self.port)
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(self._loop_failed)
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(sock, started), name="kvshare-side-channel", daemon=True
        )
        self._thread.start()
        started.wait()

    def _run(self, sock: socket.socket, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        sock.setblocking(False)
        self._listener = sock
        self._loop.add_reader(sock.fileno(), self._accept)
        self._loop.create_task(self._watch())
        started.set()
        self._loop.run_forever()
        self._loop.close()

    async def _shutdown(self) -> None:
        """Stop listening, end every connection, then the loop."""
        self._loop.remove_reader(self._listener.fileno())
        self._listener.close()
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

    def _count(self, code: str) -> None:
        with self._refused_lock:
            self._refused[code] += 1

    def _refuse(
        self, address: str, code: str, message: str, version: int = _VERSION
    ) -> bytes | None:
        """Count and log a refusal; its reply (framed as ``version``), or None once the
        address has spent its refusal budget (the connection is then closed without one)."""
        self._count(code)
        self._log.log(f"refused a request from {address} ({code}): {message}")
        if not self._refusals.take(address):
            return None
        body = _encoder.encode(_Reply(code, b"", message[:MAX_REFUSAL_CHARS].encode()))
        return _frame(_REPLY, body, version)

    def _failed(self, what: str) -> None:
        """An exception no peer should be able to cause: its traceback, within budget."""
        self._failures.log(f"{what}:\n{traceback.format_exc()[-3800:]}")

    def _loop_failed(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """What asyncio would log with a traceback (a callback's or a task's exception):
        within the budget, like everything else a peer may cause."""
        exc = context.get("exception")
        trace = "".join(traceback.format_exception(exc))[-3000:] if exc is not None else ""
        self._failures.log(f"{context.get('message', 'event loop error')}: {trace}")

    async def _watch(self) -> None:
        """End the connections past their deadline, ten times a second: one timer for all
        (a timer per read cost a third of the loop's time under a flood of requests)."""
        while True:
            await asyncio.sleep(0.1)
            try:
                for conn in self._admission.overdue(time.monotonic()):
                    conn.end("expired")
            except Exception:
                self._failed("side channel: the connection watch failed")

    def _accept(self) -> None:
        """Take the connections waiting (64 at most: requests in flight go on meanwhile).
        Admission decides on the bare socket, before anything is built for it: one turned
        away (over a cap, nobody evictable) is reset at once, a few microseconds however
        fast a peer connects (streams and a task cost a flood of them ten times that)."""
        for _ in range(64):
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the watch frees idle ones
                self._log.log(f"cannot accept a connection: {exc}")
                return
            link = _Link(sock, str(peer[0]))
            if not self._admission.admit(link.conn):
                self._count("overloaded")
                self._log.log(f"refused a connection from {link.conn.address}: too many")
                _reset(sock)
                continue
            link.task = self._loop.create_task(self._serve(link))
            link.conn.end = functools.partial(self._end, link)

    def _end(self, link: _Link, why: str) -> None:
        """End a connection at once: evicted (with a reset: its peer, a decode's, asks
        again), or expired (a request not sent whole in time, or idle too long)."""
        conn = link.conn
        if why == "evicted":
            self._count("evicted")
            with contextlib.suppress(OSError):
                link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_0)
        elif conn.stage == "request":
            self._refuse(conn.address, "incomplete", "request not sent whole in time")
        conn.deadline = math.inf
        if link.writer is not None:
            link.writer.transport.abort()
        else:
            link.sock.close()
        if link.task is not None:
            link.task.cancel()

    async def _serve(self, link: _Link) -> None:
        conn, address = link.conn, link.conn.address
        try:
            reader, link.writer = await asyncio.open_connection(sock=link.sock, limit=1 << 16)
            writer = link.writer
            reply = await self._requests(conn, reader, writer)
            if reply is not None:  # a last refusal, after which the stream is not trusted
                conn.stage, conn.deadline = "reply", time.monotonic() + self.limits.request_s
                writer.write(reply)
                await writer.drain()
                await self._drain_and_close(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the peer went away (ENOTCONN included), was evicted, or we close
        except Exception:  # never let one connection stop the listener, or log unbounded
            self._failed(f"side channel: the connection from {address} failed")
        finally:
            self._admission.leave(conn)
            if link.writer is not None:
                link.writer.close()
            else:
                link.sock.close()

    @staticmethod
    async def _drain_and_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Close after a refusal so that the peer gets it: closing with its unread bytes
        still here would reset the connection and lose the reply. So: end our side, then
        read and drop what it sends (at most 1 MiB, for at most half a second)."""
        with contextlib.suppress(OSError):  # ENOTCONN: the peer reset it meanwhile
            if writer.can_write_eof():
                writer.write_eof()
        dropped = 0
        with contextlib.suppress(TimeoutError, OSError):
            async with asyncio.timeout(0.5):
                while dropped < (1 << 20):
                    chunk = await reader.read(1 << 16)
                    if not chunk:
                        break
                    dropped += len(chunk)

    async def _requests(
        self, conn: Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bytes | None:
        """Answer requests on one connection until it ends; a refusal that ends it."""
        limits, address = self.limits, conn.address
        while True:  # deadlines, not timers: ``_watch`` ends a connection past its own
            self._admission.rest(conn, time.monotonic() + limits.idle_s)
            try:
                header = await reader.readexactly(_HEADER.size)
            except asyncio.IncompleteReadError:
                return None  # the peer is done
            conn.stage, conn.deadline = "request", time.monotonic() + limits.request_s
            self._admission.moved(conn)
            magic, version, kind, _, length = _HEADER.unpack(header)
            if (magic, kind) != (_MAGIC, _REQUEST):
                return self._refuse(
                    address, "malformed", f"not a kvshare side-channel request: {header!r}"
                )
            if version != _VERSION:  # answered in its own framing: the peer reads why
                return self._refuse(
                    address, "version", f"side-channel frame version {version} is not "
                    f"spoken here (this engine speaks {_VERSION}): run the same "
                    "kvshare-connector release on every engine", version,
                )  # fmt: skip
            if length > limits.max_request_bytes:  # refused unread
                return self._refuse(
                    address, "oversize", f"request of {length} B exceeds "
                    f"{limits.max_request_bytes} B"
                )  # fmt: skip
            try:
                body = await self._body(conn, reader, length)
            except asyncio.IncompleteReadError:
                self._refuse(address, "incomplete", "request not sent whole")
                return None
            reply, go_on = await self._answer(conn, body)
            if reply is None or not go_on:  # refusal budget spent, or a last refusal
                return reply
            conn.stage, conn.deadline = "reply", time.monotonic() + limits.request_s
            writer.write(reply)
            await writer.drain()

    async def _body(
        self, conn: Connection, reader: asyncio.StreamReader, length: int
    ) -> bytes | bytearray:
        """A request's body, read as it comes (each chunk moves the connection on)."""
        if length <= _CHUNK:
            return await reader.readexactly(length)
        body = bytearray()
        while len(body) < length:
            chunk = await reader.read(min(length - len(body), _CHUNK))
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(body), length)
            body += chunk
            self._admission.moved(conn)
        return body

    async def _answer(self, conn: Connection, body: bytes | bytearray) -> tuple[bytes | None, bool]:
        """The reply to one request, and whether the connection goes on after it."""
        address = conn.address
        try:
            request = _request_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            return self._refuse(address, "malformed", f"undecodable request: {exc}"), True
        if request.destination != self.destination:
            return self._refuse(
                address,
                "misaddressed",
                f"request addressed to {request.destination[:200]!r}, this is "
                f"{self.destination!r} (a relayed request, or kv_transfer_params naming "
                "another host or port than this prefill advertises)",
            ), True
        nonce = b""
        if self._secret is None:
            if request.auth:
                return self._refuse(
                    address, "unauthenticated", "signed request, but this side channel has "
                    "no side_channel_secret"
                ), True  # fmt: skip
        else:
            why = authenticate(request, self._secret, self._replays, time.time())
            if why is not None:
                return self._refuse(address, *why), True
            nonce = request.auth[:_NONCE]
            if not self._admission.authenticate(conn):
                return self._refuse(
                    address, "overloaded", f"too many authenticated connections from {address}"
                    " or in all, none idle"
                ), False  # fmt: skip
        if not self._accepted.take(address):
            why = f"{address} sends faster than allowed: retry"
            return self._refuse(address, "busy", why), True
        conn.stage, conn.deadline = "handler", math.inf
        try:
            payload = await self._handle(request.payload)
        except Exception as exc:  # never let one request stop the listener
            self._failed("side channel: handler failed")
            return self._refuse(address, "failed", f"the request failed: {exc!r}"), True
        finally:
            conn.stage, conn.deadline = "reply", time.monotonic() + self.limits.request_s
        mac = _mac(self._secret, _REPLY_DOMAIN, nonce, payload) if self._secret else b""
        return encode_reply("ok", payload, mac), True

    async def _handle(self, payload: bytes) -> bytes:
        answer = self._handler(payload)
        while callable(answer):  # it has to wait: not on the loop
            answer = await self._loop.run_in_executor(self._pool, answer)
        return answer

    def close(self) -> None:
        if self._thread.is_alive():
            done = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
            with contextlib.suppress(Exception):
                done.result(timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
