"""Block ids -> transport descriptors ``(addr, len, device)``, vectorised and coalesced.

Pure numpy. One request touches ``layers x blocks x segments`` slabs; building them one
Python tuple at a time (what a per-layer-per-block loop does) dominates the cost of a
transfer setup at long contexts, and sending them uncoalesced multiplies the work of the
transport. Here every owner's addresses come from one broadcast
``base + ids * block_stride + offsets`` and adjacent slabs are merged in one pass.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvshare_connector.topology import BlockGeometry, KVTopology

BlockIds = Sequence[Sequence[int]]  # one list of block ids per KV cache group


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
    if arr.size and (arr.min() < 0 or arr.max() >= num_blocks):
        bad = arr[(arr < 0) | (arr >= num_blocks)]
        raise DescriptorError(
            f"{side} block id {int(bad[0])} of group {group} is out of range "
            f"[0, {num_blocks}) ({bad.size} bad id(s))"
        )
    return arr


def _sorted(arr: np.ndarray) -> np.ndarray:
    """Ascending ids (the usual case from a block pool costs one comparison pass)."""
    return arr if arr.size < 2 or bool((arr[1:] > arr[:-1]).all()) else np.sort(arr)


def slab_addresses(geometry: BlockGeometry, ids: np.ndarray) -> np.ndarray:
    """Start address of every segment of every block, block-major."""
    offsets = np.asarray(geometry.segment_offsets, dtype=np.int64)
    addrs = geometry.base + ids[:, None] * geometry.block_stride + offsets[None, :]
    return addrs.ravel()


def _group_addresses(geometries: Sequence[BlockGeometry], ids: np.ndarray) -> np.ndarray:
    """Addresses of a group's owners, ordered so that neighbours in memory are neighbours
    in the array (then coalescing needs no sort).

    Per-layer layouts: owner-major (a run of blocks of one layer is contiguous).
    Layouts that interleave owners inside a block (cross-layer blocks, kvcached's
    contiguous layout): block-major, owners in address order.
    """
    if _interleaved(geometries):
        ordered = sorted(geometries, key=lambda g: g.base)
        bases = np.array([g.base for g in ordered], dtype=np.int64)
        offsets = np.asarray(ordered[0].segment_offsets, dtype=np.int64)
        stride = ordered[0].block_stride
        addrs = ids[:, None, None] * stride + bases[None, :, None] + offsets[None, None, :]
        return addrs.ravel()
    return np.concatenate([slab_addresses(g, ids) for g in geometries])


def _interleaved(geometries: Sequence[BlockGeometry]) -> bool:
    """Owners that tile each block back to back, in the same segment pattern."""
    if len(geometries) < 2:
        return False
    first = geometries[0]
    same = all(
        g.block_stride == first.block_stride
        and g.segment_offsets == first.segment_offsets
        and g.segment_len == first.segment_len
        for g in geometries
    )
    if not same or len(first.segment_offsets) != 1:
        return False
    bases = sorted(g.base for g in geometries)
    step = first.segment_len
    return all(b - a == step for a, b in itertools.pairwise(bases)) and (
        first.block_stride == step * len(geometries)
    )


def _check_group_count(block_ids: BlockIds, num_groups: int, side: str) -> None:
    if len(block_ids) != num_groups:
        raise DescriptorError(
            f"{side} block ids cover {len(block_ids)} KV cache group(s), the layout has "
            f"{num_groups}"
        )


def request_descriptors(topology: KVTopology, block_ids: BlockIds) -> np.ndarray:
    """Coalesced ``(addr, len, device)`` rows (uint64, N x 3) for one side's blocks."""
    _check_group_count(block_ids, len(topology.groups), "local")
    addrs, lens, devs = [], [], []
    for group, ids in zip(topology.groups, block_ids, strict=True):
        arr = _sorted(block_ids_array(ids, group.index, topology.num_blocks, "local"))
        if arr.size == 0 or not group.layer_names:
            continue
        geometries = [topology.owners[name].geometry for name in group.layer_names]
        a = _group_addresses(geometries, arr)
        addrs.append(a)
        lens.append(_per_slab(geometries, arr.size, "segment_len", a.size))
        devs.append(_per_slab(geometries, arr.size, "device_id", a.size))
    if not addrs:
        return np.zeros((0, 3), dtype=np.uint64)
    addr, length, dev = np.concatenate(addrs), np.concatenate(lens), np.concatenate(devs)
    starts = _run_starts((addr, length, dev))
    return _rows(addr[starts], np.add.reduceat(length, starts), dev[starts])


def _per_slab(geometries: Sequence[BlockGeometry], blocks: int, attr: str, size: int) -> np.ndarray:
    """A per-owner value repeated for each of its slabs (constant within a group here)."""
    values = {getattr(g, attr) for g in geometries}
    if len(values) == 1:
        return np.full(size, values.pop(), dtype=np.int64)
    return np.concatenate(
        [
            np.full(blocks * len(g.segment_offsets), getattr(g, attr), dtype=np.int64)
            for g in geometries
        ]
    )


def transfer_descriptors(
    owners: Sequence[PairedOwner],
    local_ids: BlockIds,
    remote_ids: BlockIds,
    local_num_blocks: int,
    remote_num_blocks: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Matching local and remote rows: row i of one side moves to row i of the other.

    Block lists are paired per group as given (the caller aligns them); pairs are ordered
    by local block id and a run is merged only where both sides are contiguous, so mixed
    layouts stay correct.
    """
    by_group: dict[int, list[PairedOwner]] = {}
    for owner in owners:
        by_group.setdefault(owner.group, []).append(owner)
    if len(local_ids) != len(remote_ids):
        raise DescriptorError(
            f"local block ids cover {len(local_ids)} group(s), remote {len(remote_ids)}"
        )
    la, ra, ln, ld, rd = [], [], [], [], []
    for group, (lids, rids) in enumerate(zip(local_ids, remote_ids, strict=True)):
        if len(lids) != len(rids):
            raise DescriptorError(
                f"group {group}: {len(lids)} local block(s) paired with {len(rids)} remote"
            )
        larr = block_ids_array(lids, group, local_num_blocks, "local")
        rarr = block_ids_array(rids, group, remote_num_blocks, "remote")
        paired = by_group.get(group, [])
        if larr.size == 0 or not paired:
            continue
        if larr.size > 1 and not bool((larr[1:] > larr[:-1]).all()):
            order = np.argsort(larr, kind="stable")
            larr, rarr = larr[order], rarr[order]
        if _interleaved([p.local for p in paired]):
            paired = sorted(paired, key=lambda p: p.local.base)
            local = _group_addresses([p.local for p in paired], larr)
            remote = np.stack([slab_addresses(p.remote, rarr) for p in paired], axis=0)
            segs = len(paired[0].local.segment_offsets)
            remote = remote.reshape(len(paired), larr.size, segs).transpose(1, 0, 2).ravel()
        else:
            local = np.concatenate([slab_addresses(p.local, larr) for p in paired])
            remote = np.concatenate([slab_addresses(p.remote, rarr) for p in paired])
        la.append(local)
        ra.append(remote)
        ln.append(_per_slab([p.local for p in paired], larr.size, "segment_len", local.size))
        ld.append(_per_slab([p.local for p in paired], larr.size, "device_id", local.size))
        rd.append(_per_slab([p.remote for p in paired], larr.size, "device_id", local.size))
    if not la:
        empty = np.zeros((0, 3), dtype=np.uint64)
        return empty, empty.copy()
    local, remote, length = np.concatenate(la), np.concatenate(ra), np.concatenate(ln)
    ldev, rdev = np.concatenate(ld), np.concatenate(rd)
    starts = np.union1d(_run_starts((local, length, ldev)), _run_starts((remote, length, rdev)))
    merged = np.add.reduceat(length, starts)
    return (
        _rows(local[starts], merged, ldev[starts]),
        _rows(remote[starts], merged, rdev[starts]),
    )


def _run_starts(side: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """Indices where a new contiguous run starts (gap, or another device)."""
    addr, length, dev = side
    if addr.size == 0:
        return np.zeros(0, dtype=np.int64)
    breaks = (addr[1:] != addr[:-1] + length[:-1]) | (dev[1:] != dev[:-1])
    return np.concatenate(([0], np.flatnonzero(breaks) + 1))


def _rows(addr: np.ndarray, length: np.ndarray, dev: np.ndarray) -> np.ndarray:
    rows = np.empty((addr.size, 3), dtype=np.uint64)
    rows[:, 0] = addr
    rows[:, 1] = length
    rows[:, 2] = np.maximum(dev, 0)  # NIXL wants device 0 for host memory
    return rows
