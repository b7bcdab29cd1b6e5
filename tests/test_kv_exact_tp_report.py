"""``lab.gpu_checks.kv_exact_tp``'s check, on per-rank digest files written on the CPU
the way the TP probe writes them on the GPU: a faithful cell passes, its scrambled
control batch mismatches, and a missing rank or a wrong head is reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvshare_connector.demo.cpu_stack import build_cpu_stack, topology_of
from kvshare_connector.demo.parts import requests_block_ids
from kvshare_connector.transfer.decode.shards import rank_shard
from lab.gpu_checks import kv_exact_tp
from lab.tools.headcheck import fill_heads
from lab.tools.kv_digests import head_record, rank_path

TOKENS = 200
MODELS = {1: "gemma4_e2b_shape", 4: "gemma4_e2b_kv4"}


def ranks(heads: int, tp: int, kv_mib: int) -> list[tuple]:
    count = max(heads // tp, 1)
    out = []
    for r in range(tp):
        stack = build_cpu_stack(
            MODELS[heads], "per_layer", kv_bytes=(kv_mib << 20) * count, max_model_len=1024,
            kv_heads=count,
        )  # fmt: skip
        topology = topology_of(stack)
        out.append((stack, topology, rank_shard(topology, tp, r, heads)))
    return out


def write(work: Path, side: str, rank: tuple, ids, seed: int, **kw) -> None:
    stack, topology, own = rank
    fill_heads(stack.kv_caches, topology, own, ids, seed=seed)
    record = head_record(
        topology, own, {n: stack.kv_caches[n] for n in topology.owners},
        {s: stack.kv_caches[s] for s in topology.sharers}, ids, TOKENS, side=side, **kw,
    )  # fmt: skip
    with open(rank_path(work / f"{side}.jsonl", own.tp_rank), "a") as out:
        out.write(json.dumps(record) + "\n")


@pytest.mark.parametrize(("heads", "p_tp", "d_tp"), [(4, 2, 1), (1, 2, 2)])
def test_tp_cell_check(tmp_path, heads, p_tp, d_tp):
    cell = {"model": MODELS[heads], "prefill_tp": p_tp, "decode_tp": d_tp}
    prefill, decode = ranks(heads, p_tp, 48), ranks(heads, d_tp, 32)
    for i in range(8):  # four main requests, then four control ones
        control = i >= 4
        p_ids = requests_block_ids(prefill[0][1], TOKENS, 1, i)[0]
        d_ids = requests_block_ids(decode[0][1], TOKENS, 1, 50 + i)[0]
        for r in prefill:
            write(tmp_path, "prefill", r, p_ids, seed=i, request_id=f"p{i}")
        for r in decode:  # a control lands other bytes (as rotated block ids do)
            write(
                tmp_path, "decode", r, d_ids, seed=i + 100 * control, request_id=f"d{i}",
                remote_request_id=f"p{i}", scrambled=control,
            )  # fmt: skip
    result = kv_exact_tp.check_cell(tmp_path, cell)
    assert result["problems"] == [], result["problems"][:3]
    main = [r for r in result["requests"] if r["batch"] == "main"]
    assert len(main) == 4 and all(r["mismatches"] == 0 and r["blocks_compared"] for r in main)
    assert all(r["mismatches"] for r in result["requests"] if r["batch"] == "control")
    assert result["replica_mismatches"] == 0

    # Other bytes (a head of another request) on one decode rank, then a rank that wrote
    # nothing: both reported.
    topology = decode[-1][1]
    d_ids = requests_block_ids(topology, TOKENS, 1, 99)[0]
    p_ids = requests_block_ids(prefill[0][1], TOKENS, 1, 99)[0]
    for r in prefill:
        write(tmp_path, "prefill", r, p_ids, seed=9, request_id="p9")
    for r in decode:
        write(
            tmp_path, "decode", r, d_ids, seed=10 if r is decode[-1] else 9, request_id="d9",
            remote_request_id="p9",
        )  # fmt: skip
    result = kv_exact_tp.check_cell(tmp_path, cell)
    bad = [r for r in result["requests"] if r["request_id"] == "d9"]
    assert bad and bad[0]["mismatches"] > 0 and any("d9" in p for p in result["problems"])
    if d_tp > 1:
        rank_path(tmp_path / "decode.jsonl", 0).write_text("")
        result = kv_exact_tp.check_cell(tmp_path, cell)
        assert any("load failed on a rank" in p for p in result["problems"])
