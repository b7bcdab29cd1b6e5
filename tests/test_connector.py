"""KVShareConnector inside vLLM's own machinery: factory, scheduler, worker hooks, NIXL.

The two-process tests run vLLM's real ``Scheduler`` with the connector in both roles and
drive the worker side the way the model runner does (``lab/tools/engine_sim.py``); only the
model forward is emulated (it writes a known pattern into the blocks vLLM allocated).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from kvshare_connector.toolkit.procs import pick_free_port
from lab.tools.engine_sim import (
    READY,
    RESULT,
    Engine,
    decode_requests,
    start_prefill,
)

ROOT = str(Path(__file__).resolve().parents[1])


# ---- loading -----------------------------------------------------------------------------


def test_factory_loads_by_name_and_by_module_path():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    from kvshare_connector.connector import KVShareConnector

    load_general_plugins()
    by_name = KVTransferConfig(kv_connector="KVShareConnector", kv_role="kv_producer")
    by_path = KVTransferConfig(
        kv_connector="KVShareConnector",
        kv_connector_module_path="kvshare_connector",
        kv_role="kv_consumer",
    )
    assert KVConnectorFactory.get_connector_class(by_name) is KVShareConnector
    assert KVConnectorFactory.get_connector_class(by_path) is KVShareConnector
    # HMA stays on with our connector (vLLM turns it off for connectors without it).
    assert KVConnectorFactory.supports_hma_config(by_name)


# ---- two engines -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prefill_engine():
    """A prefill engine (g4tiny: 6 KV cache groups, 4 sharers) that served 3 requests."""
    port = pick_free_port()
    child = start_prefill(port, 300, 3, "--lease-s", "60", cwd=ROOT)
    try:
        yield child, child.wait_json(READY, 180)
    finally:
        child.kill()


@pytest.fixture
def engines():
    """In-process engines made by a test, shut down after it as vLLM shuts a worker down."""
    made: list[Engine] = []

    def make(*args: Any, **kwargs: Any) -> Engine:
        made.append(Engine(*args, **kwargs))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def test_pd_transfer_through_vllm_scheduler(prefill_engine, engines, tmp_path):
    child, ready = prefill_engine
    requests = ready["requests"]
    assert ready["owners"] == 6 and ready["regions"] == 1
    for info in requests.values():
        params = info["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and len(params["remote_block_ids"]) == 6

    read_log = tmp_path / "reads.jsonl"
    # "recompute": a refused load is computed locally and says why (kv_load_error), on
    # 0.26 and on vLLM >= 0.30, where kv_load_failure_policy decides (default: fail)
    decode = engines(
        "g4tiny", "per_layer", "kv_consumer", pick_free_port(), {"read_log": str(read_log)},
        failure_policy="recompute",
    )  # fmt: skip
    good = {rid: requests[rid] for rid in ("p0", "p1")}
    report = decode_requests(decode, good, 300)

    # Every layer (sharers through their alias) holds prefill's KV in decode's own blocks.
    assert decode.loaded == {"d0": [], "d1": []}
    assert all(r["kv_transfer_params"] is None for r in report.values())  # no load error
    reads = sum(s["reads"] for s in decode.stats)
    assert reads == 2 and sum(s["MB read"] for s in decode.stats) > 0
    logged = [json.loads(line) for line in read_log.read_text().splitlines()]
    assert sorted(r["request_id"] for r in logged) == ["d0", "d1"]
    for r in logged:  # the claim's time, split: prefill's share inside decode's round trip
        t = r["timeline"]
        assert 0 <= t["asked"] <= t["claimed"] <= t["prepared"] <= t["posted"] <= t["reported"]
        # (the marks and the answer time are rounded to 1 us each)
        assert 0 <= r["prefill_answer_s"] <= t["claimed"] - t["asked"] + 1e-5
        assert r["claims"] >= 1
    assert sum(r["bytes"] for r in logged) / 1e6 == pytest.approx(
        sum(s["MB read"] for s in decode.stats), abs=2e-3
    )

    # Negative control: the request's blocks in the wrong order (a proxy that reverses
    # lists) are refused by prefill before anything moves, naming the order; the refusal
    # took nothing from the request, whose right params then load.
    bad = dict(requests["p2"])
    params = dict(bad["kv_transfer_params"])
    params["remote_block_ids"] = [list(reversed(ids)) for ids in params["remote_block_ids"]]
    bad["kv_transfer_params"] = params
    refused = decode_requests(decode, {"p2": bad}, 300)["d2"]
    assert "in their order" in refused["kv_transfer_params"]["kv_load_error"], refused
    assert decode.loaded.pop("d2")  # nothing of prefill's KV came: other bytes there
    decode.outputs.pop("d2")
    assert decode_requests(decode, {"p2": requests["p2"]}, 300)["d2"]["kv_transfer_params"] is None
    assert decode.loaded["d2"] == []

    # Prefill freed every block once decode had read them (no leaked KV blocks).
    result = child.wait_json(RESULT, 60)
    assert result["held"] == []
    assert result["free_blocks"] == result["total_blocks"]
    assert sum(s["sent"] for s in result["stats"]) == 3
    # Decode freed its blocks too once its requests finished.
    pool = decode.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_a_decode_prompt_extending_prefills_loads_prefills_tokens_and_computes_the_rest(
    engines,
):
    """The first-token hand-off (toolkit/first_token.py): decode's prompt is prefill's plus
    the token prefill sampled. Decode loads the KV of prefill's prompt, byte for byte in
    every layer, and computes the one position prefill had no KV for. p0 has 304 tokens,
    19 blocks of 16 exactly, so the appended token starts a block prefill never had. The
    controls: a prompt of the same length whose prefix is another, and a prompt shorter than
    prefill's, are refused before any claim and computed locally."""
    port = pick_free_port()
    child = start_prefill(port, 304, 2, "--lease-s", "60", cwd=ROOT)
    try:
        requests = child.wait_json(READY, 180)["requests"]
        decode = engines("g4tiny", "per_layer", "kv_consumer", pick_free_port())
        p0 = requests["p0"]["kv_transfer_params"]
        assert p0["remote_prompt_tokens"] == 304
        # engine_sim's prompts depend on the seed: seeds 9 and 7 are other prompts (not
        # seed 0's, whose blocks decode would then find in its prefix cache, unwritten).
        decode.add("x9", 305, 3, dict(p0), 9)
        decode.add("x7", 303, 3, dict(p0), 7)
        decode.run_until(lambda: {"x9", "x7"} <= set(decode.outputs))
        errors = {r: decode.outputs[r].kv_transfer_params["kv_load_error"] for r in ("x9", "x7")}
        assert "digest of the prompt's first 304 of 305 token ids differs" in errors["x9"]
        assert "prefill had 304 prompt tokens, this request has 303" in errors["x7"]
        assert sum(s.get("reads", 0) for s in decode.stats) == 0

        # d<i> gets the prompt of length 305 + 37 i with seed i: p<i>'s and one token more.
        report = decode_requests(decode, requests, 305)
        result = child.wait_json(RESULT, 60)
    finally:
        child.kill()
    assert decode.loaded == {"d0": [], "d1": []}, decode.loaded
    assert all(r["kv_transfer_params"] is None for r in report.values())  # no load error
    assert sum(s["reads"] for s in decode.stats) == 2
    assert result["held"] == [] and result["free_blocks"] == result["total_blocks"]
    pool = decode.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_unreachable_prefill_and_malformed_params_are_computed_locally(engines):
    # vLLM 0.26 under HMA: the connector recomputes whatever the policy; from 0.30 vLLM's
    # kv_load_failure_policy decides, and "recompute" computes locally.
    decode = engines(
        "g4tiny",
        "per_layer",
        "kv_consumer",
        pick_free_port(),
        {"handshake_timeout_s": 1.0, "transfer_timeout_s": 2.0},
        failure_policy="recompute",
    )
    dead_port = pick_free_port()  # nothing listens here
    unreachable = {
        "do_remote_prefill": True,
        "remote_block_ids": [[1, 2]] * 6,
        "remote_engine_id": "gone",
        "remote_request_id": "p0",
        "remote_host": "127.0.0.1",
        "remote_port": dead_port,
        "tp_size": 1,
    }
    malformed = {"do_remote_prefill": True, "remote_block_ids": "not a list"}
    report = decode_requests(
        decode,
        {"p0": {"kv_transfer_params": unreachable}, "p1": {"kv_transfer_params": malformed}},
        200,
    )
    # Both requests still finish (computed locally), each with the reason.
    assert (
        "no answer from the prefill side channel"
        in report["d0"]["kv_transfer_params"]["kv_load_error"]
    )
    assert "remote_block_ids" in report["d1"]["kv_transfer_params"]["kv_load_error"]
    assert report["d0"]["tokens"] and report["d1"]["tokens"]
    pool = decode.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert decode.worker.worker.backend.in_flight() == set()


def test_decode_that_never_comes_releases_the_lease():
    port = pick_free_port()
    child = start_prefill(port, 200, 2, "--lease-s", "2", cwd=ROOT)
    try:
        child.wait_json(READY, 180)
        result = child.wait_json(RESULT, 60)
    finally:
        child.kill()
    assert result["held"] == []
    assert result["free_blocks"] == result["total_blocks"]
    assert sum(s["expired_leases"] for s in result["stats"]) == 2


def _preemptions_while_decoding(decode: Engine, params: dict[str, Any]) -> dict[str, Any]:
    """Four local requests, then one loaded from prefill, all decoding 600 tokens: in a
    small pool vLLM preempts the newest running request (the loaded one) when the pool is
    full, and schedules it again later. Preemptions and output tokens per request."""
    names = [f"L{i}" for i in range(4)] + ["d0"]
    for i, name in enumerate(names[:4]):
        decode.add(name, 300, 600, None, 5 + i)
    decode.step()
    decode.add("d0", 300, 600, params, 0)
    preempted = dict.fromkeys(names, 0)
    tokens = dict.fromkeys(names, 0)

    def done() -> bool:
        for name, request in decode.scheduler.requests.items():
            preempted[name] = max(preempted[name], request.num_preemptions)
            tokens[name] = len(request.output_token_ids)
        return set(names) <= set(decode.outputs)

    decode.run_until(done, 120)
    return {"preempted": preempted, "tokens": tokens}


@pytest.mark.parametrize("kv_blocks", [260, 4096])
def test_a_loaded_request_preempted_by_decode_is_recomputed_not_loaded_again(engines,
                                                                             kv_blocks):
    """Issue #25's small pools on decode: the loaded request is preempted (its blocks go
    back to the pool) and later recomputed locally: one READ, no second claim, no load
    error, every block free at the end, prefill's blocks freed once. The control: a large
    pool, where nothing is preempted (the preemption is what the small pool tests)."""
    port = pick_free_port()
    child = start_prefill(port, 300, 1, cwd=ROOT)
    try:
        params = child.wait_json(READY, 180)["requests"]["p0"]["kv_transfer_params"]
        decode = engines("g4tiny", "per_layer", "kv_consumer", pick_free_port(), {},
                         kv_bytes=kv_blocks * 8192)  # g4tiny: 8 KiB per block  # fmt: skip
        pool = decode.scheduler.kv_cache_manager.block_pool
        assert pool.num_gpu_blocks == kv_blocks
        run = _preemptions_while_decoding(decode, params)
        result = child.wait_json(RESULT, 60)
    finally:
        child.kill()
    if kv_blocks == 4096:
        assert set(run["preempted"].values()) == {0}
    else:
        assert run["preempted"]["d0"] >= 1
    assert decode.loaded == {"d0": []}  # loaded once, prefill's KV in every layer
    assert sum(s["reads"] for s in decode.stats) == 1
    assert set(run["tokens"].values()) == {599}  # the last step's token is not counted
    assert all(o.kv_transfer_params is None for o in decode.outputs.values())  # no error
    assert decode.worker.worker.backend.in_flight() == set()
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert result["held"] == [] and result["free_blocks"] == result["total_blocks"]
    assert sum(s["sent"] for s in result["stats"]) == 1


@pytest.mark.parametrize("kv_blocks", [260, 4096])
def test_held_requests_fill_prefills_pool_and_later_prefills_wait_for_the_lease(engines,
                                                                                kv_blocks):
    """Issue #25's small pools on prefill: each finished prefill holds its blocks for a
    decode that never comes; in a small pool the next prompt does not fit beside them and
    waits (not fails) until the lease frees them. Every request completes, every lease is
    counted, every block is free at the end. The control: a large pool, where no prompt
    waits for a lease."""
    lease_s = 1.0
    prefill = engines("g4tiny", "per_layer", "kv_producer", pick_free_port(),
                      {"kv_lease_duration": lease_s}, kv_bytes=kv_blocks * 8192)  # fmt: skip
    pool = prefill.scheduler.kv_cache_manager.block_pool
    source = prefill.worker.worker.backend.source
    names = [f"p{i}" for i in range(4)]
    for i, name in enumerate(names):
        prefill.add(name, 900, 1, {"do_remote_decode": True}, i)
    waited_behind_a_hold = False

    def drained() -> bool:
        nonlocal waited_behind_a_hold
        waiting = [r for r in prefill.scheduler.requests.values()
                   if r.request_id in names and r.num_computed_tokens == 0]  # fmt: skip
        waited_behind_a_hold |= bool(waiting and source.held)
        return set(names) <= set(prefill.outputs) and not source.held and (
            pool.get_num_free_blocks() == pool.num_gpu_blocks - 1)

    prefill.run_until(drained, 60)
    assert waited_behind_a_hold is (kv_blocks == 260)
    assert all(prefill.outputs[n].kv_transfer_params["do_remote_prefill"] for n in names)
    assert sum(s.get("expired_leases", 0) for s in prefill.stats) == 4


@pytest.mark.parametrize("held_first", [False, True])
def test_a_claim_before_prefill_holds_the_request_is_asked_again(engines, tmp_path, held_first):
    """vLLM hands a finished prefill to the worker one step after it returned the request's
    kv_transfer_params, so decode may claim before prefill holds the blocks: "not held yet"
    is asked again until it is, then the load completes (two engines in this process,
    prefill stepped only when the test says). The control: prefill holds it first, and one
    claim does."""
    prefill = engines("g4tiny", "per_layer", "kv_producer", pick_free_port(), {})
    prefill.add("p0", 300, 1, {"do_remote_decode": True}, 0)
    prefill.run_until(lambda: "p0" in prefill.outputs, 60)
    source = prefill.worker.worker.backend.source
    assert not source.held  # the worker learns of it at prefill's next step
    if held_first:
        prefill.step()
        assert source.held == {"p0"}
    read_log = tmp_path / "reads.jsonl"
    decode = engines("g4tiny", "per_layer", "kv_consumer", pick_free_port(),
                     {"read_log": str(read_log)})  # fmt: skip
    decode.add("d0", 300, 3, prefill.outputs["p0"].kv_transfer_params, 0)
    reads = decode.worker.worker.backend.sink.sink._reads  # the sink's reads in flight

    def claims() -> int:
        return reads["d0"].claims if "d0" in reads else 0

    deadline = time.monotonic() + 60  # decode claims, and claims again (a slow box: bounded)
    while time.monotonic() < deadline and not (held_first or claims() >= 3):
        decode.step()
        time.sleep(0.005)
    if held_first:
        decode.run_until(lambda: "d0" in decode.loaded, 60)
    assert ("d0" in decode.loaded) is held_first  # not held: nothing was read yet
    prefill.step()  # now prefill holds it (already did, in the control)
    decode.run_until(lambda: "d0" in decode.outputs, 60)
    assert decode.loaded == {"d0": []}  # prefill's KV in every layer
    (record,) = [json.loads(line) for line in read_log.read_text().splitlines()]
    if held_first:
        assert record["claims"] == 1
    else:
        assert record["claims"] >= 3  # "not held yet", asked again every 10 ms or so
        assert record["timeline"]["claimed"] - record["timeline"]["asked"] >= 0.02
    prefill.run_until(lambda: not source.held, 30)  # decode's done notification frees it


def test_cross_layer_blocks_pd_transfer(engines):
    port = pick_free_port()
    child = start_prefill(port, 250, 1, "--model", "g4uniform", "--layout", "cross_layer", cwd=ROOT)
    try:
        ready = child.wait_json(READY, 180)
        decode = engines("g4uniform", "per_layer", "kv_consumer", pick_free_port())
        assert decode.topology.layout in ("per_layer", "LBNHC")  # 0.33: vLLM's pick
        decode_requests(decode, ready["requests"], 250)
        assert decode.loaded == {"d0": []}
        result = child.wait_json(RESULT, 60)
        assert result["free_blocks"] == result["total_blocks"]
    finally:
        child.kill()


# ---- the LMCache backend ------------------------------------------------------------------


def test_pd_through_lmcache_backend(monkeypatch, engines):
    """Prefill stores owner layers' KV in LMCache (an lm:// server) in the step that computes
    it and holds no blocks; decode loads it into its own blocks through vLLM's scheduler."""
    pytest.importorskip("lmcache")
    from lab.tools.engine_sim import lmcache_extra

    from .support.lmcache_util import QUIET_ENV, running_lm_server

    monkeypatch.setenv("PYTHONHASHSEED", "0")  # both sides: LMCache's hash chain seed
    for key, value in QUIET_ENV.items():
        monkeypatch.setenv(key, value)
    with running_lm_server() as url:
        child = None
        try:
            child = start_prefill(pick_free_port(), 300, 2, "--lmcache-url", url, cwd=ROOT)
            ready = child.wait_json(READY, 180)
            for info in ready["requests"].values():
                assert info["kv_transfer_params"]["kvshare_backend"] == "lmcache"
            result = child.wait_json(RESULT, 60)
            assert result["free_blocks"] == result["total_blocks"]  # prefill held nothing
            assert sum(s["sent"] for s in result["stats"]) == 2  # two stores

            decode = engines(
                "g4tiny", "per_layer", "kv_consumer", pick_free_port(), lmcache_extra(url)
            )
            report = decode_requests(decode, ready["requests"], 300)
            assert decode.loaded == {"d0": [], "d1": []}
            assert all(r["kv_transfer_params"] is None for r in report.values())
            # (decode's scheduler turned do_remote_prefill off in the params it was given)
            params = {
                rid: dict(info["kv_transfer_params"], do_remote_prefill=True)
                for rid, info in ready["requests"].items()
            }

            # The first-token hand-off: decode's prompt is prefill's and one token more; a
            # fresh decode (the first one's prefix cache now holds these prompts) loads
            # prefill's 300 and 337 tokens from LMCache.
            longer = engines(
                "g4tiny", "per_layer", "kv_consumer", pick_free_port(), lmcache_extra(url)
            )
            report = decode_requests(
                longer, {rid: {"kv_transfer_params": dict(p)} for rid, p in params.items()}, 301
            )
            assert longer.loaded == {"d0": [], "d1": []}
            assert all(r["kv_transfer_params"] is None for r in report.values())

            # Negative control: the same load skipped (reported done, nothing moved) fails the
            # same check.
            skipper = engines(
                "g4tiny",
                "per_layer",
                "kv_consumer",
                pick_free_port(),
                lmcache_extra(url),
                connector="LoadSkippingConnector",
                module_path="lab.tools.negative_control",
            )
            again = dict(params["p0"])
            skipped = dict(params["p1"], kvshare_test_skip_load=True)
            decode_requests(
                skipper,
                {"p0": {"kv_transfer_params": again}, "p1": {"kv_transfer_params": skipped}},
                300,
            )
            assert skipper.loaded["d0"] == []  # the same engine loads what it is not told to skip
            assert skipper.loaded["d1"], "a skipped LMCache load went unnoticed"

            # A prompt prefill never stored misses and is computed locally.
            other = {"p7": {"kv_transfer_params": dict(params["p0"])}}
            report = decode_requests(decode, other, 333)
            assert "kv_load_error" in (report["d7"]["kv_transfer_params"] or {})
            pool = decode.scheduler.kv_cache_manager.block_pool
            assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
        finally:
            if child is not None:
                child.kill()
