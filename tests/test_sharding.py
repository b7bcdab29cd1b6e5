"""TP shards: head ownership, rank pairing, and head-slice descriptors checked through
memory (pure numpy: copy the bytes the descriptors name, compare every head slice)."""

from __future__ import annotations

import pytest

from kvshare_connector.layout.descriptors import transfer_descriptors
from kvshare_connector.layout.matching import LayoutMismatch
from kvshare_connector.layout.sharding import (
    HeadSlice,
    ShardError,
    group_totals,
    heads_of_rank,
    is_sliced,
    pair_sharded,
    readers_of,
    release_duty,
    shard_of,
    slice_heads,
    sources,
)

from .support.blockutil import disjoint_block_ids, memmove_rows
from .support.shard_kv import Model, RankKV, reference

TWO_GROUPS = Model(heads=4, groups=[(["l0", "l1"], 8), (["l2"], 16)])
ONE_GROUP = Model(heads=4, groups=[(["l0", "l1", "l2"], 8)])
BLOCKS = 64


def test_heads_of_rank_split_and_replicated():
    assert [heads_of_rank(4, 2, r) for r in range(2)] == [(0, 2), (2, 2)]
    assert [heads_of_rank(1, 2, r) for r in range(2)] == [(0, 1), (0, 1)]
    assert [heads_of_rank(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(ShardError, match="do not split"):
        heads_of_rank(6, 4, 0)
    with pytest.raises(ShardError, match="replicate"):
        heads_of_rank(2, 3, 0)
    assert group_totals([2, 1], 2, 1) == (4, 1)
    assert group_totals([1], 4, 2) == (2,)


def test_sources_pair_ranks():
    # Homogeneous: rank r reads rank r, whole blocks.
    for heads in (1, 4):
        for r in range(2):
            (s,) = sources(shard_of([heads], 2, r), 2)
            assert s.remote_rank == r
            assert s.slices == (HeadSlice(0, 0, 1 if heads == 1 else 2),)
    # TP2 -> TP1, replicated: decode reads prefill rank 0 only; rank 1 is released.
    (s,) = sources(shard_of([1], 1, 0), 2)
    assert s.remote_rank == 0 and s.slices == (HeadSlice(0, 0, 1),)
    assert release_duty([1], 1, 0, 2) == [1]
    assert readers_of(0, [1], 1, 2) == 1 and readers_of(1, [1], 1, 2) == 0
    # TP2 -> TP1, split: two sources, each half of decode's heads.
    got = sources(shard_of([4], 1, 0), 2)
    assert [(s.remote_rank, s.slices) for s in got] == [
        (0, (HeadSlice(0, 0, 2),)),
        (1, (HeadSlice(2, 0, 2),)),
    ]
    assert release_duty([4], 1, 0, 2) == []
    # TP1 -> TP2: both decode ranks read prefill rank 0 (two readers).
    assert sources(shard_of([4], 2, 1), 1)[0].slices == (HeadSlice(0, 2, 2),)
    assert sources(shard_of([1], 2, 1), 1)[0].slices == (HeadSlice(0, 0, 1),)
    assert readers_of(0, [4], 2, 1) == 2 and readers_of(0, [1], 2, 1) == 2
    # Mixed groups: a replicated group and a split one read from different ranks.
    got = sources(shard_of([1, 4], 1, 0), 2)
    assert [(s.remote_rank, s.slices) for s in got] == [
        (0, (HeadSlice(0, 0, 1), HeadSlice(0, 0, 2))),
        (1, (None, HeadSlice(2, 0, 2))),
    ]


def _ids(rank: RankKV, seed: int) -> list[list[int]]:
    return disjoint_block_ids(BLOCKS, [5 + 2 * g for g in range(len(rank.model.groups))], seed)


def _transfer(decode: list[RankKV], prefill: list[RankKV], model: Model, swap: bool = False):
    """Every decode rank reads from the prefill ranks ``sources`` names; ``swap`` (negative
    control): the descriptors of the right rank's heads, over the next rank's memory."""
    ref = reference(model, 16, seed=7)
    p_ids = _ids(prefill[0], 100)  # one scheduler: the same block ids on every prefill rank
    for p in prefill:
        p.fill(ref, p_ids)
    for d in decode:
        d_ids = _ids(d, 300)
        rows = 0
        for src in sources(d.shard, len(prefill)):
            right = prefill[src.remote_rank]
            memory = prefill[(src.remote_rank + 1) % len(prefill)] if swap else right
            owners = pair_sharded(d.topology, memory.topology, d.shard, right.shard)
            local, remote = transfer_descriptors(owners, d_ids, p_ids, BLOCKS, BLOCKS)
            memmove_rows(local, remote)
            rows += len(local)
        yield d, d_ids, ref, rows


CASES = [
    (layout, model, p_tp, d_tp)
    for layout, model in [("nhd", TWO_GROUPS), ("hnd", TWO_GROUPS), ("block_major", ONE_GROUP)]
    for p_tp, d_tp in [(2, 2), (2, 1), (1, 2), (4, 1), (1, 4), (4, 2)]
]


@pytest.mark.parametrize(("layout", "model", "p_tp", "d_tp"), CASES)
@pytest.mark.parametrize("heads", [1, 4])
def test_head_slices_land_where_they_belong(layout, model, p_tp, d_tp, heads):
    model = Model(heads, model.groups)
    prefill = [RankKV.build(model, layout, p_tp, r, BLOCKS) for r in range(p_tp)]
    decode = [RankKV.build(model, layout, d_tp, r, BLOCKS) for r in range(d_tp)]
    for d, ids, ref, rows in _transfer(decode, prefill, model):
        assert d.head_mismatches(ref, ids) == [], (layout, p_tp, d_tp, d.shard)
        assert rows > 0
    # Negative control: each decode rank reads the other prefill rank's memory at the same
    # offsets; with split heads those are other heads, and the same check must see it.
    if heads > 1 and p_tp > 1:
        for d in decode:
            d.zero()
        caught = [
            bool(d.head_mismatches(ref, ids))
            for d, ids, ref, _ in _transfer(decode, prefill, model, swap=True)
        ]
        assert all(caught)


def test_nhd_split_costs_a_run_per_token_hnd_one_per_block():
    """The cost note: heads split inside the token dim break a block into token runs."""
    out = {}
    for layout in ("nhd", "hnd"):
        p = RankKV.build(ONE_GROUP, layout, 2, 0, BLOCKS)
        d = RankKV.build(ONE_GROUP, layout, 1, 0, BLOCKS)
        owners = pair_sharded(d.topology, p.topology, d.shard, p.shard)
        assert is_sliced(d.topology, owners)
        ids = [list(range(1, 9, 2))]  # blocks that never merge
        local, _ = transfer_descriptors(owners, ids, ids, BLOCKS, BLOCKS)
        out[layout] = len(local)
    assert out["hnd"] == 3 * 4  # layers x blocks
    assert out["nhd"] == 3 * 4 * 4  # x tokens


def test_unbridgeable_shards_are_named():
    p = RankKV.build(ONE_GROUP, "nhd", 2, 0, BLOCKS)
    d = RankKV.build(ONE_GROUP, "nhd", 1, 0, BLOCKS)
    other_model = RankKV.build(Model(2, ONE_GROUP.groups), "nhd", 1, 0, BLOCKS)
    with pytest.raises(LayoutMismatch, match="KV heads per group"):
        pair_sharded(other_model.topology, p.topology, other_model.shard, p.shard)
    with pytest.raises(LayoutMismatch, match="states heads"):  # a shard its KV does not hold
        pair_sharded(d.topology, p.topology, d.shard, shard_of([4], 4, 0))
    h = RankKV.build(ONE_GROUP, "hnd", 2, 0, BLOCKS)
    with pytest.raises(LayoutMismatch, match="block content order"):  # NHD vs HND
        pair_sharded(d.topology, h.topology, d.shard, h.shard)


def test_slice_heads_geometry():
    r = RankKV.build(ONE_GROUP, "hnd", 1, 0, BLOCKS)
    g = r.topology.owners["l0"].geometry
    s = slice_heads(g, 1, 2, 4)
    assert s.base == g.base + dict((d.label, d.stride) for d in g.dims)["head"]
    assert s.segment_len == 2 * TOKENS_X_WIDTH and len(s.segment_offsets) == 1
    one = slice_heads(g, 3, 1, 4)
    assert "head" not in [d.label for d in one.dims]
    with pytest.raises(ShardError):
        slice_heads(g, 3, 2, 4)


TOKENS_X_WIDTH = 4 * 8 * 2  # tokens x content x itemsize of one head in ONE_GROUP
