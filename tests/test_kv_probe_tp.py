"""The TP probe's per-head digests (``lab/tools/kv_digests.py``), on vLLM's KV memory of
each rank: what ``lab/gpu_checks/kv_exact_tp.py`` concludes rests on these. A faithful
head-by-head copy between TP sizes compares equal; heads in the wrong place do not."""

from __future__ import annotations

import pytest

from kvshare_connector.demo.cpu_stack import build_cpu_stack, topology_of
from kvshare_connector.demo.parts import requests_block_ids
from kvshare_connector.layout.sharding import Shard, shard_of
from kvshare_connector.transfer.decode.shards import rank_shard
from lab.tools.headcheck import fill_heads
from lab.tools.kv_digests import compare, head_record, merge_ranks

TOKENS = 200
MODELS = {1: "gemma4_e2b_shape", 4: "gemma4_e2b_kv4"}


def rank(heads: int, tp: int, r: int, kv_mib: int):
    count = max(heads // tp, 1)
    stack = build_cpu_stack(
        MODELS[heads], "per_layer", kv_bytes=(kv_mib << 20) * count, max_model_len=1024,
        kv_heads=count,
    )  # fmt: skip
    topology = topology_of(stack)
    return stack, topology, rank_shard(topology, tp, r, heads)


def record(stack, topology, shard: Shard, ids, side: str) -> dict:
    views = {n: stack.kv_caches[n] for n in topology.owners}
    sharers = {s: stack.kv_caches[s] for s in topology.sharers}
    return head_record(
        topology, shard, views, sharers, ids, TOKENS, side=side, request_id="r",
        remote_request_id="r",
    )  # fmt: skip


@pytest.mark.parametrize("heads", [1, 4])
def test_tp2_to_tp1_heads_compare_and_misplaced_heads_do_not(heads):
    prefill = [rank(heads, 2, r, 48) for r in range(2)]
    ids = requests_block_ids(prefill[0][1], TOKENS, 1, 3)[0]
    records = []
    for stack, topology, shard in prefill:
        fill_heads(stack.kv_caches, topology, shard, ids, seed=5)
        records.append(record(stack, topology, shard, ids, "prefill"))
    merged = merge_ranks(records)
    assert merged["replica_mismatches"] == 0
    stack, topology, shard = rank(heads, 1, 0, 32)
    local = requests_block_ids(topology, TOKENS, 1, 9)[0]
    fill_heads(stack.kv_caches, topology, shard, local, seed=5)  # a faithful copy
    result = compare(merged, record(stack, topology, shard, local, "decode"))
    owners = len(topology.owners)
    assert result["problems"] == [] and result["mismatches"] == 0
    assert result["blocks_compared"] >= owners * heads * min(len(g) for g in local)
    assert result["sharer_mismatches"] == 0 and result["sharers_checked"] > 0
    if heads > 1:  # negative control: every head lands one place over
        shifted = shard_of([heads] * len(topology.groups), 1, 0)
        wrong = Shard(1, 0, tuple(g.__class__(g.total, 1, g.count) for g in shifted.groups))
        fill_heads(stack.kv_caches, topology, wrong, local, seed=5)
        bad = compare(merged, record(stack, topology, shard, local, "decode"))
        assert bad["mismatches"] == bad["blocks_compared"] > 0
