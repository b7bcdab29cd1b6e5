"""Block ids -> transport descriptors ``(addr, len, device)``, vectorised and coalesced.

Pure numpy. One request touches ``layers x blocks x segments`` slabs; building them one
Python tuple at a time (what a per-layer-per-block loop does) dominates the cost of a
transfer setup at long contexts, and sending them uncoalesced multiplies the work of the
transport. Here every owner's addresses come from one broadcast
``base + ids * block_stride + offsets`` and adjacent slabs are merged in one pass.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvshare_connector.layout.topology import BlockGeometry, BlockIds, KVTopology


class DescriptorError(ValueError):
    """Block ids that cannot be turned into descriptors (wrong group count, out of range)."""


@dataclass(frozen=True)
class PairedOwner:
    """One owner layer as both sides hold it, cut into the same segments."""

    name: str
    group: int
    local: BlockGeometry
    remote: BlockGeometry


def block_ids_array(ids: Sequence[int], group: int, num_blocks: int, side: str) -> np.ndarray:
    """Block ids as int64, checked to lie in ``[0, num_blocks)``."""
    if isinstance(ids, np.ndarray):
        arr = ids.astype(np.int64, copy=False)
    else:
        arr = np.fromiter(ids, dtype=np.int64, count=len(ids))
    if arr.ndim != 1:
        raise DescriptorError(f"{side} block ids of group {group} must be a flat list")
    # One pass: as unsigned, a negative id is huge, so it fails the upper bound too.
    if arr.size and int(arr.view(np.uint64).max()) >= num_blocks:
        bad = arr[(arr < 0) | (arr >= num_blocks)]
        raise DescriptorError(
            f"{side} block id {int(bad[0])} of group {group} is out of range "
            f"[0, {num_blocks}) ({bad.size} bad id(s))"
        )
    return arr


def slab_addresses(geometry: BlockGeometry, ids: np.ndarray) -> np.ndarray:
    """Start address of every segment of every block, block-major."""
    offsets = np.asarray(geometry.segment_offsets, dtype=np.int64)
    addrs = geometry.base + ids[:, None] * geometry.block_stride + offsets[None, :]
    return addrs.ravel()


def _same_cut(geometries: Sequence[BlockGeometry]) -> bool:
    """Owners whose blocks have the same stride and segments (one spec per group, as vLLM
    makes them): their addresses come from one broadcast instead of one per owner."""
    first = geometries[0]
    return all(
        g.block_stride == first.block_stride
        and g.segment_offsets == first.segment_offsets
        and g.segment_len == first.segment_len
        for g in geometries[1:]
    )


def _interleaved(geometries: Sequence[BlockGeometry]) -> bool:
    """Owners that tile each block back to back, in the same segment pattern."""
    if len(geometries) < 2 or not _same_cut(geometries):
        return False
    first = geometries[0]
    if len(first.segment_offsets) != 1:
        return False
    bases = sorted(g.base for g in geometries)
    step = first.segment_len
    return all(b - a == step for a, b in itertools.pairwise(bases)) and (
        first.block_stride == step * len(geometries)
    )


# A per-slab value: one number when every slab has it (the usual case: one spec per group,
# one device), else one entry per slab. Keeping the scalar saves building and scanning
# arrays as long as the request's slabs.
PerSlab = int | np.ndarray


def _uniform(geometries: Sequence[BlockGeometry], attr: str) -> int | None:
    values = {getattr(g, attr) for g in geometries}
    return values.pop() if len(values) == 1 else None


class _Cut:
    """A group's owners on one side, in slab order, reduced to what the address math
    needs. Built once (per topology, per paired peer), so a request costs numpy work only.

    ``block_major``: slabs ordered ``block, owner, segment`` (owners interleaved inside a
    block: cross-layer blocks, kvcached's contiguous layout), else ``owner, block, segment``
    (a run of blocks of one per-layer tensor is contiguous). Either way neighbours in
    memory are neighbours in the array, so coalescing needs no sort.
    """

    def __init__(self, geometries: Sequence[BlockGeometry], block_major: bool):
        self.geometries = tuple(geometries)
        self.block_major = block_major
        self.segment_len = _uniform(geometries, "segment_len")
        self.device_id = _uniform(geometries, "device_id")
        self.same_cut = _same_cut(geometries)
        first = geometries[0]
        self.bases = np.array([g.base for g in geometries], dtype=np.int64)
        self.offsets = np.asarray(first.segment_offsets, dtype=np.int64)
        self.stride = first.block_stride

    def addresses(self, ids: np.ndarray) -> np.ndarray:
        if not self.same_cut:
            per_owner = [slab_addresses(g, ids) for g in self.geometries]
            if not self.block_major:
                return np.concatenate(per_owner)
            stacked = np.stack(per_owner).reshape(len(per_owner), ids.size, -1)
            return stacked.transpose(1, 0, 2).ravel()
        blocks = ids * self.stride
        if self.block_major:
            addrs = blocks[:, None, None] + self.bases[None, :, None] + self.offsets
        else:
            addrs = self.bases[:, None, None] + blocks[None, :, None] + self.offsets
        return addrs.ravel()

    def per_slab(self, attr: str, blocks: int) -> PerSlab:
        """``segment_len`` or ``device_id`` of every slab of ``blocks`` blocks."""
        value = getattr(self, attr)
        if value is not None:
            return value
        parts = [
            np.full(blocks * len(g.segment_offsets), getattr(g, attr), dtype=np.int64)
            for g in self.geometries
        ]
        if self.block_major:  # same segment count per owner: see _interleaved
            return np.stack(parts).reshape(len(parts), blocks, -1).transpose(1, 0, 2).ravel()
        return np.concatenate(parts)


def _group_cut(geometries: Sequence[BlockGeometry]) -> _Cut:
    if _interleaved(geometries):
        return _Cut(sorted(geometries, key=lambda g: g.base), block_major=True)
    return _Cut(geometries, block_major=False)


def _check_group_count(block_ids: BlockIds, num_groups: int, side: str) -> None:
    if len(block_ids) != num_groups:
        raise DescriptorError(
            f"{side} block ids cover {len(block_ids)} KV cache group(s), the layout has "
            f"{num_groups}"
        )


class RequestPlan:
    """One side's owners cut per group, for :func:`request_descriptors`."""

    def __init__(self, topology: KVTopology):
        self.num_blocks = topology.num_blocks
        self.cuts: list[_Cut | None] = [
            _group_cut([topology.owners[n].geometry for n in group.layer_names])
            if group.layer_names
            else None
            for group in topology.groups
        ]


_request_plans: dict[int, tuple[weakref.ref, RequestPlan]] = {}


def request_plan(topology: KVTopology) -> RequestPlan:
    """The topology's plan, built on first use (a topology is immutable)."""
    entry = _request_plans.get(id(topology))
    if entry is not None and entry[0]() is topology:
        return entry[1]
    plan = RequestPlan(topology)
    key = id(topology)
    _request_plans[key] = (weakref.ref(topology, lambda _: _request_plans.pop(key, None)), plan)
    return plan


def request_descriptors(topology: KVTopology, block_ids: BlockIds) -> np.ndarray:
    """Coalesced ``(addr, len, device)`` rows (uint64, N x 3) for one side's blocks.

    Rows follow the request's block order; blocks adjacent in that order and in memory
    merge (a block pool hands out ascending runs, so the ids are not sorted here).
    """
    plan = request_plan(topology)
    _check_group_count(block_ids, len(plan.cuts), "local")
    addrs: list[np.ndarray] = []
    lens: list[PerSlab] = []
    devs: list[PerSlab] = []
    for index, (cut, ids) in enumerate(zip(plan.cuts, block_ids, strict=True)):
        arr = block_ids_array(ids, index, plan.num_blocks, "local")
        if arr.size == 0 or cut is None:
            continue
        addrs.append(cut.addresses(arr))
        lens.append(cut.per_slab("segment_len", arr.size))
        devs.append(cut.per_slab("device_id", arr.size))
    if not addrs:
        return np.zeros((0, 3), dtype=np.uint64)
    sizes = [a.size for a in addrs]
    addr, length, dev = np.concatenate(addrs), _join(lens, sizes), _join(devs, sizes)
    starts = _starts(_breaks(addr, length, dev))
    return _rows(_at(addr, starts), _merged(length, starts, addr.size), _at(dev, starts))


class TransferPlan:
    """Paired owners cut per group on both sides, in the same slab order (the local
    side's), for :func:`transfer_descriptors`. Build it once per peer."""

    def __init__(self, owners: Sequence[PairedOwner]):
        by_group: dict[int, list[PairedOwner]] = {}
        for owner in owners:
            by_group.setdefault(owner.group, []).append(owner)
        self.cuts: dict[int, tuple[_Cut, _Cut]] = {}
        for group, paired in by_group.items():
            local = _group_cut([p.local for p in paired])
            order = {id(g): i for i, g in enumerate(p.local for p in paired)}
            remote = [paired[order[id(g)]].remote for g in local.geometries]
            self.cuts[group] = (local, _Cut(remote, local.block_major))


def transfer_descriptors(
    owners: Sequence[PairedOwner] | TransferPlan,
    local_ids: BlockIds,
    remote_ids: BlockIds,
    local_num_blocks: int,
    remote_num_blocks: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Matching local and remote rows: row i of one side moves to row i of the other.

    Block lists are paired per group as given (the caller aligns them); consecutive pairs
    merge only where both sides are contiguous, so mixed layouts stay correct. Pairs keep
    the given order (a block pool hands out ascending runs; sorting would cost more than
    the merges it could find).
    """
    plan = owners if isinstance(owners, TransferPlan) else TransferPlan(owners)
    if len(local_ids) != len(remote_ids):
        raise DescriptorError(
            f"local block ids cover {len(local_ids)} group(s), remote {len(remote_ids)}"
        )
    la: list[np.ndarray] = []
    ra: list[np.ndarray] = []
    ln: list[PerSlab] = []
    ld: list[PerSlab] = []
    rd: list[PerSlab] = []
    for group, (lids, rids) in enumerate(zip(local_ids, remote_ids, strict=True)):
        if len(lids) != len(rids):
            raise DescriptorError(
                f"group {group}: {len(lids)} local block(s) paired with {len(rids)} remote"
            )
        larr = block_ids_array(lids, group, local_num_blocks, "local")
        rarr = block_ids_array(rids, group, remote_num_blocks, "remote")
        cuts = plan.cuts.get(group)
        if larr.size == 0 or cuts is None:
            continue
        local, remote = cuts
        la.append(local.addresses(larr))
        ra.append(remote.addresses(rarr))
        ln.append(local.per_slab("segment_len", larr.size))
        ld.append(local.per_slab("device_id", larr.size))
        rd.append(remote.per_slab("device_id", larr.size))
    if not la:
        empty = np.zeros((0, 3), dtype=np.uint64)
        return empty, empty.copy()
    sizes = [a.size for a in la]
    local_addr, remote_addr = np.concatenate(la), np.concatenate(ra)
    length, ldev, rdev = _join(ln, sizes), _join(ld, sizes), _join(rd, sizes)
    breaks = _breaks(local_addr, length, ldev) | _breaks(remote_addr, length, rdev)
    starts = _starts(breaks)
    merged = _merged(length, starts, local_addr.size)
    return (
        _rows(_at(local_addr, starts), merged, _at(ldev, starts)),
        _rows(_at(remote_addr, starts), merged, _at(rdev, starts)),
    )


def _join(parts: Sequence[PerSlab], sizes: Sequence[int]) -> PerSlab:
    """Per-slab values of consecutive parts as one value (a scalar if they all agree)."""
    if all(isinstance(p, int) for p in parts) and len(set(parts)) == 1:
        return parts[0]
    return np.concatenate(
        [
            p if isinstance(p, np.ndarray) else np.full(n, p, dtype=np.int64)
            for p, n in zip(parts, sizes, strict=True)
        ]
    )


def _breaks(addr: np.ndarray, length: PerSlab, dev: PerSlab) -> np.ndarray:
    """``breaks[i]``: slab ``i + 1`` does not continue slab ``i`` (gap, or another device)."""
    step = length if isinstance(length, int) else length[:-1]
    breaks = addr[1:] != addr[:-1] + step
    if not isinstance(dev, int):
        breaks |= dev[1:] != dev[:-1]
    return breaks


def _starts(breaks: np.ndarray) -> np.ndarray:
    """Indices where a run starts."""
    starts = np.empty(int(np.count_nonzero(breaks)) + 1, dtype=np.int64)
    starts[0] = 0
    starts[1:] = np.flatnonzero(breaks) + 1
    return starts


def _merged(length: PerSlab, starts: np.ndarray, size: int) -> PerSlab:
    """Length of each run."""
    if starts.size == size:  # nothing merged
        return length
    if isinstance(length, int):
        return np.diff(starts, append=size) * length
    return np.add.reduceat(length, starts)


def _at(values: PerSlab, starts: np.ndarray) -> PerSlab:
    """The values at the runs' starts (all of them when nothing merged)."""
    if isinstance(values, int) or starts.size == values.size:
        return values
    return values[starts]


def _rows(addr: np.ndarray, length: PerSlab, dev: PerSlab) -> np.ndarray:
    rows = np.empty((addr.size, 3), dtype=np.uint64)
    rows[:, 0] = addr
    rows[:, 1] = length
    rows[:, 2] = np.maximum(dev, 0)  # NIXL wants device 0 for host memory
    return rows
