"""The side channel's wire: a 12-byte header that states the body's length, a msgpack
body, and with a shared secret ``nonce | time | HMAC-SHA256`` over the payload and its
destination, the reply's MAC over the request's nonce (``side_channel`` serves it,
``side_channel_client`` asks)."""

from __future__ import annotations

import functools
import hashlib
import hmac
import struct
import time

import msgspec

from kvshare_connector.transfer.wire.side_channel_replay import (
    NONCE_BYTES,
    ReplayWindows,
    next_nonce,
)

MAX_REQUEST_BYTES = 1 << 20  # a claim naming ~100k block ids fits
MAX_REPLY_BYTES = 64 << 20  # a handshake reply carries a layout and NIXL metadata
MAX_SKEW_S = 120.0  # clocks of the two hosts may differ this much
MAX_REFUSAL_CHARS = 300  # refusal texts sent and logged
_MAGIC = b"KVSC"
_VERSION = 2  # 2: the nonce is a sender id and its counter (side_channel_replay)
_HEADER = struct.Struct(">4sBBHI")  # magic, version, kind, reserved, body length
_REQUEST, _REPLY = 1, 2
_NONCE, _STAMP, _MAC = NONCE_BYTES, 8, 32
_AUTH = _NONCE + _STAMP + _MAC
_REQUEST_DOMAIN = b"kvshare-side-channel-request-v3\0"
_REPLY_DOMAIN = b"kvshare-side-channel-reply-v3\0"
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


@functools.lru_cache(maxsize=4)
def _keyed(secret: bytes) -> hmac.HMAC:
    """HMAC-SHA256 with ``secret`` set up once: a copy costs half of a new one."""
    return hmac.new(secret, digestmod=hashlib.sha256)


def _mac(secret: bytes, *parts: bytes) -> bytes:
    h = _keyed(secret).copy()
    for part in parts:
        h.update(part)
    return h.digest()


def _frame(kind: int, body: bytes, version: int = _VERSION) -> bytes:
    return _HEADER.pack(_MAGIC, version, kind, 0, len(body)) + body


HEADER_BYTES = _HEADER.size


def encode_request(payload: bytes, where: str, secret: bytes | None = None) -> tuple[bytes, bytes]:
    """A framed request to ``where`` (``destination``), signed with ``secret``; with the
    nonce its reply's MAC covers (empty without a secret)."""
    nonce, auth = b"", b""
    if secret is not None:
        nonce = next_nonce()
        stamp = struct.pack(">Q", int(time.time() * 1000))
        auth = (
            nonce
            + stamp
            + _mac(secret, _REQUEST_DOMAIN, nonce, stamp, where.encode() + b"\0", payload)
        )
    return _frame(_REQUEST, _encoder.encode(_Request(where, auth, payload))), nonce


def authenticate(
    request: _Request, secret: bytes, replays: ReplayWindows, now: float
) -> tuple[str, str] | None:
    """Why a request to a server with ``secret`` is refused (code, text), or None: the
    MAC first, then its age, then whether it was seen (``replays``)."""
    auth = request.auth
    if len(auth) != _AUTH:
        return "unauthenticated", (
            "request is not authenticated (this side channel requires the shared "
            "side_channel_secret)"
        )
    nonce, stamp, mac = auth[:_NONCE], auth[_NONCE : _NONCE + _STAMP], auth[-_MAC:]
    expected = _mac(
        secret, _REQUEST_DOMAIN, nonce, stamp, request.destination.encode() + b"\0",
        request.payload,
    )  # fmt: skip
    if not hmac.compare_digest(mac, expected):
        return "unauthenticated", "request has a wrong MAC (another side_channel_secret?)"
    sent = struct.unpack(">Q", stamp)[0] / 1000
    if abs(now - sent) > MAX_SKEW_S:
        return "stale", f"request is {now - sent:+.0f} s old (replay or clock skew)"
    why = replays.check(nonce, sent, now)
    if why == "busy":
        return "busy", f"{len(replays)} signing processes at once: retry"
    if why is not None:
        return "replayed", "request was replayed"
    return None


def encode_reply(code: str, payload: bytes, mac: bytes = b"") -> bytes:
    """A framed reply: ``ok`` with the answer, or a refusal's code with its text."""
    return _frame(_REPLY, _encoder.encode(_Reply(code, mac, payload)))


def reply_length(header: bytes, where: str, max_reply_bytes: int = MAX_REPLY_BYTES) -> int:
    """The body length a reply's header states (``SideChannelError`` if it is none)."""
    magic, version, kind, _, length = _HEADER.unpack(header)
    if magic == _MAGIC and version != _VERSION:
        raise SideChannelError(
            f"peer at {where} speaks side-channel frame version {version}, this engine "
            f"{_VERSION}: run the same kvshare-connector release on every engine"
        )
    if (magic, kind) != (_MAGIC, _REPLY) or length > max_reply_bytes:
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
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
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
