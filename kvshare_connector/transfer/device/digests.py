"""``verify_kv``, the torch half: per layer-block digests of KV memory, on its device.

``layout.verification`` defines the digest; this module computes it where the KV lives so
prefill digests a request once when it holds it and decode digests its blocks after the
READ, before vLLM runs on them. The work of one request is cheap to launch and never
blocks the engine thread: the word indices of every layer go to the device in one
upload, the layers whose blocks have one shape in one storage are one gather and one
multiply-sum (in bounded chunks) into one output, and that output comes back in one
asynchronous download; on CUDA all of it runs on a side stream ordered after the compute
stream (and, on decode, after the scatter), and ``PendingDigests.ready()`` asks the event
instead of waiting for it. Planning (``Digester.plan``: the indices, uploaded, and the
output with its host copy, allocated) is apart from launching (``Digester.launch``), so
decode plans while its claim is answered and, once the READ is done, only launches.
torch is imported lazily: the transfer layer stays importable without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvshare_connector.layout.staging import word_indices, word_size
from kvshare_connector.layout.topology import KVTopology
from kvshare_connector.layout.verification import layer_runs, weights
from kvshare_connector.transfer.device.packing import (
    MAX_WORD,
    Copy,
    MemoryMap,
    PackingError,
    side_stream,
    torch_stream,
    upload,
    upload_on,
)

# Bytes gathered at once: the temporary memory (the weighting is done in place).
CHUNK_BYTES = 128 << 20


class PendingDigests:
    """Digests being computed: ``ready()`` without waiting, ``result()`` waits and returns
    ``{layer: uint64 per block}``."""

    def __init__(self, host: Any, slices: dict[str, tuple[int, int]], event: Any | None):
        self._host = host  # int64 tensor in host memory, filled by the download
        self._slices = slices  # layer -> (first, count) in it
        self._event = event
        self._result: dict[str, np.ndarray] | None = None

    def ready(self) -> bool:
        return self._event is None or bool(self._event.query())

    def result(self) -> dict[str, np.ndarray]:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            flat = self._host.numpy().view(np.uint64)
            self._result = {
                name: flat[first : first + count].copy()
                for name, (first, count) in self._slices.items()
            }
            self._host = None
        return self._result


@dataclass(frozen=True)
class _GroupWork:
    """Layers whose blocks have one size and one gathered word: one gather and one
    multiply-sum for all of them, through the memory's window over every storage."""

    word: int  # bytes per gathered row
    blocks: int  # of all its layers
    block_bytes: int
    first_index: int  # of its rows in the request's one index upload
    rows: int


@dataclass
class DigestPlan:
    """A request's digest work, planned before its blocks are final: what to gather, the
    indices (on the device once uploaded) and where each layer's digests fall."""

    groups: list[_GroupWork]
    indices: Any  # np.ndarray, or the uploaded tensor
    slices: dict[str, tuple[int, int]]  # layer -> (first, count) in the output
    total: int
    upload_s: float = 0.0  # host seconds of the index upload, a part of the planning
    # the output on the device and its host copy, allocated with the plan so that the launch
    # after the READ only launches; taken by the first launch (a second allocates its own)
    out: Any = None
    host: Any = None


class Digester:
    """Digests owner layers' blocks straight from the KV memory (``MemoryMap``)."""

    def __init__(self, memory: MemoryMap, device: Any):
        import torch

        self.memory = memory
        self.device = torch.device(device)
        self._weights: dict[int, Any] = {}
        self._stream: Any = None
        if self.device.type == "cuda":
            self._stream = side_stream(self.device)

    def _weights_of(self, words: int) -> Any:
        import torch

        if words not in self._weights:
            self._weights[words] = torch.from_numpy(weights(words)).to(self.device)
        return self._weights[words]

    def start(
        self, topology: KVTopology, block_ids: Sequence[Sequence[int]], after: Copy | None = None,
        after_compute: bool = True,
    ) -> PendingDigests:  # fmt: skip
        """Digest every owner layer's ``block_ids`` (per group; null blocks are skipped),
        after the copy ``after`` (decode: the scatter into those blocks) if one is given,
        and behind what the compute stream has queued unless ``after_compute`` is False
        (``Packer._launch`` says when that is right)."""
        return self.launch(self.plan(topology, block_ids), after, after_compute)

    def plan(self, topology: KVTopology, block_ids: Sequence[Sequence[int]]) -> DigestPlan:
        """The digests of ``block_ids`` planned, their indices on their way to the device
        (on the side stream, so a later ``launch`` there is ordered after the upload); the
        blocks' bytes are not read until ``launch``."""
        real = [[b for b in ids if b] for ids in block_ids]
        groups, indices, slices, total = self._plan(topology, real)
        seconds = 0.0
        if self._stream is not None:
            indices, seconds = upload_on(self._stream, indices, self.device)
        with torch_stream(self._stream):  # the output's memory belongs to the side stream
            out, host = self._outputs(total)
        return DigestPlan(groups, indices, slices, total, seconds, out, host)

    def _outputs(self, total: int) -> tuple[Any, Any]:
        """The digests' output on the device and the host memory it is downloaded into
        (pinned where the download is asynchronous)."""
        import torch

        out = torch.empty(total, dtype=torch.int64, device=self.device)  # all summed into
        host = torch.empty(total, dtype=torch.int64, pin_memory=self._stream is not None)
        return out, host

    def launch(
        self, plan: DigestPlan, after: Copy | None = None, after_compute: bool = True
    ) -> PendingDigests:
        """Run a planned request's digests (``start`` says what ``after`` and
        ``after_compute`` order them behind)."""
        import torch

        stream = self._stream
        if stream is not None:
            if after_compute:
                stream.wait_stream(torch.cuda.current_stream(self.device))
            if after is not None and after.event is not None:
                stream.wait_event(after.event)
        with torch_stream(stream):
            index = plan.indices
            if isinstance(index, np.ndarray):
                index = upload(index, self.device)
            out, host = plan.out, plan.host
            plan.out = plan.host = None
            if out is None:
                out, host = self._outputs(plan.total)
            first = 0
            for g in plan.groups:
                self._group(g, index, out[first : first + g.blocks])
                first += g.blocks
            host.copy_(out, non_blocking=stream is not None)
        event = None
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
        return PendingDigests(host, plan.slices, event)

    def _plan(
        self, topology: KVTopology, real: list[list[int]]
    ) -> tuple[list[_GroupWork], np.ndarray, dict[str, tuple[int, int]], int]:
        """The rows to gather, all in one index array, grouped so that layers of one block
        shape are gathered and summed together, in rows of one word as large as all their
        runs allow (host side only); each layer's digests stay one slice of the output."""
        by_shape: dict[int, list[tuple[str, np.ndarray, int, int]]] = {}
        empty: list[str] = []
        for runs in layer_runs(topology, real):
            segments = runs.block_bytes // runs.segment_len
            blocks = runs.addr.size // segments
            if blocks and runs.block_bytes % 8:
                raise PackingError(f"a block of {runs.block_bytes} bytes is not whole 64-bit words")
            if blocks == 0:
                empty.append(runs.name)
                continue
            window = self.memory.check(runs.addr, np.full(runs.addr.size, runs.segment_len))
            offsets = runs.addr - window.start
            by_shape.setdefault(runs.block_bytes, []).append(
                (runs.name, offsets, runs.segment_len, blocks)
            )
        by_key: dict[tuple[int, int], list[tuple[str, np.ndarray, int]]] = {}
        for block_bytes, layers in by_shape.items():  # one word for every layer of a shape
            word = word_size(np.concatenate([o for _, o, _, _ in layers]),
                             np.asarray([n for _, _, n, _ in layers]), limit=MAX_WORD)  # fmt: skip
            if word < 8:  # unaligned runs: the digest still reads 64-bit words of the block
                word = 1
            by_key[(word, block_bytes)] = [
                (name, word_indices(offsets, np.full(offsets.size, n, np.int64), word), blocks)
                for name, offsets, n, blocks in layers
            ]
        groups, parts, slices = [], [], {}
        first_index = first_block = 0
        for key, layers in by_key.items():
            rows = blocks = 0
            for name, idx, n in layers:
                slices[name] = (first_block + blocks, n)
                parts.append(idx)
                rows += idx.size
                blocks += n
            groups.append(_GroupWork(key[0], blocks, key[1], first_index, rows))
            first_index += rows
            first_block += blocks
        for name in empty:
            slices[name] = (first_block, 0)
        indices = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return groups, indices, slices, first_block

    def _group(self, g: _GroupWork, index: Any, out: Any) -> None:
        """A group's digests into ``out``: gather its blocks' words, weight and sum."""
        import torch

        rows = MemoryMap.rows_of(self.memory.window, g.word)
        weight = self._weights_of(g.block_bytes // 8)
        rows_per_block = g.rows // g.blocks
        per_chunk = max(1, CHUNK_BYTES // g.block_bytes)
        for b in range(0, g.blocks, per_chunk):
            e = min(b + per_chunk, g.blocks)
            idx = index[g.first_index + b * rows_per_block : g.first_index + e * rows_per_block]
            gathered = rows.index_select(0, idx)
            if g.word == 1:
                gathered = gathered.reshape(-1).view(torch.int64)
            words = gathered.reshape(-1, g.block_bytes // 8)
            torch.sum(words.mul_(weight), dim=1, out=out[b:e])
