"""Tensor parallelism across processes: real NIXL READs between emulated TP ranks.

Prefill: ``support/tp_peer.py``, one process per test module holding 2- and 1-rank
engines (vLLM's own KV memory of each rank's heads, a NIXL agent and a side channel per
rank on base port + rank). Decode: this process, one ``ShardedSink`` per decode rank, as
the connector's per-rank workers run them. Cells: TP2->TP2, TP2->TP1, TP1->TP2, each with
one KV head (replicated over ranks: E2B shape) and four (split: the shipped
``gemma4_e2b_kv4``). Every head slice of every owner layer (sharers through their alias)
is compared with the pattern of its global head; each cell has a negative control the
same check must catch.
"""

from __future__ import annotations

import ctypes
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

import pytest

from kvshare_connector.demo.cpu_stack import build_cpu_stack, topology_of
from kvshare_connector.demo.parts import requests_block_ids
from kvshare_connector.layout import sharding
from kvshare_connector.transfer.decode import shards
from kvshare_connector.transfer.decode.shards import ShardedSink, rank_shard
from kvshare_connector.transfer.device.nixl import NixlTransport
from kvshare_connector.transfer.wire import kv_params
from kvshare_connector.transfer.wire.settings import EngineSettings
from lab.tools.headcheck import fill_heads, head_mismatches

from .support.tp_peer import TOKENS, TPPeer

MODELS = {1: "gemma4_e2b_shape", 4: "gemma4_e2b_kv4"}
ENGINES = [
    {"name": f"p{heads}h_tp{tp}", "model": MODELS[heads], "tp": tp, "heads": heads, "requests": 6}
    for heads in (1, 4)
    for tp in (2, 1)
]
CELLS = [(p, d, heads) for heads in (1, 4) for p, d in [(2, 2), (2, 1), (1, 2)]]
NEXT_REQUEST: dict[str, int] = {}


@pytest.fixture(scope="module")
def peer():
    process = TPPeer(ENGINES)
    try:
        process.wait_ready(300)
        yield process
    finally:
        process.close()


@dataclass
class DecodeRank:
    stack: Any
    topology: Any
    shard: sharding.Shard
    sink: ShardedSink


def decode_engine(tp: int, heads: int) -> list[DecodeRank]:
    """The ranks of one decode engine (one engine id: its ranks share claim tokens)."""
    engine_id = f"dec-{uuid.uuid4().hex[:6]}"
    ranks = []
    for rank in range(tp):
        stack = build_cpu_stack(
            MODELS[heads], "per_layer", kv_bytes=(32 << 20) * max(heads // tp, 1),
            max_model_len=1024, kv_heads=max(heads // tp, 1),
        )  # fmt: skip
        topology = topology_of(stack)
        shard = rank_shard(topology, tp, rank, heads)
        sink = ShardedSink(
            shard, topology,
            NixlTransport(f"{engine_id}-r{rank}", progress_thread=False),  # peer_env
            EngineSettings(engine_id, handshake_timeout_s=20.0, transfer_timeout_s=20.0),
        )  # fmt: skip
        ranks.append(DecodeRank(stack, topology, shard, sink))
    return ranks


def read(ranks: list[DecodeRank], peer: TPPeer, name: str, reverse: bool = False):
    """Every decode rank reads the engine's next request into the same block ids; returns
    the request's id and seed, the block ids, and per rank (done, failure)."""
    index = NEXT_REQUEST.get(name, 0)
    NEXT_REQUEST[name] = index + 1
    request = peer.ready[name]["requests"][index]
    params = kv_params.remote_prefill_params(request["params"])
    local_ids = requests_block_ids(ranks[0].topology, TOKENS, 1, 500 + index)[0]
    issued = [ids[::-1] for ids in local_ids] if reverse else local_ids
    for r in ranks:
        for region in r.topology.regions:
            ctypes.memset(region.addr, 0, region.nbytes)
        r.sink.request(f"d-{request['request_id']}", params, issued, TOKENS, 0)
    results: list[tuple[bool, str] | None] = [None] * len(ranks)
    deadline = time.monotonic() + 60
    while any(x is None for x in results) and time.monotonic() < deadline:
        for i, r in enumerate(ranks):
            done, failed = r.sink.poll()
            if done:
                results[i] = (True, "")
            if failed:
                results[i] = (False, "; ".join(failed.values()))
        time.sleep(0.002)
    assert all(x is not None for x in results), f"reads did not end: {results}"
    return request, local_ids, results


def check(ranks: list[DecodeRank], request: dict, local_ids) -> tuple[int, list[str]]:
    compared, problems = 0, []
    for r in ranks:
        n, found = head_mismatches(
            r.stack.kv_caches, r.topology, r.shard, local_ids, seed=request["seed"]
        )
        compared += n
        problems += [f"rank {r.shard.tp_rank}: {p}" for p in found]
    return compared, problems


def wrong_sources(local: sharding.Shard, remote_tp: int) -> list[sharding.ShardSource]:
    """A deliberately wrong pairing: other heads, or another rank's heads, in each place."""
    right = REAL_SOURCES(local, remote_tp)
    if len(right) > 1:  # swap where two prefill ranks' heads land
        a, b = right[0], right[1]
        pairs = list(zip(a.slices, b.slices, strict=True))
        sa = tuple(replace(s, local_start=t.local_start) for s, t in pairs)
        sb = tuple(replace(t, local_start=s.local_start) for s, t in pairs)
        return [replace(a, slices=sa), replace(b, slices=sb), *right[2:]]
    (only,) = right
    if remote_tp > 1:  # the next prefill rank (other heads)
        return [replace(only, remote_rank=(only.remote_rank + 1) % remote_tp)]
    held = [g.total for g in local.groups]  # prefill TP1 holds every head: shift the slice
    return [
        replace(
            only,
            slices=tuple(
                replace(s, remote_start=(s.remote_start + s.count) % t)
                for s, t in zip(only.slices, held, strict=True)
            ),
        )
    ]


REAL_SOURCES = sharding.sources


@pytest.mark.parametrize(("p_tp", "d_tp", "heads"), CELLS)
def test_tp_cell_reads_every_head_slice(peer, monkeypatch, p_tp, d_tp, heads):
    name = f"p{heads}h_tp{p_tp}"
    ranks = decode_engine(d_tp, heads)
    try:
        request, local_ids, results = read(ranks, peer, name)
        assert all(ok for ok, _ in results), results
        compared, problems = check(ranks, request, local_ids)
        assert problems == [], problems[:5]
        # every owner and sharer layer x block x the heads each decode rank holds
        layers = len(ranks[0].stack.kv_caches)
        assert compared >= layers * d_tp * max(heads // d_tp, 1)
        deadline = time.monotonic() + 10  # every prefill rank frees it: read, or released
        while (freed := peer.freed_ranks(name, request["request_id"])) != set(range(p_tp)):
            assert time.monotonic() < deadline, f"ranks freed: {freed}; {peer.state()}"
            # Decode goes on stepping, as the engine does: without a progress thread, the
            # READ's done-notification leaves only while decode progresses (CI, seed
            # 1996285838: no rank freed in 10 s when decode stopped polling at the READ).
            for r in ranks:
                r.sink.poll()
            time.sleep(0.02)
    finally:
        for r in ranks:
            r.sink.close()

    # Negative control, same check: split heads read with a wrong pairing; replicated
    # heads (every replica holds the same bytes) read into the blocks in reverse order.
    if heads > 1:
        monkeypatch.setattr(sharding, "sources", wrong_sources)
        monkeypatch.setattr(shards, "sources", wrong_sources)
    ranks = decode_engine(d_tp, heads)
    try:
        request, local_ids, results = read(ranks, peer, name, reverse=heads == 1)
        assert all(ok for ok, _ in results), results
        compared, problems = check(ranks, request, local_ids)
        assert compared and problems, "the negative control was not caught"
    finally:
        for r in ranks:
            r.sink.close()


def test_ports_that_name_another_rank_are_refused(peer):
    """Decode expects rank r on base + r: a base port off by one is named, never read."""
    ranks = decode_engine(1, 4)
    try:
        name = "p4h_tp2"
        index = NEXT_REQUEST.get(name, 0)
        NEXT_REQUEST[name] = index + 1
        request = peer.ready[name]["requests"][index]
        params = dict(request["params"], remote_port=request["params"]["remote_port"] + 1)
        local_ids = requests_block_ids(ranks[0].topology, TOKENS, 1, 900)[0]
        sink = ranks[0].sink
        sink.request("bad-port", kv_params.remote_prefill_params(params), local_ids, TOKENS, 0)
        deadline = time.monotonic() + 40
        failed: dict[str, str] = {}
        while not failed and time.monotonic() < deadline:
            _, failed = sink.poll()
        assert "bad-port" in failed
        assert "decode expected rank 0" in failed["bad-port"] or "expected rank" in str(failed)
    finally:
        for r in ranks:
            r.sink.close()


def test_each_group_reads_past_its_own_hit_under_tp(peer):
    """Issue 50 under TP (prefill TP1 -> decode TP2, four KV heads split): each KV cache
    group holds a hit of its own (0, 1 or 2 blocks); the blocks below it keep decode's own
    KV, those past it get prefill's heads on both ranks. Negative control, same checks: the
    same read with no hit writes prefill's KV over decode's own, and is seen."""
    name, mark = "p4h_tp1", 4242  # the KV decode held in its hit's blocks
    for control in (False, True):
        ranks = decode_engine(2, 4)
        try:
            index = NEXT_REQUEST.get(name, 0)
            NEXT_REQUEST[name] = index + 1
            request = peer.ready[name]["requests"][index]
            params = kv_params.remote_prefill_params(request["params"])
            table = requests_block_ids(ranks[0].topology, TOKENS, 1, 700 + index)[0]
            sizes = [g.spec.block_size for g in ranks[0].topology.groups]
            hits = [(g % 3) * size for g, size in enumerate(sizes)]
            held = [ids[: h // s] for ids, h, s in zip(table, hits, sizes, strict=True)]
            past = [ids[len(h) :] for ids, h in zip(table, held, strict=True)]
            local = table if control else past
            for r in ranks:
                for region in r.topology.regions:
                    ctypes.memset(region.addr, 0, region.nbytes)
                fill_heads(r.stack.kv_caches, r.topology, r.shard, held, seed=mark)
                r.sink.request(f"d-{request['request_id']}", params, local, TOKENS,
                               0 if control else hits)  # fmt: skip
            deadline, done = time.monotonic() + 60, [False] * len(ranks)
            while not all(done) and time.monotonic() < deadline:
                for i, r in enumerate(ranks):
                    finished, failed = r.sink.poll()
                    assert not failed, failed
                    done[i] = done[i] or bool(finished)
                time.sleep(0.002)
            assert all(done)
            # prefill's heads everywhere but in the hit's blocks, which hold decode's own
            _, problems = check(ranks, request, table)
            wrong = {int(p.split(" block ")[1].split()[0]) for p in problems}
            hit_ids = {b for ids in held for b in ids}
            compared, kept = 0, []
            for r in ranks:
                n, found = head_mismatches(r.stack.kv_caches, r.topology, r.shard, held, mark)
                compared, kept = compared + n, kept + found
            assert hit_ids and compared > 0
            if control:
                assert kept and not wrong, "the negative control was not caught"
            else:
                assert wrong == hit_ids and kept == [], (sorted(wrong), kept[:3])
        finally:
            for r in ranks:
                r.sink.close()
