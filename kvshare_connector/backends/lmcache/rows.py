"""The stored format: token rows of owner layers, gathered and scattered with plain torch ops.

A memory object holds one chunk of tokens as uint8 rows ``[1, 1, T, W]``: row ``t`` is token
``t``'s KV of every owner layer of one *stream*, owner after owner in group order, each owner
as ``(head, K|V, head_size)`` elements (vLLM's packed content and split K/V layouts give the
same bytes). Sharers never appear; they read their target. Groups with the same sliding
window form a stream (one ``LMCacheEngine``, one row width).

Rows are copied through views built from each owner's block geometry (strides), so
per-layer, HMA-overlaid, cross-layer and kvcached buffers need no special case and no
LMCache kernel.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvshare_connector.backends.lmcache.errors import LMCacheConfigError
from kvshare_connector.layout.topology import (
    CONTENT,
    DIM,
    HEAD,
    KV,
    SUB_BLOCK,
    TOKEN,
    BlockGeometry,
    Dim,
    KVTopology,
)

# Physical dims inside a logical block, in the order rows are written: tokens first
# (kernel sub-blocks, then tokens of a kernel block), then one token's KV.
_CANONICAL = (SUB_BLOCK, TOKEN, HEAD, KV, CONTENT, DIM)


@dataclass(frozen=True)
class OwnerColumns:
    """Where one owner layer's bytes sit in a stream's token row."""

    name: str
    group: int
    offset: int
    width: int  # bytes per token: 2 * heads * head_size * itemsize


@dataclass(frozen=True)
class Stream:
    """Groups stored together: same sliding window, so the same token range."""

    name: str  # "full" or "swa<window>"
    window: int | None
    groups: tuple[int, ...]
    owners: tuple[OwnerColumns, ...]
    width: int  # bytes per token row


def streams_of(topology: KVTopology) -> tuple[Stream, ...]:
    """Owners grouped by sliding window, columns in group order (a pure function of the
    logical layout, so both sides agree on it whenever their fingerprints agree)."""
    by_window: dict[int | None, list[int]] = {}
    for group in topology.groups:
        if group.layer_names:
            by_window.setdefault(group.spec.sliding_window, []).append(group.index)
    streams = []
    for window, groups in sorted(by_window.items(), key=lambda kv: (kv[0] is not None, kv[0])):
        owners, offset = [], 0
        for index in groups:
            spec = topology.groups[index].spec
            width = 2 * spec.num_kv_heads * spec.head_size * spec.itemsize
            for name in topology.groups[index].layer_names:
                owners.append(OwnerColumns(name, index, offset, width))
                offset += width
        name = "full" if window is None else f"swa{window}"
        streams.append(Stream(name, window, tuple(groups), tuple(owners), offset))
    return tuple(streams)


def owner_bytes_per_token(topology: KVTopology) -> int:
    """Bytes one token of KV takes when only owner layers are stored."""
    return sum(stream.width for stream in streams_of(topology))


def lmcache_v1_bytes_per_token(model_config: Any, parallel_config: Any) -> int:
    """What LMCache's ``LMCacheConnectorV1`` stores per token: ``[2, L, T, H*D]`` in the
    KV dtype with L, H, D from the model config (every layer, sharers included, one head
    size for all layers; ``vllm_service_factory.py``, ``gpu_connectors.py`` in 0.5.6)."""
    layers = model_config.get_num_layers(parallel_config)
    heads = model_config.get_num_kv_heads(parallel_config)
    head_size = model_config.get_head_size()
    return 2 * layers * heads * head_size * model_config.dtype.itemsize


class OwnerRows:
    """Gather / scatter token rows of owner layers between KV blocks and row tensors.

    One canonical view per owner, ``[num_blocks, (sub_block,) token, (head,) (kv,)
    content|dim]`` in integer dtypes of the KV's element size, built with ``as_strided``
    from the owner's block geometry over the storage vLLM handed us. Rows are the
    views' last dims flattened to bytes.
    """

    def __init__(self, topology: KVTopology, tensors: Mapping[str, Any] | Any):
        import torch

        self.topology = topology
        self.views: dict[str, Any] = {}
        self.device = None
        for name, owner in topology.owners.items():
            tensor = tensors[name] if isinstance(tensors, Mapping) else tensors
            view = _canonical_view(name, tensor, owner.geometry, topology.num_blocks)
            tokens = math.prod(view.shape[1 : 1 + _token_dims(owner.geometry)])
            width = view[0].numel() // tokens * owner.geometry.itemsize
            spec = owner.spec
            if tokens != spec.block_size or width != 2 * spec.num_kv_heads * spec.head_size * (
                spec.itemsize
            ):
                raise LMCacheConfigError(
                    f"layer {name!r}: a block holds {tokens} token(s) of {width} B, the KV "
                    f"spec says {spec.block_size} of "
                    f"{2 * spec.num_kv_heads * spec.head_size * spec.itemsize} B"
                )
            self.views[name] = view
            if self.device is None:
                self.device = view.device
        self._torch = torch

    def gather(
        self,
        stream: Stream,
        tables: Sequence[np.ndarray],
        first: Sequence[int],
        start: int,
        end: int,
        out: Any,
    ) -> None:
        """Rows of tokens ``[start, end)`` into ``out`` (uint8 ``[end - start, width]``).

        ``tables[g]`` is group g's block table from position 0; positions below
        ``first[g]`` are not stored (their columns stay zero).
        """
        torch = self._torch
        rows = torch.zeros((end - start, stream.width), dtype=torch.uint8, device=self.device)
        for lo, i0, ids, owners in self._runs(stream, tables, first, start, end):
            bs = self.topology.groups[owners[0].group].spec.block_size
            for owner in owners:
                got = self.views[owner.name].index_select(0, ids)
                got = got.view(len(ids) * bs, -1).view(torch.uint8)
                rows[lo - start :, owner.offset : owner.offset + owner.width] = got[
                    lo - i0 * bs : end - i0 * bs
                ]
        out.copy_(rows)

    def scatter(
        self,
        stream: Stream,
        tables: Sequence[np.ndarray],
        first: Sequence[int],
        start: int,
        end: int,
        rows: Any,
    ) -> None:
        """Write rows of tokens ``[start, end)`` into the blocks, from ``first[g]`` on.

        Blocks only partly covered are read, patched and written back, so bytes of other
        positions (a locally computed prefix, tokens past the prompt) stay as they were.
        """
        torch = self._torch
        rows = rows.to(self.device)
        for lo, i0, ids, owners in self._runs(stream, tables, first, start, end):
            bs = self.topology.groups[owners[0].group].spec.block_size
            partial = lo % bs or end < (i0 + len(ids)) * bs
            for owner in owners:
                view = self.views[owner.name]
                part = rows[lo - start :, owner.offset : owner.offset + owner.width]
                if partial:
                    block = view.index_select(0, ids)
                    flat = block.view(len(ids) * bs, -1).view(torch.uint8)
                    flat[lo - i0 * bs : end - i0 * bs] = part
                else:
                    block = part.contiguous().view(view.dtype).view(len(ids), *view.shape[1:])
                view.index_copy_(0, ids, block)

    def _runs(
        self,
        stream: Stream,
        tables: Sequence[np.ndarray],
        first: Sequence[int],
        start: int,
        end: int,
    ) -> list[tuple[int, int, Any, list[OwnerColumns]]]:
        """Per group of the stream: first position, first block index, block ids (on the
        KV device) and owners, for the part of ``[start, end)`` from ``first[g]`` on."""
        runs = []
        for group in stream.groups:
            lo = max(start, first[group])
            if lo >= end:
                continue
            bs = self.topology.groups[group].spec.block_size
            i0, i1 = lo // bs, -(-end // bs)
            ids = self._ids(tables[group][i0:i1])
            runs.append((lo, i0, ids, [o for o in stream.owners if o.group == group]))
        return runs

    def _ids(self, table: np.ndarray) -> Any:
        return self._torch.from_numpy(np.ascontiguousarray(table, dtype=np.int64)).to(self.device)


def _token_dims(geometry: BlockGeometry) -> int:
    return sum(1 for d in geometry.dims if d.label in (SUB_BLOCK, TOKEN))


def _canonical_view(name: str, tensor: Any, geometry: BlockGeometry, num_blocks: int) -> Any:
    """``as_strided`` view of one owner's blocks in canonical dim order."""
    import torch

    itemsize = geometry.itemsize
    dtypes = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if tensor.element_size() != itemsize or itemsize not in dtypes:
        raise LMCacheConfigError(
            f"layer {name!r}: tensor element size {tensor.element_size()} B, geometry {itemsize} B"
        )
    storage = tensor.untyped_storage()
    offset = geometry.base - storage.data_ptr()
    end = geometry.span(num_blocks)[1] - storage.data_ptr()
    if offset < 0 or end > storage.nbytes():
        raise LMCacheConfigError(
            f"layer {name!r}: its blocks lie outside the storage of the tensor handed over"
        )
    by_label: dict[str, Dim] = {d.label: d for d in geometry.dims}
    unknown = set(by_label) - set(_CANONICAL)
    if unknown:
        raise LMCacheConfigError(f"layer {name!r}: unexpected dims {sorted(unknown)}")
    dims = [by_label[label] for label in _CANONICAL if label in by_label]
    strides = [geometry.block_stride, *(d.stride for d in dims)]
    if offset % itemsize or any(s % itemsize for s in strides):
        raise LMCacheConfigError(f"layer {name!r}: strides not aligned to the element size")
    typed = tensor.view(dtypes[itemsize])  # the same storage, bits as integers
    return torch.as_strided(
        typed,
        (num_blocks, *(d.size for d in dims)),
        tuple(s // itemsize for s in strides),
        offset // itemsize,
    )
