"""Packed transfer, the torch half: a registered staging area and the gather/scatter kernels.

``layout.staging`` decides where every byte goes; this module moves them with one indexed
copy per request, through one view over every KV storage (one kernel instead of one NIXL
descriptor per block and layer). On CUDA the copies run on a side stream that first waits
for the compute stream, and report completion through an event, so neither side blocks the
engine loop.
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
# The largest word (row) a packed copy indexes by: E2B's runs are 32 KiB, so a 32k request's
# scatter is 6,348 indices instead of 50,784 at 4 KiB words; the staging side of a packed
# copy is a range, free of slot alignment.
MAX_WORD = 1 << 20


class PackingError(RuntimeError):
    """Memory the packed path cannot reach (a run outside every known tensor)."""


@dataclass(frozen=True)
class _Span:
    start: int
    end: int
    words: dict[int, Any]  # word size -> 2-D view of the memory (rows of one word)
    flat: Any  # uint8 view of the whole span


def alias(addr: int, nbytes: int, device: Any) -> Any:
    """A uint8 tensor over ``nbytes`` at ``addr`` of memory this process holds through other
    tensors: no copy, no ownership (whoever made the view keeps those tensors alive). The
    storage is made from the pointer and the device as given (what PyTorch's CUDA-graph
    trees do), never by asking the driver about the pointer: the window's first byte may be
    a page kvcached has reserved and not mapped yet."""
    import torch

    device = torch.device(device)
    storage = torch._C._construct_storage_from_data_pointer(addr, device, nbytes)
    flat = torch.empty(0, dtype=torch.uint8, device=device)
    flat.set_(storage, 0, (nbytes,), (1,))
    return flat


class MemoryMap:
    """Byte addresses -> one torch view over every storage behind the KV tensors.

    vLLM keeps KV in a few storages (3 for E2B: layers of different KV cache groups share a
    tensor); a copy with one view per storage took two kernels per storage, and the host's
    launches, not the device, were most of a landing. ``window`` spans them
    all, from the lowest storage's first byte to the highest's last, so a request's gather
    or scatter is one indexed copy whatever storages its runs lie in. Only bytes inside a
    storage are ever indexed (``check``): the gaps between storages are never touched.
    """

    def __init__(self, tensors: Iterable[Any]):
        import torch

        storages: dict[int, _Span] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            start = int(storage.data_ptr())
            if start in storages:
                continue
            flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
            flat.set_(storage, 0, (storage.nbytes(),), (1,))
            storages[start] = _Span(start, start + int(storage.nbytes()), {}, flat)
        self._storages = sorted(storages.values(), key=lambda s: s.start)  # keeps them alive
        self._starts = np.asarray([s.start for s in self._storages], dtype=np.int64)
        self._ends = np.asarray([s.end for s in self._storages], dtype=np.int64)
        self.window: _Span | None = None
        if len(self._storages) == 1:
            self.window = self._storages[0]
        elif self._storages:
            lo, hi = int(self._starts[0]), int(self._ends.max())
            flat = alias(lo, hi - lo, self._storages[0].flat.device)
            self.window = _Span(lo, hi, {}, flat)

    def check(self, addr: np.ndarray, length: np.ndarray) -> _Span:
        """The window, once every run ``(addr, length)`` is known to lie in one storage."""
        addr, length = np.atleast_1d(addr).astype(np.int64), np.atleast_1d(length)
        which = np.searchsorted(self._starts, addr, side="right") - 1
        inside = (which >= 0) & (addr + length <= self._ends[np.maximum(which, 0)])
        if not np.all(inside):
            bad = int(np.flatnonzero(~inside)[0])
            raise PackingError(f"no KV tensor holds {int(addr[bad]):#x} (+{int(length[bad])})")
        if self.window is None:
            raise PackingError("no KV tensors")
        return self.window

    @staticmethod
    def rows_of(span: _Span, word: int) -> Any:
        """The span as rows of ``word`` bytes (int64 elements where the word allows)."""
        if word not in span.words:
            span.words[word] = as_rows(span.flat[: (span.flat.numel() // word) * word], word)
        return span.words[word]


def as_rows(flat: Any, word: int) -> Any:
    """uint8 bytes as rows of ``word`` bytes: int64 elements where the word allows (the
    bytes then start on 8 bytes, as every storage and slot does)."""
    import torch

    if word % 8 == 0:
        return flat.view(torch.int64).view(-1, word // 8)
    return flat.view(-1, word)


class StagingArea:
    """One contiguous buffer registered with the transport, handed out in aligned slots.

    First fit over a sorted free list: requests come and go in roughly FIFO order, and a
    full area only means a request travels unpacked (slower, still correct).
    """

    def __init__(self, nbytes: int, device: Any):
        import torch

        self.nbytes = (nbytes // ALIGN) * ALIGN
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.span = MemoryMap([self.buffer]).window
        assert self.span is not None
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
    """A gather's or scatter's word indices into the KV memory's window, uploaded: one
    indexed copy. The staging side is ``rows`` words from byte ``staged_at`` of its slot
    where the runs are packed back to back, as every request is; else its indices follow
    the KV side's in ``index``."""

    window: Any  # the MemoryMap's window (None: nothing to copy)
    word: int
    rows: int
    index: Any
    staged_at: int | None
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


def torch_stream(stream: Any) -> Any:
    """A context that makes ``stream`` current; none where there is no stream (the CPU)."""
    import torch

    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def upload_on(stream: Any, indices: np.ndarray, device: Any) -> tuple[Any, float]:
    """``upload`` on ``stream`` (None: the current one), so that work launched there later
    is ordered after it; and the host seconds it took (a part of a plan, in the read log)."""
    clock = time.perf_counter()
    with torch_stream(stream):
        uploaded = upload(indices, device)
    return uploaded, time.perf_counter() - clock


def side_stream(device: Any) -> Any:
    """The device's highest-priority stream, for work a load waits on (gather, scatter,
    digests): its blocks are scheduled ahead of the engine's forward as soon as SMs free
    up (CUDA never preempts running blocks), instead of queueing behind a forward that may
    hold the GPU for a step (a claim waits for the request's gather and digests). PyTorch
    maps the number to the device's highest priority."""
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
        return self._launch(plan, False, wait=True, slot=slot)

    def plan_copy(self, addr: np.ndarray, length: np.ndarray, staged: np.ndarray) -> CopyPlan:
        """The word indices of a copy between runs ``(addr, length)`` of the KV memory and
        offsets ``staged`` of the area (or of a slot), uploaded in one go (on the side
        stream, so a copy launched there later is ordered after it). Packed runs (back to
        back, as every request's are) take the largest word the KV side allows, the
        staging side being a byte range; others a word that divides ``ALIGN``, so that
        their staging indices hold from any slot."""
        if addr.size == 0:
            return CopyPlan(None, 1, 0, None, None)
        window = self.memory.check(addr, length)
        offsets = addr - window.start
        if bool(np.all(staged[1:] == staged[:-1] + length[:-1])):  # packed: one range
            word = word_size(np.concatenate([offsets, staged[:1]]), length, limit=MAX_WORD)
            kv_idx = word_indices(offsets, length, word)
            index, seconds = upload_on(self._stream, kv_idx, self.staging.buffer.device)
            return CopyPlan(window, word, kv_idx.size, index, int(staged[0]), seconds)
        word = word_size(np.concatenate([offsets, staged]), length)  # divides every slot
        kv_idx = word_indices(offsets, length, word)
        both = np.concatenate([kv_idx, word_indices(staged, length, word)])
        index, seconds = upload_on(self._stream, both, self.staging.buffer.device)
        return CopyPlan(window, word, kv_idx.size, index, None, seconds)

    def _launch(self, plan: CopyPlan, to_staging: bool, wait: bool, slot: int = 0) -> Copy:
        """On the side stream, by default behind all the compute stream has queued. Not
        waiting is for bytes whose writes are known to be done: with vLLM's async
        scheduling the next step's forward is queued by then, and waiting for it cost a
        whole step. ``slot``: the plan's staging offsets start there."""
        import torch

        if plan.window is None:
            return Copy(None)
        if plan.staged_at is None and slot % plan.word:
            raise ValueError(f"staging slot {slot} is not a multiple of {plan.word} bytes")
        device = self.staging.buffer.device
        stream = self._stream
        if stream is not None and wait:
            stream.wait_stream(torch.cuda.current_stream(device))
        with torch_stream(stream):
            kv = MemoryMap.rows_of(plan.window, plan.word)
            kv_i = plan.index[: plan.rows]
            if plan.staged_at is not None:  # one kernel: the staging side is a range
                start = slot + plan.staged_at
                st = as_rows(self.staging.span.flat[start : start + plan.rows * plan.word],
                             plan.word)  # fmt: skip
                if to_staging:
                    torch.index_select(kv, 0, kv_i, out=st)
                else:
                    kv.index_copy_(0, kv_i, st)
            else:
                st = MemoryMap.rows_of(self.staging.span, plan.word)[slot // plan.word :]
                st_i = plan.index[plan.rows :]
                if to_staging:
                    st.index_copy_(0, st_i, kv.index_select(0, kv_i))
                else:
                    kv.index_copy_(0, kv_i, st.index_select(0, st_i))
        if stream is None:
            return Copy(None)
        event = torch.cuda.Event()
        event.record(stream)
        return Copy(event)
