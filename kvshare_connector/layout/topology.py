"""The local KV memory as the transport needs to see it: who owns KV, who only shares it,
and where every block of every owner lives in bytes.

Pure: no vLLM, NIXL or torch import. ``vllm_adapter`` turns vLLM's objects into the plain
inputs here (``LayerSpec``, ``GroupSpec``, ``TensorView`` with dim labels), so one code path
covers every layout vLLM and kvcached produce. The geometry of a block is read off the
tensor's strides instead of being special-cased per layout:

* per-layer tensors (NHD / HND), HMA groups whose layers overlay one raw buffer, vLLM's
  cross-layer blocks tensor (block-outermost, all layers inside a block), vLLM's packed
  layouts, and kvcached's per-layer and contiguous (layers interleaved per block) layouts
  all reduce to: ``base + block_id * block_stride + segment_offset`` for a few dense
  segments of ``segment_len`` bytes, in a physical order of labelled dims that two sides
  can compare.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Dim labels of a layer's logical KV view (see ``vllm_adapter.dim_labels``).
BlockIds = Sequence[Sequence[int]]  # one list of block ids per KV cache group
BLOCK = "block"  # kernel blocks; a logical (scheduler) block may span several
TOKEN = "token"  # tokens inside a kernel block
HEAD = "head"  # KV heads
CONTENT = "content"  # K and V packed per token (vLLM >= 0.26: 2 * head_size)
DIM = "dim"  # head_size, when K and V are split by a separate KV dim
KV = "kv"  # the separate K/V dim of size 2
SUB_BLOCK = "sub_block"  # kernel blocks inside one logical block (derived here)
KNOWN_LABELS = frozenset({BLOCK, TOKEN, HEAD, CONTENT, DIM, KV})


class TopologyError(ValueError):
    """The KV memory handed to us does not match what the KV cache config promises."""


@dataclass(frozen=True)
class TensorView:
    """The parts of a tensor that decide where its bytes are, without importing torch."""

    data_ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements, as ``tensor.stride()``
    itemsize: int
    storage_ptr: int
    storage_nbytes: int
    device_id: int  # CUDA ordinal, or -1 for host memory

    @classmethod
    def of(cls, tensor: Any) -> TensorView:
        """Read a ``torch.Tensor`` (duck-typed) into a view."""
        storage = tensor.untyped_storage()
        device = tensor.device
        return cls(
            data_ptr=int(tensor.data_ptr()),
            shape=tuple(int(s) for s in tensor.shape),
            strides=tuple(int(s) for s in tensor.stride()),
            itemsize=int(tensor.element_size()),
            storage_ptr=int(storage.data_ptr()),
            storage_nbytes=int(storage.nbytes()),
            device_id=-1 if device.type == "cpu" else int(device.index or 0),
        )

    @property
    def mem_kind(self) -> str:
        return "DRAM" if self.device_id < 0 else "VRAM"


@dataclass(frozen=True)
class LayerSpec:
    """What vLLM's KV cache spec promises about one owner layer's KV."""

    block_size: int  # tokens per logical (scheduler) block
    num_kv_heads: int
    head_size: int
    dtype: str  # e.g. "bfloat16"
    itemsize: int
    kind: str  # "full" | "sliding" | another spec name
    sliding_window: int | None = None

    @property
    def page_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.itemsize


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group: layers that share a block table (one list of block ids)."""

    index: int
    spec: LayerSpec
    layer_names: tuple[str, ...]  # may include sharers (the worker appends them)


@dataclass(frozen=True)
class Dim:
    """One physical dim inside a logical block: label, size and byte stride."""

    label: str
    size: int
    stride: int  # bytes


@dataclass(frozen=True)
class BlockGeometry:
    """Where the bytes of logical block ``b`` of one owner layer are.

    ``dims`` is every dim inside a logical block (sizes > 1), outermost first by stride.
    The first ``split`` of them enumerate dense segments; the rest are dense inside a
    segment. Block ``b`` occupies ``base + b * block_stride + o`` for ``o`` in
    ``segment_offsets``, each ``segment_len`` bytes.
    """

    base: int
    block_stride: int
    dims: tuple[Dim, ...]
    split: int
    itemsize: int
    device_id: int

    @property
    def order(self) -> tuple[tuple[str, int], ...]:
        """Physical order of the content of a block: what two sides must agree on."""
        return tuple((d.label, d.size) for d in self.dims)

    @property
    def segment_len(self) -> int:
        return math.prod(d.size for d in self.dims[self.split :]) * self.itemsize

    @property
    def block_bytes(self) -> int:
        return math.prod(d.size for d in self.dims) * self.itemsize

    @functools.cached_property
    def segment_offsets(self) -> tuple[int, ...]:
        outer = self.dims[: self.split]
        return tuple(
            sum(i * d.stride for i, d in zip(idx, outer, strict=True))
            for idx in itertools.product(*(range(d.size) for d in outer))
        )

    @property
    def dense_split(self) -> int:
        """The smallest split for which every segment is dense."""
        return _dense_split(self.dims, self.itemsize)

    def with_split(self, split: int) -> BlockGeometry:
        """The same bytes cut into finer segments (``split`` >= the dense split)."""
        if split < self.dense_split or split > len(self.dims):
            raise TopologyError(f"split {split} outside [{self.dense_split}, {len(self.dims)}]")
        return BlockGeometry(
            self.base, self.block_stride, self.dims, split, self.itemsize, self.device_id
        )

    def span(self, num_blocks: int) -> tuple[int, int]:
        """[start, end) bytes covered by blocks 0 .. num_blocks-1."""
        last = max(self.segment_offsets) + self.segment_len
        return self.base, self.base + (num_blocks - 1) * self.block_stride + last


@dataclass(frozen=True)
class OwnerLayer:
    name: str
    group: int
    spec: LayerSpec
    geometry: BlockGeometry
    labels: tuple[str, ...]  # dim labels of the layer's logical view


@dataclass(frozen=True)
class Region:
    """A byte range to register with the transport: the used part of one backing storage."""

    addr: int
    nbytes: int
    device_id: int

    @property
    def mem_kind(self) -> str:
        return "DRAM" if self.device_id < 0 else "VRAM"


@dataclass(frozen=True)
class KVTopology:
    """Owners, sharers, groups and registrable regions of one engine's KV memory."""

    groups: tuple[GroupSpec, ...]  # owners only in ``layer_names``
    owners: Mapping[str, OwnerLayer]
    sharers: Mapping[str, str]  # sharer -> owner it reads (chains resolved)
    regions: tuple[Region, ...]
    num_blocks: int
    layout: str  # human-readable name of the memory layout, for logs and errors
    owners_by_group: tuple[tuple[str, ...], ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "owners_by_group", tuple(tuple(g.layer_names) for g in self.groups)
        )

    @property
    def mem_kind(self) -> str:
        """``DRAM`` or ``VRAM``: where every region of this KV lives."""
        kinds = {r.mem_kind for r in self.regions}
        if len(kinds) != 1:
            raise TopologyError(f"KV regions span memory kinds {sorted(kinds)}")
        return kinds.pop()

    def resolve(self, layer_name: str) -> str:
        """The owner whose KV ``layer_name`` reads (itself for an owner)."""
        if layer_name in self.owners:
            return layer_name
        try:
            return self.sharers[layer_name]
        except KeyError:
            raise TopologyError(f"layer {layer_name!r} is neither an owner nor a sharer") from None

    def logical_fingerprint(self) -> str:
        """Hash of what both sides must agree on (not of addresses or physical layout)."""
        h = hashlib.sha256()
        for g in self.groups:
            h.update(repr((g.index, g.spec, g.layer_names)).encode())
        for name in sorted(self.sharers):
            h.update(repr((name, self.sharers[name])).encode())
        return h.hexdigest()[:16]


def resolve_sharing(sharing: Mapping[str, str], owners: Iterable[str]) -> dict[str, str]:
    """Map every sharer to the owner it finally reads, following chains (a -> b -> owner).

    Raises if a target is neither an owner nor another sharer, or if a chain loops.
    """
    owner_set = set(owners)
    resolved: dict[str, str] = {}
    for sharer in sharing:
        if sharer in owner_set:
            raise TopologyError(f"layer {sharer!r} both owns a KV cache and shares another's")
        seen = [sharer]
        target = sharing[sharer]
        while target not in owner_set:
            if target not in sharing:
                raise TopologyError(
                    f"sharing layer {sharer!r} reads the KV of {target!r}, which owns no "
                    f"registered KV cache (owners: {_short(sorted(owner_set))})"
                )
            if target in seen:
                raise TopologyError(f"KV sharing loops: {' -> '.join([*seen, target])}")
            seen.append(target)
            target = sharing[target]
        resolved[sharer] = target
    return resolved


def block_geometry(
    layer: str, view: TensorView, labels: Sequence[str], spec: LayerSpec, num_blocks: int
) -> BlockGeometry:
    """Derive one owner's block geometry from its tensor's strides, checked against its spec."""
    if len(labels) != len(view.shape):
        raise TopologyError(
            f"layer {layer!r}: {len(labels)} dim labels {tuple(labels)} for a tensor of shape "
            f"{view.shape}"
        )
    unknown = set(labels) - KNOWN_LABELS
    if unknown or BLOCK not in labels or len(set(labels)) != len(labels):
        raise TopologyError(f"layer {layer!r}: unusable dim labels {tuple(labels)}")
    if view.itemsize != spec.itemsize:
        raise TopologyError(
            f"layer {layer!r}: tensor element size {view.itemsize} B does not match the spec's "
            f"dtype {spec.dtype} ({spec.itemsize} B)"
        )
    sizes = dict(zip(labels, view.shape, strict=True))
    expected = {HEAD: spec.num_kv_heads, CONTENT: 2 * spec.head_size, DIM: spec.head_size, KV: 2}
    for label, want in expected.items():
        if label in sizes and sizes[label] != want:
            raise TopologyError(
                f"layer {layer!r}: {label} dim is {sizes[label]} but the spec says {want} "
                f"(shape {view.shape}, labels {tuple(labels)})"
            )
    if (CONTENT in sizes) == (DIM in sizes) or (DIM in sizes) != (KV in sizes):
        raise TopologyError(
            f"layer {layer!r}: labels {tuple(labels)} need either a packed K/V content dim or "
            "a kv dim plus a head dim"
        )
    kernel_tokens = sizes.get(TOKEN, 1)
    if spec.block_size % kernel_tokens:
        raise TopologyError(
            f"layer {layer!r}: kernel block of {kernel_tokens} tokens does not divide the "
            f"spec's block_size {spec.block_size}"
        )
    per_block = spec.block_size // kernel_tokens
    if sizes[BLOCK] < num_blocks * per_block:
        raise TopologyError(
            f"layer {layer!r}: tensor holds {sizes[BLOCK]} kernel blocks, the KV cache config "
            f"needs {num_blocks} blocks x {per_block} = {num_blocks * per_block}"
        )
    if any(s <= 0 for s, n in zip(view.strides, view.shape, strict=True) if n > 1):
        raise TopologyError(f"layer {layer!r}: non-positive strides {view.strides}")

    block_axis = labels.index(BLOCK)
    kernel_stride = view.strides[block_axis] * view.itemsize
    inner = [
        Dim(label, size, stride * view.itemsize)
        for label, size, stride in zip(labels, view.shape, view.strides, strict=True)
        if label != BLOCK and size > 1
    ]
    if per_block > 1:
        inner.append(Dim(SUB_BLOCK, per_block, kernel_stride))
    inner.sort(key=lambda d: d.stride, reverse=True)
    _check_no_overlap(layer, inner, view.itemsize)

    split = _dense_split(inner, view.itemsize)
    if split == len(inner) and inner:
        raise TopologyError(
            f"layer {layer!r}: innermost dim {inner[-1].label} has stride "
            f"{inner[-1].stride} B, not the element size {view.itemsize} B"
        )
    geometry = BlockGeometry(
        base=view.data_ptr,
        block_stride=kernel_stride * per_block,
        dims=tuple(inner),
        split=split,
        itemsize=view.itemsize,
        device_id=view.device_id,
    )
    start, end = geometry.span(num_blocks)
    if start < view.storage_ptr or end > view.storage_ptr + view.storage_nbytes:
        raise TopologyError(
            f"layer {layer!r}: {num_blocks} blocks span [{start:#x}, {end:#x}) outside its "
            f"storage [{view.storage_ptr:#x}, {view.storage_ptr + view.storage_nbytes:#x})"
        )
    return geometry


def _dense_split(dims: Sequence[Dim], itemsize: int) -> int:
    """Index of the first dim of the dense suffix: inner dims that pack without gaps."""
    split, packed = len(dims), itemsize
    while split > 0 and dims[split - 1].stride == packed:
        packed *= dims[split - 1].size
        split -= 1
    return split


def _check_no_overlap(layer: str, dims: Sequence[Dim], itemsize: int) -> None:
    """Reject views whose elements alias each other inside a block (not a KV layout)."""
    reach = itemsize
    for d in reversed(dims):  # innermost first
        if d.stride < reach:
            raise TopologyError(
                f"layer {layer!r}: dim {d.label} (stride {d.stride} B) overlaps the dims "
                f"inside it ({reach} B): {[(x.label, x.size, x.stride) for x in dims]}"
            )
        reach = d.stride * d.size


def build_topology(
    groups: Sequence[GroupSpec],
    views: Mapping[str, TensorView],
    labels: Mapping[str, Sequence[str]],
    sharing: Mapping[str, str],
    num_blocks: int,
    layout: str = "per_layer",
) -> KVTopology:
    """Assemble the topology from plain inputs.

    ``views`` may contain sharers (vLLM hands aliases to ``register_kv_caches``); they are
    checked to alias their target and are never registered. Every group layer must be an
    owner with a view or a sharer whose target is an owner.
    """
    owner_names = [n for g in groups for n in g.layer_names if n not in sharing]
    if len(set(owner_names)) != len(owner_names):
        raise TopologyError(f"a layer owns KV in two groups: {_short(owner_names)}")
    missing = [n for n in owner_names if n not in views]
    if missing:
        raise TopologyError(f"no KV tensor for owner layer(s) {_short(missing)}")
    sharers = resolve_sharing(sharing, owner_names)
    unexpected = set(views) - set(owner_names) - set(sharers)
    if unexpected:
        raise TopologyError(
            f"KV tensors for layers the KV cache config does not know: {_short(sorted(unexpected))}"
        )

    owners: dict[str, OwnerLayer] = {}
    owner_groups: list[GroupSpec] = []
    for g in groups:
        names = tuple(n for n in g.layer_names if n not in sharing)
        owner_groups.append(GroupSpec(g.index, g.spec, names))
        for name in names:
            if name not in labels:
                raise TopologyError(f"no dim labels for owner layer {name!r}")
            geometry = block_geometry(name, views[name], labels[name], g.spec, num_blocks)
            owners[name] = OwnerLayer(name, g.index, g.spec, geometry, tuple(labels[name]))

    for sharer, target in sharers.items():
        view = views.get(sharer)
        if view is not None and (view.data_ptr, view.strides) != (
            views[target].data_ptr,
            views[target].strides,
        ):
            raise TopologyError(
                f"sharing layer {sharer!r} was handed its own KV buffer "
                f"({view.data_ptr:#x}) instead of an alias of {target!r} "
                f"({views[target].data_ptr:#x})"
            )

    return KVTopology(
        groups=tuple(owner_groups),
        owners=owners,
        sharers=sharers,
        regions=_regions(owners, views, num_blocks),
        num_blocks=num_blocks,
        layout=layout,
    )


def _regions(
    owners: Mapping[str, OwnerLayer], views: Mapping[str, TensorView], num_blocks: int
) -> tuple[Region, ...]:
    """Union of the owners' used spans per backing storage, so each byte registers once.

    Registering the used span instead of the whole storage matters for kvcached, whose
    storage is a reservation of (nearly) the whole GPU.
    """
    spans: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for name, owner in owners.items():
        view = views[name]
        spans.setdefault((view.device_id, view.storage_ptr), []).append(
            owner.geometry.span(num_blocks)
        )
    regions = []
    for (device_id, _), intervals in sorted(spans.items()):
        intervals.sort()
        cur_start, cur_end = intervals[0]
        for start, end in intervals[1:]:
            if start <= cur_end:
                cur_end = max(cur_end, end)
            else:
                regions.append(Region(cur_start, cur_end - cur_start, device_id))
                cur_start, cur_end = start, end
        regions.append(Region(cur_start, cur_end - cur_start, device_id))
    return tuple(regions)


def _short(names: Sequence[str], limit: int = 6) -> str:
    names = list(names)
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more
