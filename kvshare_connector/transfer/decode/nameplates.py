"""Decode: the nameplate of each new prefill agent, READ and checked before any claim
(``device.nameplate`` says why)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvshare_connector.layout.topology import Region
from kvshare_connector.transfer.decode.peers import PeerIdentityError
from kvshare_connector.transfer.device.nameplate import NAMEPLATE_BYTES, decode
from kvshare_connector.transfer.device.nixl import NixlTransport, TransportError

SLOTS = 16  # nameplate READs in flight at once (one per new prefill agent)


@dataclass
class _Reading:
    handle: Any
    slot: int
    started: float
    looked: int  # the round it was last looked at


class Nameplates:
    """Decode: READs each new prefill agent's nameplate once, on the engine thread, and
    checks it names the endpoint decode asked (``verified``)."""

    def __init__(self, transport: NixlTransport, timeout_s: float):
        self.transport = transport
        self.timeout_s = timeout_s
        self.buffer = np.zeros((SLOTS, NAMEPLATE_BYTES), dtype=np.uint8)
        transport.register([Region(int(self.buffer.ctypes.data), self.buffer.nbytes, -1)])
        self._free = list(range(SLOTS))
        self._reading: dict[str, _Reading] = {}  # agent -> its READ in flight
        self._checked: dict[str, str] = {}  # agent -> the destination it named
        self._round = 0

    def next_round(self) -> None:
        """A new advance: a READ in flight is looked at once per round, so every read of
        one prefill sees the same answer in one step (and is claimed in one message)."""
        self._round += 1

    def verified(self, agent: str, ref: tuple[int, int] | None, where: str) -> bool:
        """True once ``agent``'s nameplate (at ``ref``: address, bytes) is read and names
        ``where``; False while its READ is under way; ``PeerIdentityError`` if it names
        another endpoint, is no nameplate, or cannot be read."""
        named = self._checked.get(agent)
        if named is None:
            if ref is None:
                raise PeerIdentityError(
                    f"the engine at {where} names no nameplate in its handshake: cannot tell "
                    "that the NIXL agent it hands over is its own (an older kvshare?)"
                )
            named = self._read(agent, ref, where)
            if named is None:
                return False
        if named != where:
            raise PeerIdentityError(
                f"the endpoint {where} handed over the NIXL agent of {named} (a relayed "
                "handshake): refused, its claims would not be that engine's"
            )
        return True

    def _read(self, agent: str, ref: tuple[int, int], where: str) -> str | None:
        reading = self._reading.get(agent)
        if reading is None:
            if not self._free:
                return None  # others are being read: next round
            slot = self._free.pop()
            addr, nbytes = ref
            local = self.buffer[slot]
            local[:] = 0
            rows_local = np.asarray([[local.ctypes.data, NAMEPLATE_BYTES, 0]], np.int64)
            rows_remote = np.asarray([[addr, min(nbytes, NAMEPLATE_BYTES), 0]], np.int64)
            try:
                handle = self.transport.read(agent, rows_local, "DRAM", rows_remote, "DRAM", b"")
            except TransportError as exc:
                self._free.append(slot)
                raise PeerIdentityError(f"the nameplate of {where} cannot be read: {exc}") from exc
            reading = self._reading[agent] = _Reading(handle, slot, time.monotonic(), -1)
        if reading.looked == self._round:
            return None
        reading.looked = self._round
        state = self.transport.state(reading.handle)
        if state == "PROC" and time.monotonic() - reading.started < self.timeout_s:
            return None
        del self._reading[agent]
        if state == "PROC":
            self.transport.release(reading.handle)  # NIXL may still write the slot: lost
            raise PeerIdentityError(f"the nameplate of {where} did not arrive in time")
        self.transport.release(reading.handle)
        raw = self.buffer[reading.slot].tobytes()
        self._free.append(reading.slot)
        if state != "DONE":
            raise PeerIdentityError(f"the nameplate READ from {where} failed")
        named = decode(raw)
        if named is None:
            raise PeerIdentityError(
                f"the memory {where} names as its nameplate holds none: refused"
            )
        self._checked[agent] = named
        return named

    def forget(self, agent: str) -> None:
        """``agent`` was removed: a new one of that name is read again."""
        self._checked.pop(agent, None)
        reading = self._reading.pop(agent, None)
        if reading is not None:
            if self.transport.state(reading.handle) != "PROC":
                self._free.append(reading.slot)
            self.transport.release(reading.handle)
