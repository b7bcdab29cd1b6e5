"""Device work launched before its input is there, started by a store to host memory.

A packed read's bytes reach decode's staging slot over NIXL; the scatter into the request's
blocks can only start once NIXL says they are there, and launching it then costs the host
0.2-0.3 ms that the wire and the GPU spend waiting (2026-12-06e, 32k on one H100: the READ
seen done ~0.2 ms after its post, the blocks filled 0.9 ms after it). A gate is a CUDA
stream held by ``cuStreamWaitValue32`` on a word of pinned host memory: the scatter is
queued behind it right after the post, while the bytes are on their way, and once NIXL says
done the host only stores the word (``Gate.open``) and the GPU starts the copy. Each gate
has a stream of its own, so a read that finishes early never waits behind one that does not.

A held stream is held for everyone: a device-wide synchronize in the engine thread (vLLM
makes one for prompt logprobs) would wait for a gate only that thread opens. So no gate is
held longer than ``hold_s``: past it the keeper thread opens it, marked ``early``, and the
landing copies again once the bytes are there (``Lander.land``). A read that fails opens its
gate too and waits for the copy behind it, which writes stale staging bytes into blocks that
are not vLLM's until the failure is reported.

``Gates`` is the bookkeeping (which stream is held, until when, the keeper); ``StreamGates``
holds and releases real CUDA streams. Without CUDA, or where the driver refuses stream
memory operations, ``StreamGates.create`` says why and scatters launch once the READ is done.

Off by default (option ``armed_landing``): arming runs on the host right after the
post, and on one H200 (2026-12-06g) it took 0.37 ms, longer than a 107 MB cuda_ipc READ
(0.15 ms), so a 16k load landed no sooner. It can pay only where a READ outlasts it.
"""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass
from typing import Any

STREAMS = 8  # gates (and streams): reads whose scatter waits at once; more launch unarmed
HOLD_S = 0.05  # longest a stream stays held (a READ on one H100 at 16 x 16k: 2-5 ms p50)
_WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0, wrap-safe


class GateError(RuntimeError):
    """The driver refused to hold a stream on a host word."""


@dataclass
class Gate:
    """One held stream: work queued on ``stream`` after ``arm`` runs once it opens."""

    stream: Any
    _owner: Gates
    _index: int
    _value: int
    deadline: float
    opened: bool = False
    early: bool = False  # opened by the keeper, before its read was known to be done

    def open(self) -> None:
        """Let the stream go (idempotent)."""
        self._owner._open(self, early=False)


class Gates:
    """Streams that can each be held until their gate opens, and the keeper thread that
    opens any held past ``hold_s``."""

    def __init__(self, streams: list[Any], hold_s: float = HOLD_S):
        self._streams = streams
        self.hold_s = hold_s
        self._values = [0] * len(streams)  # the last value each stream was held for
        self._armed: dict[int, Gate] = {}
        self._lock = threading.Condition()
        self._closed = False
        self._keeper = threading.Thread(target=self._keep, name="kvshare-gates", daemon=True)
        self._keeper.start()

    @property
    def armed(self) -> int:
        return len(self._armed)

    def _hold(self, index: int, value: int) -> None:
        """Hold stream ``index`` until its word reaches ``value``."""
        raise NotImplementedError

    def _release(self, index: int, value: int) -> None:
        """Let stream ``index`` go: its word becomes ``value``."""
        raise NotImplementedError

    def arm(self) -> Gate | None:
        """A stream held until the gate opens; None when every stream is held already."""
        with self._lock:
            free = [i for i in range(len(self._streams)) if i not in self._armed]
            if not free or self._closed:
                return None
            i = free[0]
            value = (self._values[i] + 1) & 0xFFFFFFFF
            self._hold(i, value)
            self._values[i] = value
            gate = Gate(self._streams[i], self, i, value, time.monotonic() + self.hold_s)
            self._armed[i] = gate
            self._lock.notify()
        return gate

    def _open(self, gate: Gate, early: bool) -> None:
        with self._lock:
            if gate.opened:
                return
            gate.opened, gate.early = True, early
            self._release(gate._index, gate._value)
            self._armed.pop(gate._index, None)

    def _keep(self) -> None:
        with self._lock:
            while not self._closed:
                if not self._armed:
                    self._lock.wait()
                    continue
                now = time.monotonic()
                due = min(g.deadline for g in self._armed.values())
                if due > now:
                    self._lock.wait(due - now)
                    continue
                for gate in [g for g in self._armed.values() if g.deadline <= now]:
                    self._open(gate, early=True)

    def close(self) -> None:
        """Open every held gate and stop the keeper (idempotent)."""
        with self._lock:
            self._closed = True
            for gate in list(self._armed.values()):
                self._open(gate, early=True)
            self._lock.notify()
        if self._keeper is not threading.current_thread():
            self._keeper.join(timeout=5)


def _wait_value_fn() -> Any:
    """The driver's ``cuStreamWaitValue32`` (its v2 entry point where exported)."""
    lib = ctypes.CDLL("libcuda.so.1")
    fn = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


class StreamGates(Gates):
    """CUDA streams of the highest priority, each held on its own word of pinned memory."""

    def __init__(self, device: Any, streams: int = STREAMS, hold_s: float = HOLD_S):
        import torch

        from kvshare_connector.transfer.packing import side_stream

        self._wait = _wait_value_fn()
        self._words = torch.zeros(streams, dtype=torch.int32, pin_memory=True)
        self._host = self._words.numpy().view("uint32")  # stores the GPU sees
        super().__init__([side_stream(device) for _ in range(streams)], hold_s)

    @classmethod
    def create(cls, device: Any) -> tuple[StreamGates | None, str]:
        """Gates on ``device``, or None and why not."""
        import torch

        if torch.device(device).type != "cuda":
            return None, "off (no CUDA device)"
        gates = None
        try:
            gates = cls(device)
            gate = gates.arm()
            assert gate is not None
            gate.open()  # the driver takes a wait on host memory, and lets it go
        except Exception as exc:
            if gates is not None:
                gates.close()
            return None, f"off ({type(exc).__name__}: {exc})"
        return gates, f"on ({len(gates._streams)} streams, held {gates.hold_s * 1e3:g} ms at most)"

    def _hold(self, index: int, value: int) -> None:
        address = self._words.data_ptr() + 4 * index  # pinned: the GPU reads it where it is
        stream = ctypes.c_void_p(self._streams[index].cuda_stream)
        rc = self._wait(stream, address, value, _WAIT_GEQ)
        if rc != 0:
            raise GateError(f"cuStreamWaitValue32 failed (CUresult {rc})")

    def _release(self, index: int, value: int) -> None:
        self._host[index] = value
