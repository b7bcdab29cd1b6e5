"""Packed transfer, the torch half: a registered staging area and the gather/scatter kernels.

``layout.staging`` decides where every byte goes; this module moves them with one indexed
copy per backing storage (a few kernels per request instead of one NIXL descriptor per
block and layer). On CUDA the copies run on a side stream that first waits for the compute
stream, and report completion through an event, so neither side blocks the engine loop.
torch is imported lazily: the transfer layer stays importable without it.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvshare_connector.layout.staging import word_indices, word_size
from kvshare_connector.layout.topology import Region

ALIGN = 4096  # staging slots start on page boundaries: large words for the copy kernels


class PackingError(RuntimeError):
    """Memory the packed path cannot reach (a run outside every known tensor)."""


@dataclass(frozen=True)
class _Span:
    start: int
    end: int
    words: dict[int, Any]  # word size -> 2-D view of the storage (rows of one word)
    flat: Any  # uint8 view of the whole storage


class MemoryMap:
    """Byte addresses -> torch views of the storages behind the KV tensors."""

    def __init__(self, tensors: Iterable[Any]):
        import torch

        spans: dict[int, _Span] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            start = int(storage.data_ptr())
            if start in spans:
                continue
            flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
            flat.set_(storage, 0, (storage.nbytes(),), (1,))
            spans[start] = _Span(start, start + int(storage.nbytes()), {}, flat)
        self._spans = sorted(spans.values(), key=lambda s: s.start)
        self._starts = [s.start for s in self._spans]

    def span_of(self, addr: int, nbytes: int) -> _Span:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0 or addr + nbytes > self._spans[i].end:
            raise PackingError(f"no KV tensor holds {addr:#x} (+{nbytes})")
        return self._spans[i]

    def split(self, addr: np.ndarray, length: np.ndarray) -> list[tuple[_Span, np.ndarray]]:
        """The runs grouped by the storage holding them (indices into ``addr``)."""
        starts = np.asarray(self._starts, dtype=np.int64)
        ends = np.asarray([s.end for s in self._spans], dtype=np.int64)
        which = np.searchsorted(starts, addr, side="right") - 1
        inside = (which >= 0) & (addr + length <= ends[np.maximum(which, 0)])
        if not np.all(inside):
            bad = int(np.flatnonzero(~inside)[0])
            raise PackingError(f"no KV tensor holds {int(addr[bad]):#x} (+{int(length[bad])})")
        return [(self._spans[i], np.flatnonzero(which == i)) for i in np.unique(which).tolist()]

    @staticmethod
    def rows_of(span: _Span, word: int) -> Any:
        """The storage as rows of ``word`` bytes (int64 elements where the word allows)."""
        if word not in span.words:
            import torch

            usable = span.flat[: (span.flat.numel() // word) * word]
            if word % 8 == 0:
                span.words[word] = usable.view(torch.int64).view(-1, word // 8)
            else:
                span.words[word] = usable.view(-1, word)
        return span.words[word]


class StagingArea:
    """One contiguous buffer registered with the transport, handed out in aligned slots.

    First fit over a sorted free list: requests come and go in roughly FIFO order, and a
    full area only means a request travels unpacked (slower, still correct).
    """

    def __init__(self, nbytes: int, device: Any):
        import torch

        self.nbytes = (nbytes // ALIGN) * ALIGN
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.memory = MemoryMap([self.buffer])
        self.span = self.memory.span_of(int(self.buffer.data_ptr()), self.nbytes)
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (offset, size), sorted
        self.used: dict[int, int] = {}  # offset -> size

    @property
    def addr(self) -> int:
        return int(self.buffer.data_ptr())

    @property
    def region(self) -> Region:
        device = self.buffer.device
        return Region(self.addr, self.nbytes, -1 if device.type == "cpu" else device.index or 0)

    def allocate(self, nbytes: int) -> int | None:
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                self.used[offset] = size
                return offset
        return None

    def release(self, offset: int) -> None:
        size = self.used.pop(offset)
        bisect.insort(self._free, (offset, size))
        merged: list[tuple[int, int]] = []
        for start, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._free = merged


@dataclass(frozen=True)
class CopyPlan:
    """A gather's or scatter's word indices, per storage ``(span, word, rows)``, uploaded."""

    spans: list[tuple[Any, int, int]]
    index: Any  # the KV side's rows, then the staging side's, for each span in turn
    upload_s: float = 0.0  # host seconds of the index upload, a part of the planning


class Copy:
    """A gather or scatter in flight: ``done()`` once the bytes are in place."""

    def __init__(self, event: Any | None):
        self.event = event  # recorded after the copy on its stream (None: done already)

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def upload(indices: np.ndarray, device: Any) -> Any:
    """Host int64 indices on ``device`` without blocking the host: through pinned memory
    (a copy from pageable memory would make the engine thread wait for the device)."""
    import torch

    host = torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64))
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def upload_on(stream: Any, indices: np.ndarray, device: Any) -> tuple[Any, float]:
    """``upload`` on ``stream`` (None: the current one), so that work launched there later
    is ordered after it; and the host seconds it took (a part of a plan, in the read log)."""
    import torch

    context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    clock = time.perf_counter()
    with context:
        uploaded = upload(indices, device)
    return uploaded, time.perf_counter() - clock


def side_stream(device: Any) -> Any:
    """The device's highest-priority stream, for work a load waits on (gather, scatter,
    digests): its blocks are scheduled ahead of the engine's forward as soon as SMs free
    up (CUDA never preempts running blocks), instead of queueing behind a forward that may
    hold the GPU for a step. The lead (2026-12-03b, one GPU for nine engines): claims that
    reached prefill within ~15 ms of the hold took 100-180 ms, later ones 2-12 ms, and a
    claim waits for the request's gather and digests. PyTorch maps the number to the
    device's highest priority."""
    import torch

    return torch.cuda.Stream(device=device, priority=-(1 << 20))


class Packer:
    """Gathers a request's runs into a staging slot, or scatters a slot into blocks."""

    def __init__(self, memory: MemoryMap, staging: StagingArea):
        self.memory = memory
        self.staging = staging
        self._stream: Any = None
        if staging.buffer.device.type == "cuda":

            self._stream = side_stream(staging.buffer.device)

    def gather(
        self, addr: np.ndarray, length: np.ndarray, slot_offsets: np.ndarray,
        after_compute: bool = True,
    ) -> Copy:  # fmt: skip
        """Copy runs ``(addr, length)`` of the KV memory to ``slot_offsets`` of the area;
        ``after_compute``: behind what the compute stream has queued (see ``_launch``)."""
        plan = self.plan_copy(addr, length, slot_offsets)
        return self._launch(plan, to_staging=True, wait=after_compute)

    def scatter(
        self, addr: np.ndarray, length: np.ndarray, staged: np.ndarray, slot: int = 0,
        plan: CopyPlan | None = None,
    ) -> Copy:  # fmt: skip
        """Copy ``staged`` offsets of the slot at ``slot`` (``length`` each) back to runs at
        ``addr``; ``plan``: made by ``plan_copy`` for these runs beforehand, with offsets
        relative to the slot (decode plans while its claim is out, before it has a slot),
        so only the launch is left here."""
        plan = plan or self.plan_copy(addr, length, staged)
        return self._launch(plan, to_staging=False, wait=True, slot=slot)

    def plan_copy(self, addr: np.ndarray, length: np.ndarray, staged: np.ndarray) -> CopyPlan:
        """The word indices of a copy between runs ``(addr, length)`` of the KV memory and
        offsets ``staged`` of the area (or of a slot: slots start on ``ALIGN``, a multiple
        of every word), per storage, uploaded in one go (on the side stream, so a copy
        launched there later is ordered after it)."""
        plans, parts = [], []
        for span, rows in self.memory.split(addr, length):
            offsets = addr[rows] - span.start
            word = word_size(np.concatenate([offsets, staged[rows]]), length[rows])
            kv_idx = word_indices(offsets, length[rows], word)
            parts += [kv_idx, word_indices(staged[rows], length[rows], word)]
            plans.append((span, word, kv_idx.size))
        if not plans:
            return CopyPlan([], None)
        index, seconds = upload_on(self._stream, np.concatenate(parts), self.staging.buffer.device)
        return CopyPlan(plans, index, seconds)

    def _launch(self, plan: CopyPlan, to_staging: bool, wait: bool, slot: int = 0) -> Copy:
        """On the side stream, by default behind all the compute stream has queued. Not
        waiting is for bytes whose writes are known to be done: with vLLM's async
        scheduling the next step's forward is queued by then, and waiting for it cost a
        whole step. ``slot``: the plan's staging offsets start there."""
        import torch

        if not plan.spans:
            return Copy(None)
        device = self.staging.buffer.device
        stream = self._stream
        if stream is not None and wait:
            stream.wait_stream(torch.cuda.current_stream(device))
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with context:
            index, first = plan.index, 0
            for span, word, n in plan.spans:
                kv_i, st_i = index[first : first + n], index[first + n : first + 2 * n]
                first += 2 * n
                if slot % word:
                    raise ValueError(f"staging slot {slot} is not a multiple of {word} bytes")
                kv = MemoryMap.rows_of(span, word)
                st = MemoryMap.rows_of(self.staging.span, word)[slot // word :]
                if to_staging:
                    st.index_copy_(0, st_i, kv.index_select(0, kv_i))
                else:
                    kv.index_copy_(0, kv_i, st.index_select(0, st_i))
        if stream is None:
            return Copy(None)
        event = torch.cuda.Event()
        event.record(stream)
        return Copy(event)
