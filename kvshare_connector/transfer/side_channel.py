"""The ZMQ side channel: prefill answers handshakes, decode asks with a bounded wait.

One request, one reply. The server never dies on a bad message (it answers an error and
keeps serving); the client never waits forever (a fresh socket per ask, closed with no
linger, so a dead peer costs exactly the timeout).

With a shared secret every message is authenticated (HMAC-SHA256, see docs/security.md):
a request carries ``auth = nonce(16) | time_ms(8) | mac(32)`` over its payload, fresh
within ``MAX_SKEW_S`` and never seen before (no replays); the reply carries a MAC over the
request's nonce and its own payload, so it answers this request and no other. Messages
are size-bounded and each peer address gets a bounded message rate, so a peer can only
cost bounded work. Refusals are answered with an error and counted (``refused``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from kvshare_connector.common.log import get_logger

logger = get_logger(__name__)

SECRET_ENV = "KVSHARE_SIDE_CHANNEL_SECRET"
MAX_REQUEST_BYTES = 4 << 20  # a claim naming ~500k block ids fits
MAX_REPLY_BYTES = 256 << 20  # a handshake reply carries a layout and NIXL metadata
MAX_SKEW_S = 120.0  # clocks of the two hosts may differ this much
PEER_RATE = 200.0  # messages per second one peer address may send, sustained
PEER_BURST = 400.0
_MAX_PEERS = 4096  # peer addresses with a rate bucket (oldest forgotten first)
_MAX_NONCES = 1 << 18  # remembered nonces (a replay window; oldest forgotten first)
_NONCE = 16
_MAC = 32
_AUTH = _NONCE + 8 + _MAC
_REQUEST_DOMAIN = b"kvshare-side-channel-request\0"
_REPLY_DOMAIN = b"kvshare-side-channel-reply\0"


class SideChannelError(ConnectionError):
    """The peer could not be reached, did not answer in time, or answered unauthenticated."""


def resolve_secret(extra_config: Mapping[str, Any] | None = None) -> bytes | None:
    """``side_channel_secret`` of kv_connector_extra_config, else the environment."""
    value = (extra_config or {}).get("side_channel_secret") or os.environ.get(SECRET_ENV)
    if value is None or value == "":
        return None
    return value.encode() if isinstance(value, str) else bytes(value)


_warned_no_secret = False


def warn_if_no_secret(secret: bytes | None) -> None:
    """Once per process: the side channel runs unauthenticated."""
    global _warned_no_secret
    if secret is None and not _warned_no_secret:
        _warned_no_secret = True
        logger.warning(
            "KV side channel without a shared secret: any host that reaches it can handshake "
            "(and get the NIXL metadata that lets it READ the registered KV memory), claim "
            "or release requests. Set kv_connector_extra_config side_channel_secret or %s, "
            "and keep the side channel on a private network (docs/security.md)",
            SECRET_ENV,
        )


def _mac(secret: bytes, *parts: bytes) -> bytes:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.digest()


def zmq_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class SideChannelServer:
    """Answers each request with ``handler(payload)`` on a background thread.

    ``error(message)`` builds the payload of a refusal (an unauthenticated, oversize or
    rate-limited request); refusals are counted by reason in ``refused``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Callable[[bytes], bytes],
        secret: bytes | None = None,
        error: Callable[[str], bytes] | None = None,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        peer_rate: float = PEER_RATE,
        peer_burst: float = PEER_BURST,
    ):
        self._handler = handler
        self._secret = secret
        self._error = error or (lambda message: message.encode())
        self._max_request_bytes = max_request_bytes
        self._rate, self._burst = peer_rate, peer_burst
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._nonces: OrderedDict[bytes, float] = OrderedDict()
        self._refused_lock = threading.Lock()
        self._refused: Counter[str] = Counter()
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # Far above any legal request: zmq drops the connection of a peer that sends more,
        # before buffering it; between the two bounds a request is refused and counted.
        self._socket.setsockopt(zmq.MAXMSGSIZE, 4 * max_request_bytes)
        if ":" in host:
            self._socket.setsockopt(zmq.IPV6, 1)
        try:
            if port == 0:
                host_part = f"[{host}]" if ":" in host else host
                self.port = self._socket.bind_to_random_port(f"tcp://{host_part}")
            else:
                self._socket.bind(zmq_address(host, port))
                self.port = port
        except zmq.ZMQError as exc:
            self._socket.close()
            raise SideChannelError(f"cannot listen on {host}:{port}: {exc}") from exc
        self.host = host
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, name="kvshare-side-channel", daemon=True
        )
        self._thread.start()

    @property
    def refused(self) -> dict[str, int]:
        with self._refused_lock:
            return dict(self._refused)

    def take_refused(self) -> dict[str, int]:
        """Refusals since the last call, by reason (for stats)."""
        with self._refused_lock:
            out, self._refused = dict(self._refused), Counter()
            return out

    def _refuse(self, reason: str, message: str, frames: list[bytes]) -> list[bytes]:
        """Count and answer a refusal in the asker's format: the protocol's error payload to
        a plain request; ``[b"", text]`` to an authenticated one (a reply without a MAC,
        which that client reports and never takes for an answer)."""
        with self._refused_lock:
            self._refused[reason] += 1
        logger.warning("side channel: refused a message (%s): %s", reason, message)
        if len(frames) == 1:
            return [self._error(message)]
        return [b"", message.encode()]

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._socket.recv_multipart(copy=False)
            if len(frames) not in (3, 4) or frames[1].bytes != b"":
                with self._refused_lock:
                    self._refused["malformed"] += 1
                logger.warning("side channel: dropped a message of %d frame(s)", len(frames))
                continue
            try:
                peer = frames[0].get("Peer-Address")
            except zmq.ZMQError:
                peer = None
            identity = frames[0].bytes
            try:
                reply = self._answer(str(peer or identity.hex()), [f.bytes for f in frames[2:]])
            except Exception:  # never let one bad request stop the listener
                logger.exception("side channel: handler failed")
                continue
            self._socket.send_multipart([identity, b"", *reply])
        self._socket.close()

    def _answer(self, peer: str, frames: list[bytes]) -> list[bytes]:
        """``[payload]`` without a secret, ``[mac, payload]`` with one."""

        def refuse(reason: str, message: str) -> list[bytes]:
            return self._refuse(reason, message, frames)

        if not self._take_token(peer):
            return refuse("rate_limited", f"peer {peer} sends too fast")
        size = sum(len(f) for f in frames)
        if size > self._max_request_bytes:
            return refuse(
                "oversize", f"message of {size} B from {peer} exceeds {self._max_request_bytes} B"
            )
        payload = frames[-1]
        if self._secret is None:
            if len(frames) != 1:
                return refuse(
                    "unauthenticated",
                    f"{peer} sent an authenticated message, but this side channel has no "
                    "side_channel_secret",
                )
            return [self._handler(payload)]
        if len(frames) != 2 or len(frames[0]) != _AUTH:
            return refuse(
                "unauthenticated",
                f"message from {peer} is not authenticated (this side channel requires the "
                "shared side_channel_secret)",
            )
        auth = frames[0]
        nonce, stamp, mac = auth[:_NONCE], auth[_NONCE : _NONCE + 8], auth[_NONCE + 8 :]
        expected = _mac(self._secret, _REQUEST_DOMAIN, nonce, stamp, payload)
        if not hmac.compare_digest(mac, expected):
            return refuse(
                "unauthenticated", f"message from {peer} has a wrong MAC (another secret?)"
            )
        sent = struct.unpack(">Q", stamp)[0] / 1000
        now = time.time()
        if abs(now - sent) > MAX_SKEW_S:
            return refuse(
                "stale", f"message from {peer} is {now - sent:+.0f} s old (replay or clock skew)"
            )
        if not self._fresh(nonce, now):
            return refuse("replayed", f"message from {peer} was replayed")
        reply = self._handler(payload)
        return [_mac(self._secret, _REPLY_DOMAIN, nonce, reply), reply]

    def _take_token(self, peer: str) -> bool:
        """Token bucket per peer address: bounded work per peer, cheap refusals beyond."""
        now = time.monotonic()
        tokens, last = self._buckets.pop(peer, (self._burst, now))
        tokens = min(self._burst, tokens + (now - last) * self._rate)
        allowed = tokens >= 1.0
        self._buckets[peer] = (tokens - 1.0 if allowed else tokens, now)
        while len(self._buckets) > _MAX_PEERS:
            self._buckets.popitem(last=False)
        return allowed

    def _fresh(self, nonce: bytes, now: float) -> bool:
        while self._nonces and next(iter(self._nonces.values())) < now:
            self._nonces.popitem(last=False)
        if nonce in self._nonces:
            return False
        self._nonces[nonce] = now + 2 * MAX_SKEW_S
        while len(self._nonces) > _MAX_NONCES:
            self._nonces.popitem(last=False)
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def ask(
    host: str,
    port: int,
    payload: bytes,
    timeout_s: float,
    secret: bytes | None = None,
    max_reply_bytes: int = MAX_REPLY_BYTES,
) -> bytes:
    """Send one request and wait at most ``timeout_s`` for the reply (authenticated both
    ways with ``secret``)."""
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_reply_bytes)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    nonce = secrets.token_bytes(_NONCE)
    try:
        sock.connect(zmq_address(host, port))
        if secret is None:
            sock.send_multipart([b"", payload])
        else:
            stamp = struct.pack(">Q", int(time.time() * 1000))
            auth = nonce + stamp + _mac(secret, _REQUEST_DOMAIN, nonce, stamp, payload)
            sock.send_multipart([b"", auth, payload])
        if not sock.poll(int(timeout_s * 1000)):
            raise SideChannelError(
                f"no answer from the prefill side channel at {host}:{port} within {timeout_s:g} s"
            )
        frames = sock.recv_multipart()
    finally:
        sock.close()
    if secret is not None and len(frames) == 2 and frames[0] == b"":
        raise SideChannelError(
            f"reply from {host}:{port} is not authenticated (is side_channel_secret set on "
            "prefill?)"
        )
    if len(frames) != (2 if secret is None else 3) or frames[0] != b"":
        raise SideChannelError(f"peer at {host}:{port} answered {len(frames)} malformed frame(s)")
    if secret is None:
        return frames[1]
    if frames[1] == b"":
        # A refusal (it cannot be bound to an unauthenticated request): report its text,
        # trust nothing in it.
        text = frames[2][:500].decode(errors="replace")
        raise SideChannelError(f"peer at {host}:{port} refused the message: {text}")
    if not hmac.compare_digest(frames[1], _mac(secret, _REPLY_DOMAIN, nonce, frames[2])):
        raise SideChannelError(
            f"reply from {host}:{port} is not authenticated (is side_channel_secret the same "
            "on prefill?)"
        )
    return frames[2]
