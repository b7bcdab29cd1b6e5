"""One TP rank's KV on numpy buffers, in a chosen layout, filled from a global reference.

The reference ``ref[layer][position]`` is one logical block with ALL the model's heads,
``(heads, tokens, content)`` int16, so a rank's block is ``ref[...][heads it holds]`` and a
check compares each head slice with the reference (bytes, per head).

Layouts: ``nhd`` (per-layer ``(blocks, tokens, heads, content)``), ``hnd`` (per-layer
``(blocks, heads, tokens, content)``), ``block_major`` (one buffer, all layers inside a
block, NHD inside each layer: vLLM's cross-layer blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvshare_connector.layout.sharding import Shard, shard_of
from kvshare_connector.layout.topology import (
    BLOCK,
    CONTENT,
    HEAD,
    TOKEN,
    GroupSpec,
    KVTopology,
    LayerSpec,
    TensorView,
    build_topology,
)

TOKENS = 4
LAYOUTS = ("nhd", "hnd", "block_major")


@dataclass
class Model:
    """Groups of layers: ``groups[g] = (layer names, content width)``; KV heads in all."""

    heads: int
    groups: list[tuple[list[str], int]]

    @property
    def layers(self) -> list[tuple[str, int, int]]:
        return [(n, g, width) for g, (names, width) in enumerate(self.groups) for n in names]


def reference(model: Model, blocks: int, seed: int) -> dict[str, np.ndarray]:
    """Per layer: ``(blocks, heads, tokens, content)`` int16 of distinct values."""
    rng = np.random.default_rng(seed)
    return {
        name: rng.integers(-32768, 32767, (blocks, model.heads, TOKENS, width), dtype=np.int16)
        for name, _, width in model.layers
    }


@dataclass
class RankKV:
    model: Model
    layout: str
    shard: Shard
    num_blocks: int
    buffers: list[np.ndarray] = field(default_factory=list)
    views: dict[str, np.ndarray] = field(default_factory=dict)  # (blocks, heads, tokens, w)
    topology: KVTopology | None = None

    @classmethod
    def build(
        cls, model: Model, layout: str, tp_size: int, tp_rank: int, num_blocks: int
    ) -> RankKV:
        totals = [model.heads] * len(model.groups)
        rank = cls(model, layout, shard_of(totals, tp_size, tp_rank), num_blocks)
        rank._allocate()
        return rank

    @property
    def heads(self) -> int:
        return self.shard.groups[0].count

    def _allocate(self) -> None:
        h, n = self.heads, self.num_blocks
        views, tviews, labels = {}, {}, {}
        if self.layout == "block_major":
            widths = {w for _, _, w in self.model.layers}
            assert len(widths) == 1, "block-major needs one block shape"
            width = widths.pop()
            per_layer = TOKENS * h * width
            buf = np.zeros((n, len(self.model.layers), TOKENS, h, width), dtype=np.int16)
            self.buffers.append(buf)
            for i, (name, _, _) in enumerate(self.model.layers):
                v = buf[:, i]  # (blocks, tokens, heads, w)
                views[name] = v.transpose(0, 2, 1, 3)
                tviews[name] = _view(v, buf)
                labels[name] = (BLOCK, TOKEN, HEAD, CONTENT)
                assert v.strides[0] == buf.strides[0] and per_layer * 2 == buf.strides[1]
        else:
            for name, _, width in self.model.layers:
                if self.layout == "nhd":
                    buf = np.zeros((n, TOKENS, h, width), dtype=np.int16)
                    views[name] = buf.transpose(0, 2, 1, 3)
                    labels[name] = (BLOCK, TOKEN, HEAD, CONTENT)
                else:
                    buf = np.zeros((n, h, TOKENS, width), dtype=np.int16)
                    views[name] = buf
                    labels[name] = (BLOCK, HEAD, TOKEN, CONTENT)
                self.buffers.append(buf)
                tviews[name] = _view(buf, buf)
        groups = [
            GroupSpec(g, LayerSpec(TOKENS, h, width // 2, "bfloat16", 2, "full"), tuple(names))
            for g, (names, width) in enumerate(self.model.groups)
        ]
        self.views = views
        self.topology = build_topology(
            groups, tviews, labels, {}, self.num_blocks, layout=self.layout
        )

    def fill(self, ref: dict[str, np.ndarray], ids: list[list[int]]) -> None:
        """Each layer's blocks ``ids[group]`` get the rank's heads of the reference."""
        for name, g, _ in self.model.layers:
            heads = self.shard.groups[g]
            part = ref[name][: len(ids[g]), heads.start : heads.start + heads.count]
            self.views[name][ids[g]] = part

    def head_mismatches(self, ref: dict[str, np.ndarray], ids: list[list[int]]) -> list[str]:
        """``layer block head`` for every head slice that is not the reference's."""
        found = []
        for name, g, _ in self.model.layers:
            heads = self.shard.groups[g]
            for pos, block in enumerate(ids[g]):
                for h in range(heads.count):
                    want = ref[name][pos, heads.start + h]
                    if not np.array_equal(self.views[name][block, h], want):
                        found.append(f"{name} block {block} head {heads.start + h}")
        return found

    def zero(self) -> None:
        for buf in self.buffers:
            buf[...] = 0


def _view(arr: np.ndarray, storage: np.ndarray) -> TensorView:
    return TensorView(
        data_ptr=arr.ctypes.data,
        shape=arr.shape,
        strides=tuple(s // arr.itemsize for s in arr.strides),
        itemsize=arr.itemsize,
        storage_ptr=storage.ctypes.data,
        storage_nbytes=storage.nbytes,
        device_id=-1,
    )
