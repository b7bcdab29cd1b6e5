"""``verify_kv``, the torch half: per layer-block digests of KV memory, on its device.

``layout.verification`` defines the digest; this module computes it where the KV lives
(one gather and one multiply-sum per owner layer, in bounded chunks) so prefill digests a
request once when it holds it and decode digests its blocks after the READ, before vLLM
runs on them. On CUDA the work runs on a side stream ordered after the compute stream, so
prefill's engine loop does not wait for it; decode waits (its result gates the load).
torch is imported lazily: the transfer layer stays importable without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvshare_connector.layout.staging import word_indices, word_size
from kvshare_connector.layout.topology import KVTopology
from kvshare_connector.layout.verification import layer_runs, weights
from kvshare_connector.transfer.packing import MemoryMap, PackingError

CHUNK_BYTES = 64 << 20  # bytes gathered at once: bounds the temporary memory


class PendingDigests:
    """Digests being computed: ``result()`` waits and returns ``{layer: uint64 per block}``."""

    def __init__(self, values: dict[str, Any], event: Any | None):
        self._values = values
        self._event = event
        self._result: dict[str, np.ndarray] | None = None

    def result(self) -> dict[str, np.ndarray]:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            self._result = {
                name: value.cpu().numpy().view(np.uint64) for name, value in self._values.items()
            }
            self._values = {}
        return self._result


class Digester:
    """Digests owner layers' blocks straight from the KV memory (``MemoryMap``)."""

    def __init__(self, memory: MemoryMap, device: Any):
        import torch

        self.memory = memory
        self.device = torch.device(device)
        self._weights: dict[int, Any] = {}
        self._stream: Any = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)

    def _weights_of(self, words: int) -> Any:
        import torch

        if words not in self._weights:
            self._weights[words] = torch.from_numpy(weights(words)).to(self.device)
        return self._weights[words]

    def start(self, topology: KVTopology, block_ids: Sequence[Sequence[int]]) -> PendingDigests:
        """Digest every owner layer's ``block_ids`` (per group; null blocks are skipped)."""
        import torch

        real = [[b for b in ids if b] for ids in block_ids]
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        values: dict[str, Any] = {}
        with context:
            for runs in layer_runs(topology, real):
                values[runs.name] = self._layer(runs.addr, runs.segment_len, runs.block_bytes)
        event = None
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
        return PendingDigests(values, event)

    def _layer(self, addr: np.ndarray, segment_len: int, block_bytes: int) -> Any:
        import torch

        segments = block_bytes // segment_len
        blocks = addr.size // segments
        if blocks == 0:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        if block_bytes % 8:
            raise PackingError(f"a block of {block_bytes} bytes is not whole 64-bit words")
        span = self.memory.span_of(int(addr.min()), 0)
        self.memory.span_of(int(addr.max()), segment_len)  # the last run lies inside too
        offsets = addr - span.start
        word = word_size(offsets, np.asarray([segment_len]), limit=4096)
        if word < 8:  # unaligned runs: the digest still reads 64-bit words of the block
            word = 1
        rows = MemoryMap.rows_of(span, word)
        w = self._weights_of(block_bytes // 8)
        per_chunk = max(1, CHUNK_BYTES // block_bytes)
        out = []
        for first in range(0, blocks, per_chunk):
            part = offsets[first * segments : (first + per_chunk) * segments]
            idx = word_indices(part, np.full(part.size, segment_len, dtype=np.int64), word)
            gathered = rows.index_select(0, torch.from_numpy(idx).to(self.device))
            if word == 1:
                gathered = gathered.reshape(-1).view(torch.int64)
            words = gathered.reshape(-1, block_bytes // 8)
            out.append((words * w).sum(dim=1))
        return torch.cat(out)
