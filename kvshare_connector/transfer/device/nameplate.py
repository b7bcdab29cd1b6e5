"""Which side channel owns a NIXL agent, said in that agent's own memory.

A handshake reply carries a prefill's NIXL metadata, and anyone can relay it: without a
shared secret, an endpoint named in ``kv_transfer_params`` could hand decode the real
prefill's metadata and then approve claims itself, so that decode READs blocks the real
prefill never approved for that reader. So each prefill writes its side channel's
destination (``engine@host:port``, what decode dials) into a small registered buffer of its
own (``Nameplate``), and decode READs it through the agent it was handed before any claim
(``Nameplates``): the agent's memory names the endpoint that answers for it. A relayed
handshake names the other endpoint and is refused. What this cannot stop: a process that
itself WRITEs into prefill's registered memory over NIXL (any holder of the metadata can;
with a secret, only engines that hold it get the metadata: docs/security.md).
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from kvshare_connector.layout.topology import Region

NAMEPLATE_BYTES = 1024
_MAGIC = b"kvshare-nameplate-v1\0"
_LENGTH = struct.Struct("<H")
_DIGEST = 32
MAX_DESTINATION = NAMEPLATE_BYTES - len(_MAGIC) - _LENGTH.size - _DIGEST


def encode(destination: str) -> bytes:
    """The nameplate of ``destination``: magic, length, text, SHA-256 of those, zeros."""
    text = destination.encode()
    if len(text) > MAX_DESTINATION:
        raise ValueError(f"side-channel destination longer than {MAX_DESTINATION} bytes")
    record = _MAGIC + _LENGTH.pack(len(text)) + text
    record += hashlib.sha256(record).digest()
    return record.ljust(NAMEPLATE_BYTES, b"\0")


def decode(raw: bytes) -> str | None:
    """The destination a nameplate names, or None if ``raw`` is no whole nameplate."""
    if not raw.startswith(_MAGIC) or len(raw) < len(_MAGIC) + _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack_from(raw, len(_MAGIC))
    end = len(_MAGIC) + _LENGTH.size + length
    if length > MAX_DESTINATION or hashlib.sha256(raw[:end]).digest() != raw[end : end + _DIGEST]:
        return None
    return raw[len(_MAGIC) + _LENGTH.size : end].decode(errors="replace")


class Nameplate:
    """Prefill's nameplate: registered with its agent before the metadata is taken,
    written once its side channel's destination is known (the port may be any free one)."""

    def __init__(self) -> None:
        self.buffer = np.zeros(NAMEPLATE_BYTES, dtype=np.uint8)

    @property
    def region(self) -> Region:
        return Region(int(self.buffer.ctypes.data), NAMEPLATE_BYTES, -1)

    def write(self, destination: str) -> None:
        self.buffer[:] = np.frombuffer(encode(destination), dtype=np.uint8)
