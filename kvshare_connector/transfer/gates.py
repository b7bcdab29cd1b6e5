"""Device work launched before its input is there, started by a store to host memory.

A packed read's bytes reach decode's staging slot over NIXL; the scatter into the request's
blocks can only start once NIXL says they are there, and launching it then costs the host
0.2-0.3 ms that the wire and the GPU spend waiting (2026-12-06e, 32k on one H100: the READ
seen done ~0.2 ms after its post, the blocks filled 0.9 ms after it). A gate is a CUDA
stream held by ``cuStreamWaitValue32`` on a word of pinned host memory: the scatter is
queued behind it right after the post, while the bytes are on their way, and once NIXL says
done the host only stores the word (``Gate.open``) and the GPU starts the copy. Each gate
has a stream of its own, so a read that finishes early never waits behind one that does not.

Every armed gate must be opened, whatever becomes of its read: a closed one holds its stream
forever. A read that fails opens its gate too and waits for the copy behind it, which then
writes stale staging bytes into blocks that are not vLLM's until the failure is reported.

Only the CUDA driver has stream memory operations: without CUDA, or where the driver refuses
them, ``StreamGates.create`` says why and the scatter is launched once the READ is done.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

STREAMS = 8  # gates (and streams): reads whose scatter waits at once; more launch unarmed
_WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0, wrap-safe


class GateError(RuntimeError):
    """The driver refused to hold a stream on a host word."""


def _wait_value_fn() -> Any:
    """The driver's ``cuStreamWaitValue32`` (its v2 entry point where exported)."""
    lib = ctypes.CDLL("libcuda.so.1")
    fn = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


@dataclass
class Gate:
    """One armed stream: work queued on ``stream`` after ``arm`` runs once ``open`` is called."""

    stream: Any
    _owner: StreamGates
    _index: int
    _value: int
    opened: bool = False

    def open(self) -> None:
        """Let the stream go (idempotent)."""
        if not self.opened:
            self.opened = True
            self._owner._open(self._index, self._value)


class StreamGates:
    """A few high-priority streams, each of which can be held on its own host word."""

    def __init__(self, device: Any, streams: int = STREAMS, wait_value: Any = None):
        import torch

        from kvshare_connector.transfer.packing import side_stream

        self._wait = wait_value or _wait_value_fn()
        self._words = torch.zeros(streams, dtype=torch.int32, pin_memory=True)
        self._host = self._words.numpy().view("uint32")  # stores the GPU sees
        self._streams = [side_stream(device) for _ in range(streams)]
        self._values = [0] * streams  # the last value each stream was held for
        self._armed: dict[int, Gate] = {}

    @classmethod
    def create(cls, device: Any) -> tuple[StreamGates | None, str]:
        """Gates on ``device``, or None and why not."""
        import torch

        if torch.device(device).type != "cuda":
            return None, "off (no CUDA device)"
        try:
            gates = cls(device)
            gates.arm().open()  # the driver takes a wait on host memory, and lets it go
        except Exception as exc:
            return None, f"off ({type(exc).__name__}: {exc})"
        return gates, f"on ({len(gates._streams)} streams)"

    @property
    def armed(self) -> int:
        return len(self._armed)

    def arm(self) -> Gate | None:
        """A stream held until the gate opens; None when every stream is held already."""
        free = [i for i in range(len(self._streams)) if i not in self._armed]
        if not free:
            return None
        i = free[0]
        value = (self._values[i] + 1) & 0xFFFFFFFF
        address = self._words.data_ptr() + 4 * i  # pinned host memory: the GPU reads it as is
        rc = self._wait(ctypes.c_void_p(self._streams[i].cuda_stream), address, value, _WAIT_GEQ)
        if rc != 0:
            raise GateError(f"cuStreamWaitValue32 failed (CUresult {rc})")
        self._values[i] = value
        gate = Gate(self._streams[i], self, i, value)
        self._armed[i] = gate
        return gate

    def _open(self, index: int, value: int) -> None:
        self._host[index] = value
        self._armed.pop(index, None)

    def open_all(self) -> None:
        """Let every held stream go (shutdown: none may stay held)."""
        for gate in list(self._armed.values()):
            gate.open()
