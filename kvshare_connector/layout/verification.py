"""What ``verify_kv`` digests and how two sides' digests are compared: pure numpy.

A layer-block's digest is taken over its bytes in the block's logical order: its segments
(``BlockGeometry.segment_offsets``) concatenated. Two engines that pass the layout check
hold the same content order (``matching.differences``), so the same KV gives the same
digest on both sides whatever the physical layout (per layer, cross-layer blocks,
kvcached) and however each side cuts or packs it for the transfer.

The digest is a weighted sum of the block's 64-bit words modulo 2**64, each word's weight a
fixed odd number (so changing any one word always changes it). It catches misplaced, stale,
torn or corrupted blocks; it is not a defence against an adversary who can write KV memory
(the side channel is authenticated, NIXL memory is trusted: docs/security.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvshare_connector.layout.descriptors import block_ids_array, slab_addresses
from kvshare_connector.layout.topology import KVTopology

_SEED = 0x6B7673686172652D  # "kvshare-": weights are fixed, both sides derive the same


class VerificationError(ValueError):
    """Decode's KV is not the KV prefill digested (the message names where)."""


@dataclass(frozen=True)
class LayerRuns:
    """The runs of one owner layer's blocks, block-major, each ``segment_len`` bytes."""

    name: str
    group: int
    addr: np.ndarray  # int64, len(blocks) * segments
    segment_len: int
    block_bytes: int
    device_id: int


def layer_runs(topology: KVTopology, block_ids: Sequence[Sequence[int]]) -> list[LayerRuns]:
    """Every owner layer's runs for ``block_ids`` (per group), owners by name."""
    out = []
    for name in sorted(topology.owners):
        owner = topology.owners[name]
        ids = block_ids_array(block_ids[owner.group], owner.group, topology.num_blocks, "digest")
        g = owner.geometry
        out.append(
            LayerRuns(
                name,
                owner.group,
                slab_addresses(g, ids),
                g.segment_len,
                g.block_bytes,
                g.device_id,
            )
        )
    return out


def weights(words: int) -> np.ndarray:
    """``words`` odd 64-bit weights (splitmix64 of the word position), as int64."""
    with np.errstate(over="ignore"):
        z = np.arange(words, dtype=np.uint64) + np.uint64(_SEED)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z | np.uint64(1)).view(np.int64)


def digest_bytes(block: bytes | np.ndarray) -> int:
    """One block's digest computed on the host (the reference the torch kernel matches)."""
    words = np.frombuffer(bytes(block), dtype=np.int64)
    with np.errstate(over="ignore"):
        return int((words * weights(words.size)).sum(dtype=np.int64).view(np.uint64))


def compare(
    topology: KVTopology,
    local_ids: Sequence[Sequence[int]],
    remote_ids: Sequence[Sequence[int]],
    local: Mapping[str, np.ndarray],
    remote_block_ids: Sequence[Sequence[int]],
    remote: Mapping[str, np.ndarray],
    limit: int = 5,
) -> tuple[int, list[str]]:
    """``(layer-blocks compared, mismatches)``: decode's digests of ``local_ids`` against
    prefill's for the paired ``remote_ids``. ``remote`` is prefill's digests of every block
    it holds, by position in the request: a group's k-th digest is of the k-th non-null
    block prefill holds. ``remote_block_ids`` is the request's block list as decode was told
    it (kv_transfer_params, distinct ids): each remote id is looked up there, so a block
    that sits at another position than prefill's (a reordered list) is compared with the
    digest of the block prefill holds at that position, and fails. A layer or block prefill
    did not digest is a mismatch too: nothing unverified passes. Stops at ``limit``
    mismatches. Vectorised per layer: it runs on decode's engine thread between the bytes
    in place and the load reported."""
    compared, found = 0, []
    where: dict[int, np.ndarray] = {}  # group -> each pair's index in prefill's digests
    for name in sorted(topology.owners):
        group = topology.owners[name].group
        theirs = remote.get(name)
        if theirs is None:
            found.append(f"layer {name} (group {group}): prefill sent no digests")
            continue
        lids, rids = local_ids[group], remote_ids[group]
        if len(lids) != len(rids):
            raise ValueError(f"group {group}: {len(lids)} decode blocks for {len(rids)} prefill")
        if not rids:
            continue
        if group not in where:
            where[group] = digest_positions(remote_ids_of(remote_block_ids, group), rids)
        at = where[group]
        missing = (at < 0) | (at >= len(theirs))
        mine = local.get(name)
        if mine is None:
            bad = ~missing
        else:
            theirs = np.asarray(theirs)
            safe = np.where(missing, 0, at)
            theirs_at = theirs[safe] if len(theirs) else np.zeros(len(rids), theirs.dtype)
            bad = ~missing & (np.asarray(mine)[: len(rids)] != theirs_at)
        wrong = np.flatnonzero(missing | bad)
        room = limit - len(found)
        if room <= 0:  # full already (layers without digests): this layer's first block
            wrong, count = wrong[:1][wrong[:1] == 0], 1
        elif len(wrong) >= room:
            wrong = wrong[:room]
            count = int(wrong[-1]) + 1
        else:
            count = len(rids)
        compared += count
        for j in wrong.tolist():
            lb, rb = lids[j], rids[j]
            found.append(
                f"layer {name} group {group} block {lb}: prefill did not digest {rb}"
                if missing[j]
                else f"layer {name} group {group}: decode block {lb} differs from prefill "
                f"block {rb}"
            )
        if len(found) >= limit:
            return compared, found
    return compared, found


def digest_positions(digested: Sequence[int], wanted: Sequence[int]) -> np.ndarray:
    """Where each of ``wanted`` is in ``digested`` (the last place, if twice), -1 where
    it is not."""
    have = np.asarray(digested, dtype=np.int64)
    want = np.asarray(wanted, dtype=np.int64)
    order = np.argsort(have, kind="stable")
    ranked = have[order]
    pos = np.searchsorted(ranked, want, side="right") - 1
    hit = pos >= 0
    hit[hit] = ranked[pos[hit]] == want[hit]
    return np.where(hit, order[np.maximum(pos, 0)], -1)


def remote_ids_of(block_ids: Sequence[Sequence[int]], group: int) -> list[int]:
    """The non-null ids of ``group``, in order: a request's list of them gives each its
    position among prefill's digests."""
    return [int(b) for b in block_ids[group] if b]
