"""Tensor parallelism: which KV heads each rank holds, which prefill rank a decode rank
reads them from, and the sub-block geometry of a head slice.

Pure numpy (through ``descriptors``). vLLM splits a layer's KV heads across the TP ranks
when there are at least as many heads as ranks (rank ``r`` holds ``heads / tp``
consecutive heads) and replicates them otherwise (each rank holds one head; rank ``r``
holds head ``r // (tp / heads)``). Two engines with different TP sizes then hold the
same logical KV cut differently; bytes still move block by block if each side's block is
restricted to the heads the pair has in common: the HEAD dim shrinks, the base moves by
``start * head_stride``, every other stride stays. With heads outermost in a block (HND)
a slice stays one dense run per block; with heads inside the token dim (NHD) a slice is
one run per token (``block_size`` times more descriptors): correct, and slower.

Choice of the prefill rank for a head several prefill ranks hold (replicated heads, or
more prefill than decode ranks): decode rank ``d`` takes candidate ``d % len(candidates)``
(candidates in rank order). Homogeneous TP then pairs rank ``r`` with rank ``r``, and
reads spread over the replicas. A prefill rank no decode rank reads is released by decode
rank ``p % decode_tp`` (see :func:`release_duty`), so its blocks do not wait out the lease.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from kvshare_connector.layout.descriptors import PairedOwner
from kvshare_connector.layout.matching import EngineIdentity, LayoutMismatch, differences
from kvshare_connector.layout.topology import (
    HEAD,
    BlockGeometry,
    GroupSpec,
    KVTopology,
    OwnerLayer,
)


class ShardError(ValueError):
    """A TP split that vLLM would not make, or two sides that cannot be bridged."""


@dataclass(frozen=True)
class GroupHeads:
    """The KV heads of one KV cache group a rank holds (global head numbering)."""

    total: int  # the model's KV heads in this group
    start: int  # first head this rank holds
    count: int  # heads this rank holds (= the group's spec ``num_kv_heads``)


@dataclass(frozen=True)
class Shard:
    """One TP rank's part of the KV: per group, the heads it holds."""

    tp_size: int
    tp_rank: int
    groups: tuple[GroupHeads, ...]

    @property
    def totals(self) -> tuple[int, ...]:
        return tuple(g.total for g in self.groups)

    @property
    def trivial(self) -> bool:
        return self.tp_size == 1


@dataclass(frozen=True)
class HeadSlice:
    """Heads read from one prefill rank into one decode rank, in rank-local numbering."""

    local_start: int
    remote_start: int
    count: int


@dataclass(frozen=True)
class ShardSource:
    """What one decode rank reads from one prefill rank: a slice per group (None: that
    group's heads come from another rank)."""

    remote_rank: int
    slices: tuple[HeadSlice | None, ...]


def heads_of_rank(total: int, tp_size: int, rank: int) -> tuple[int, int]:
    """``(start, count)`` of the heads ``rank`` holds, as vLLM splits or replicates them."""
    if total <= 0 or tp_size <= 0 or not 0 <= rank < tp_size:
        raise ShardError(f"no rank {rank} of TP {tp_size} for {total} KV head(s)")
    if total >= tp_size:
        if total % tp_size:
            raise ShardError(f"{total} KV heads do not split over TP {tp_size}")
        count = total // tp_size
        return rank * count, count
    if tp_size % total:
        raise ShardError(f"{total} KV heads do not replicate evenly over TP {tp_size}")
    return rank // (tp_size // total), 1


def shard_of(totals: Sequence[int], tp_size: int, tp_rank: int) -> Shard:
    """The shard of ``tp_rank`` for a model with ``totals[g]`` KV heads in group g."""
    groups = []
    for total in totals:
        start, count = heads_of_rank(total, tp_size, tp_rank)
        groups.append(GroupHeads(total, start, count))
    return Shard(tp_size, tp_rank, tuple(groups))


def group_totals(counts: Sequence[int], tp_size: int, model_heads: int) -> tuple[int, ...]:
    """The model's KV heads per group from one rank's per-group counts: ``count * tp``
    when split; a rank holding one head holds a replica when the model has fewer heads
    than ranks (``model_heads``: the model config's KV head count)."""
    out = []
    for count in counts:
        out.append(count * tp_size if count > 1 else min(max(model_heads, 1), tp_size))
    return tuple(out)


def check_shard(shard: Shard, topology: KVTopology, side: str) -> list[str]:
    """Where a rank's stated shard disagrees with its own KV (heads per group)."""
    found = []
    if not 0 <= shard.tp_rank < shard.tp_size:
        found.append(f"{side} TP rank {shard.tp_rank} outside TP size {shard.tp_size}")
        return found
    if len(shard.groups) != len(topology.groups):
        return [f"{side} shard covers {len(shard.groups)} group(s), its KV {len(topology.groups)}"]
    for group, heads in zip(topology.groups, shard.groups, strict=True):
        try:
            want = heads_of_rank(heads.total, shard.tp_size, shard.tp_rank)
        except ShardError as exc:
            found.append(f"{side} group {group.index}: {exc}")
            continue
        if (heads.start, heads.count) != want or heads.count != group.spec.num_kv_heads:
            found.append(
                f"{side} group {group.index}: rank {shard.tp_rank}/{shard.tp_size} states heads "
                f"[{heads.start}, {heads.start + heads.count}) of {heads.total}, its KV holds "
                f"{group.spec.num_kv_heads} (vLLM's split: start {want[0]}, count {want[1]})"
            )
    return found


def sources(local: Shard, remote_tp: int) -> list[ShardSource]:
    """The prefill ranks decode rank ``local.tp_rank`` reads from, and which heads."""
    per_rank: dict[int, list[HeadSlice | None]] = {}
    for g, heads in enumerate(local.groups):
        remote = [heads_of_rank(heads.total, remote_tp, p) for p in range(remote_tp)]
        runs: dict[int, list[int]] = {}
        for h in range(heads.start, heads.start + heads.count):
            candidates = [p for p, (s, c) in enumerate(remote) if s <= h < s + c]
            chosen = candidates[local.tp_rank % len(candidates)]
            runs.setdefault(chosen, []).append(h)
        for p, held in runs.items():
            if held != list(range(held[0], held[0] + len(held))):
                raise ShardError(f"group {g}: heads {held} of prefill rank {p} not contiguous")
            slices = per_rank.setdefault(p, [None] * len(local.groups))
            slices[g] = HeadSlice(held[0] - heads.start, held[0] - remote[p][0], len(held))
    return [ShardSource(p, tuple(per_rank[p])) for p in sorted(per_rank)]


def readers_of(remote_rank: int, totals: Sequence[int], local_tp: int, remote_tp: int) -> int:
    """How many decode ranks read prefill rank ``remote_rank`` (each claims it)."""
    return sum(
        any(s.remote_rank == remote_rank for s in sources(shard_of(totals, local_tp, d), remote_tp))
        for d in range(local_tp)
    )


def release_duty(
    totals: Sequence[int], local_tp: int, local_rank: int, remote_tp: int
) -> list[int]:
    """Prefill ranks no decode rank reads that ``local_rank`` must tell to free a request."""
    read = {
        s.remote_rank
        for d in range(local_tp)
        for s in sources(shard_of(totals, local_tp, d), remote_tp)
    }
    return [p for p in range(remote_tp) if p not in read and p % local_tp == local_rank]


def slice_heads(geometry: BlockGeometry, start: int, count: int, heads: int) -> BlockGeometry:
    """``geometry`` restricted to heads ``[start, start + count)`` of its ``heads``, cut
    into its own dense segments (a HEAD dim of one head is dropped, as for a one-head KV)."""
    if start < 0 or count <= 0 or start + count > heads:
        raise ShardError(f"heads [{start}, {start + count}) outside the {heads} held")
    if (start, count) == (0, heads):
        return geometry
    head = next((d for d in geometry.dims if d.label == HEAD), None)
    if head is None or head.size != heads:
        raise ShardError(f"block order {geometry.order} has no head dim of size {heads}")
    dims = tuple(
        dataclasses.replace(d, size=count) if d is head else d
        for d in geometry.dims
        if d is not head or count > 1
    )
    sliced = BlockGeometry(
        geometry.base + start * head.stride,
        geometry.block_stride,
        dims,
        len(dims),
        geometry.itemsize,
        geometry.device_id,
    )
    return sliced.with_split(sliced.dense_split)


def _sliced_topology(topology: KVTopology, cuts: Sequence[tuple[int, int] | None]) -> KVTopology:
    """The topology as if each group held only heads ``[start, start + count)``."""
    groups = []
    owners = {}
    for group, cut in zip(topology.groups, cuts, strict=True):
        start, count = cut if cut is not None else (0, 1)
        spec = dataclasses.replace(group.spec, num_kv_heads=count)
        groups.append(GroupSpec(group.index, spec, group.layer_names))
        for name in group.layer_names:
            o = topology.owners[name]
            geometry = slice_heads(o.geometry, start, count, group.spec.num_kv_heads)
            owners[name] = OwnerLayer(name, o.group, spec, geometry, o.labels)
    return KVTopology(
        tuple(groups),
        owners,
        topology.sharers,
        topology.regions,
        topology.num_blocks,
        topology.layout,
    )


def pair_sharded(
    local: KVTopology,
    remote: KVTopology,
    local_shard: Shard,
    remote_shard: Shard,
    local_identity: EngineIdentity | None = None,
    remote_identity: EngineIdentity | None = None,
) -> list[PairedOwner]:
    """The owners decode rank ``local_shard`` reads from prefill rank ``remote_shard``,
    each side cut to the heads they pair; ``LayoutMismatch`` naming what cannot be
    bridged. Empty when this decode rank reads nothing from that prefill rank."""
    found = check_shard(local_shard, local, "local") + check_shard(remote_shard, remote, "remote")
    if not found and local_shard.totals != remote_shard.totals:
        found.append(
            f"KV heads per group: local model {list(local_shard.totals)}, remote "
            f"{list(remote_shard.totals)}"
        )
    if found:
        raise LayoutMismatch(found, local.layout, remote.layout)
    try:
        chosen = [
            s
            for s in sources(local_shard, remote_shard.tp_size)
            if s.remote_rank == remote_shard.tp_rank
        ]
    except ShardError as exc:
        raise LayoutMismatch([str(exc)], local.layout, remote.layout) from exc
    if not chosen:
        return []
    slices = chosen[0].slices
    try:
        local_cut = [(s.local_start, s.count) if s else None for s in slices]
        remote_cut = [(s.remote_start, s.count) if s else None for s in slices]
        local_sliced = _sliced_topology(local, local_cut)
        remote_sliced = _sliced_topology(remote, remote_cut)
    except ShardError as exc:
        raise LayoutMismatch([str(exc)], local.layout, remote.layout) from exc
    found = differences(local_sliced, remote_sliced, local_identity, remote_identity)
    if found:
        raise LayoutMismatch(found, local.layout, remote.layout)
    paired = []
    for name, owner in local_sliced.owners.items():
        if slices[owner.group] is None:
            continue  # this group's heads come from another prefill rank
        lg, rg = owner.geometry, remote_sliced.owners[name].geometry
        split = max(lg.dense_split, rg.dense_split)
        paired.append(PairedOwner(name, owner.group, lg.with_split(split), rg.with_split(split)))
    return paired


def is_sliced(topology: KVTopology, owners: Sequence[PairedOwner]) -> bool:
    """True when ``owners`` cover less than whole local blocks of every owner (a head
    slice, or groups read from another rank): then the packed path does not apply."""
    if len(owners) != len(topology.owners):
        return True
    return any(o.local.block_bytes != topology.owners[o.name].geometry.block_bytes for o in owners)
