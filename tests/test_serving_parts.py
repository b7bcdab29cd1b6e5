"""bench_serving.py's pure parts on CPU, on synthetic input: Prometheus parsing, the
warmup's generation checks, the scaling plan and its time bound, the fault test's timeline
and verdicts, the scaling report (table with points not reached, PNG from raw JSON), and the
long-lived bench worker (runs, failures, a timeout that kills and restarts it)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks.gpu import fault_matrix
from benchmarks.gpu import serving_report as sr
from benchmarks.gpu.serving import checks, fault_report, metrics, scaling
from benchmarks.gpu.serving.client import BenchClient

from .test_serving_report import vllm_result

ROOT = Path(__file__).resolve().parent.parent

PROM = """# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 40.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 2.0
vllm:request_success_created{engine="0",finished_reason="stop",model_name="m"} 1.7e9
vllm:kvshare_read_seconds_bucket{engine="0",le="0.001",model_name="m"} 5.0
vllm:kvshare_read_seconds_count{engine="0",model_name="m"} 42.0
vllm:kvshare_failed_loads_total{engine="0",model_name="m"} 1.0
vllm:kvshare_failed_loads_created{engine="0",model_name="m"} 1.7e9
vllm:gpu_cache_other 9
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e9
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 30.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 4.2
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 42.0
"""


def test_prometheus_parse_and_engine_summary() -> None:
    series = metrics.parse(PROM)
    assert series["vllm:kv_cache_usage_perc"] == 0.25
    assert series['vllm:request_success_total{finished_reason="stop"}'] == 2.0
    assert "vllm:gpu_cache_other" not in series
    assert metrics.total(series, "vllm:request_success_total") == 42.0
    assert metrics.total(series, "vllm:nothing") is None
    summary = metrics.engine_summary(series)
    assert (summary["requests"], summary["kv_cache_usage"], summary["running"]) == (42.0, 0.25, 3.0)
    assert summary["kvshare"] == {"read_seconds_count": 42.0, "failed_loads_total": 1.0}
    assert summary["seconds"]["ttft"] == [4.2, 42.0]  # sum, count (buckets not kept)
    assert summary["seconds"]["queue"] == [None, None]
    assert summary["preemptions"] == 7.0
    assert not any("_bucket" in k and "time_to_first" in k for k in series)
    assert metrics.engine_summary(None) == {"up": False}


def test_generation_checks() -> None:
    a = checks.prompt_ids(1, 3, 50, 4096)
    assert a == checks.prompt_ids(1, 3, 50, 4096) and a != checks.prompt_ids(2, 3, 50, 4096)
    assert all(len(p) == 50 and min(p) >= 16 and max(p) < 4096 for p in a)
    good = {"status": 200, "text": " x y", "completion_tokens": 4, "kv_load_error": None}
    records = [
        good, {**good, "completion_tokens": 3}, {"status": 503, "error": "prefill down"},
        {**good, "kv_load_error": "peer gone"}, {**good, "text": ""},
    ]  # fmt: skip
    verdict = checks.judge(records, 4)
    assert (verdict["ok"], verdict["requests"]) == (1, 5)
    assert [p.split(":")[0] for p in verdict["problems"]] == ["#1", "#2", "#3", "#4"]
    assert "HTTP 503 prefill down" in verdict["problems"][1]
    by = {"colocated": [{"text": "a"}, {"text": "b"}], "ours": [{"text": "a"}, {"text": "c"}],
          "nixl": [{"text": None}]}  # fmt: skip
    assert checks.agreement(by, "colocated") == {"ours": 0.5, "nixl": None}
    # Token ids, where the server returns them, decide: empty text is then no problem (ids
    # past the tokenizer's vocabulary decode to nothing), a short id list is.
    ids = {**good, "text": "", "token_ids": [5000, 6000, 7000, 8000]}
    verdict = checks.judge([ids, {**ids, "token_ids": [5000]}], 4)
    assert verdict["ok"] == 1 and verdict["problems"] == ["#1: 1 token ids, asked 4"]
    by = {"colocated": [ids, ids], "ours": [ids, {**ids, "token_ids": [5000, 6000, 7000, 1]}]}
    assert checks.agreement(by, "colocated") == {"ours": 0.5}


def test_scaling_plan_and_time_estimate() -> None:
    assert scaling.points([4096, 1024], [16, 1]) == [(1024, 1), (1024, 16), (4096, 1), (4096, 16)]
    assert [scaling.prompts_at(c, 1, 4) for c in (1, 16, 64)] == [4, 16, 64]
    assert scaling.estimate([], 10**6) == 5.0
    # 1M tokens took 15 s (10 s past the fixed 5): 4M tokens, 45 s.
    assert scaling.estimate([(10**6, 15.0), (10**5, 5.5)], 4 * 10**6) == pytest.approx(45.0)


def test_runner_allows_each_point_its_own_time_and_caps_the_shape_warmup(tmp_path: Path) -> None:
    """The time budget is judged per point: a long point's slow runs do not stop the short
    points after it. The shape warmup's prompts are capped at --shape-warmup-len, once per
    capped length and concurrency, and its durations count for the point it ran at."""
    from benchmarks.gpu.bench_serving import build_parser
    from benchmarks.gpu.serving.runs import Runner

    args = build_parser().parse_args(
        ["--model-dir", str(tmp_path), "--out", str(tmp_path / "o"), "--input-len", "1024",
         "16384", "32768", "--concurrency", "1", "64", "--shape-warmup-len", "4096"])  # fmt: skip
    runner = Runner(args, [], tmp_path, tmp_path, None, 4096)  # type: ignore[arg-type]
    assert runner.need({"input_len": 1024, "concurrency": 1, "num_prompts": 4}) == 35.0
    runner.durations = [38.0]  # a timed run anywhere: the bound for points not seen yet
    assert runner.need({"input_len": 1024, "concurrency": 1, "num_prompts": 4}) == 43.0
    runner.at_point = {(1024, 1): [(4, 2.0), (4, 3.0)], (32768, 64): [(64, 110.0)]}
    assert runner.need({"input_len": 1024, "concurrency": 1, "num_prompts": 8}) == 11.0
    assert runner.need({"input_len": 32768, "concurrency": 64, "num_prompts": 64}) == 115.0
    waves: list[dict[str, Any]] = []
    runner.bench = lambda p, run: waves.append(run)  # type: ignore[method-assign]
    runner.snapshot = lambda p, tag: None  # type: ignore[method-assign]
    runner.shape_warmup(SimpleNamespace(name="ours"))  # type: ignore[arg-type]
    assert [(w["input_len"], w["concurrency"], w["num_prompts"]) for w in waves] == [
        (1024, 1, 1), (1024, 64, 64), (4096, 1, 1), (4096, 64, 64)]  # fmt: skip
    assert all(w["warmup"] and w["round"] == -1 for w in waves)


def _fault_data(t0: float, victim: str = "prefill", action: str = "kill") -> dict[str, Any]:
    """Raw data of a fault run: the victim down from +10 s, back at +13 s, healthy at +40 s."""
    survivor = "decode0" if victim == "prefill" else "prefill0"
    back = "victim resumed" if action == "stop" else "victim restarted"
    ev = [("load start", 0.0), ("fault", 10.0), (back, 13.0), ("victim rejoined", 40.0),
          ("load end", 60.0)]  # fmt: skip
    events = [{"time": t0 + dt, "event": e} for e, dt in ev]
    events[-1]["still_running"] = False
    counters = {"verified_loads_total": 5.0, "verify_failures_total": 0.0,
                "failed_loads_total": 1.0}  # fmt: skip
    samples = [{"time": t0 + k, "engines": {
        survivor: {"healthy": True, "kv_cache_usage": 0.1},
        f"{victim}0": {"healthy": not 10 <= k < 40}}} for k in range(0, 61, 2)]  # fmt: skip
    for s in samples[:5]:  # decode's counters, scraped before the fault
        s["engines"]["decode0"]["counters"] = counters
    probes = [{"time": t0 + k, "status": 503 if 10 <= k < 40 else 200, "seconds": 0.01}
              for k in range(60)]  # fmt: skip
    direct = [{"time": t0 + k + 0.5, "status": 200, "seconds": 0.02} for k in range(60)]
    stale = {"status": 200, "seconds": 0.4, "kv_load_error": "KV load failed: peer gone"}
    final = {"decode0": {"vllm:kvshare_read_seconds_count": 30.0,
                         "vllm:kvshare_failed_loads_total": 2.0,
                         "vllm:kvshare_verified_loads_total": 7.0,
                         "vllm:kvshare_verify_failures_total": 0.0},
             "prefill0": {"vllm:kvshare_sent_total": 8.0}}  # fmt: skip
    ref = [{"status": 200, "token_ids": [i, i + 1]} for i in range(8)]
    return {"events": events, "samples": samples, "probes": probes, "drained_s": 3.0,
            "survivor_probes": direct, "stale_load": stale if victim == "prefill" else {},
            "reference_records": ref, "after_records": [dict(r) for r in ref],
            "after": {"requests": 8, "ok": 8, "problems": []},
            "usage_after_drain": {"prefill0": 0.0, "decode0": 0.0}, "final_kvshare": final,
            "fault": {"victim": victim, "engine": f"{victim}0", "survivor": survivor,
                      "action": action, "how": "SIGKILL", "fired": True,
                      "roles": {"prefill0": "prefill", "decode0": "decode"}}}  # fmt: skip


def _result() -> dict[str, Any]:
    """vLLM's detailed result: perf_counter start times; it ended at t0 + 61 after 60 s."""
    return {"duration": 60.0, "completed": 50, "failed": 10,
            "start_times": [500.0 + k for k in range(60)],
            "errors": ["" if not 10 <= k < 20 else "HTTP 503" for k in range(60)],
            "ttfts": [0.1] * 60, "itls": [[0.5, 0.6]] * 60}  # fmt: skip


def test_fault_timeline_and_verdicts() -> None:
    t0 = 1_000_000.0
    result = _result()
    reqs = fault_report.bench_requests(result, t0 + 61.0)
    assert reqs[0]["time"] == pytest.approx(t0 + 1.0) and reqs[12]["ok"] is False
    binned = fault_report.bins(reqs, t0 + 10.0, 2.0)
    assert binned[0] == {"ok": 1, "failed": 1} and binned[6] == {"ok": 2, "failed": 0}
    data = _fault_data(t0)
    summary = fault_report.summarize(data, result, t0 + 61.0, 30.0)
    v = summary["verdicts"]
    assert list(v) == list(fault_report.VERDICTS)
    assert all(x["ok"] for x in v.values()), v
    kept = v["survivor_kept_serving"]
    assert kept["survivor"] == "decode0" and kept["direct_probes_ok"] == "50/50"
    assert kept["healthy_samples"] == "26/26"
    assert kept["front_requests_after_fault_ok"] == "41/51"
    assert kept["in_flight_at_fault"] == "1/1 ok"  # started at +9 s, 1.2 s long
    assert kept["stale_load"]["kv_load_error"].startswith("KV load failed")
    assert v["connector_series_live"]["prefill"] == {"sent_total": 8.0}
    assert v["no_wrong_kv"]["verified_loads"] == 7.0
    m = summary["measured"]
    assert (m["completed"], m["failed"], m["local_loads"]) == (50, 10, 2)
    assert m["cut_short"] == 0  # no output lengths in this result: nothing to judge by

    # A stream that ended short (a decode lost after prefill's first token reached the
    # client) is a success to vLLM's bench; with the load's output length it is a failure.
    short = {**result, "output_lens": [32] * 60}
    short["output_lens"][30] = 1
    reqs = fault_report.bench_requests(short, t0 + 61.0, 32)
    assert [k for k, r in enumerate(reqs) if not r["ok"]] == [*range(10, 20), 30]
    assert reqs[30]["error"] == "stream ended after 1 of 32 tokens"
    cut = fault_report.summarize(data, short, t0 + 61.0, 30.0, 32)["measured"]
    assert (cut["completed"], cut["failed"], cut["cut_short"]) == (49, 11, 1)
    assert "stream ended after 1 of 32 tokens" in cut["errors"]
    assert fault_report.bench_requests(short, t0 + 61.0)[30]["ok"]  # without the length
    assert m["errors"] == ["HTTP 503"] and m["probe_errors"] == ["HTTP 503"]
    # Restarted at +13 s; the first good request through the front (a bench request sent
    # at +21 s, 1.2 s long) ended 12.2 s after the fault, before the health probe saw the
    # victim back (+40 s).
    assert m["fault_to_first_good_s"] == pytest.approx(12.2, abs=0.05)
    assert m["healthy_to_first_good_s"] == pytest.approx(-17.8, abs=0.05)
    text = fault_report.markdown({**summary, "setup": {"front": "kvshare"}})
    assert "| no_hang | PASS |" in text and "victim rejoined" in text
    assert "| +0 | 1 | 1 | 0 | 2 | 2 | 0 |" in text
    # A probe that never answered, a survivor that went down, KV that never drained, a
    # stale load that hung, a verify failure: FAIL.
    data["stale_load"] = {"status": None, "seconds": 30.0}
    data["probes"].append({"time": t0 + 20, "status": None, "seconds": 30.0})
    data["samples"][10]["engines"]["decode0"]["healthy"] = False
    data["drained_s"] = None
    data["final_kvshare"]["decode0"]["vllm:kvshare_verify_failures_total"] = 1.0
    v = fault_report.summarize(data, result, t0 + 61.0, 30.0)["verdicts"]
    assert [k for k, x in v.items() if not x["ok"]] == [
        "survivor_kept_serving", "no_hang", "kv_usage_zero", "no_wrong_kv"]  # fmt: skip
    assert v["no_wrong_kv"]["verify_failures"] == 1.0


def test_fault_verdicts_decode_victim_and_stop() -> None:
    t0 = 1_000_000.0
    # A decode victim: prefill is the survivor, answering plain requests straight to it.
    data = _fault_data(t0, victim="decode")
    v = fault_report.summarize(data, _result(), t0 + 61.0, 30.0)["verdicts"]
    assert all(x["ok"] for x in v.values()), v
    assert v["survivor_kept_serving"]["survivor"] == "prefill0"
    assert v["victim_rejoined"]["victim"] == "decode0"
    # Decode restarted: its counters start over (5 verified loads before, 3 after).
    data["final_kvshare"]["decode0"]["vllm:kvshare_verified_loads_total"] = 3.0
    v = fault_report.summarize(data, _result(), t0 + 61.0, 30.0)["verdicts"]
    assert v["no_wrong_kv"]["verified_loads"] == 8.0
    # A check after recovery whose greedy answer differs from before the fault: reported,
    # not judged (outputs of random-init weights differ across engine processes anyway);
    # the verdict is the KV's: verify_kv failures (above) fail it, and so do no verified loads.
    data["after_records"][3]["token_ids"] = [9, 9]
    v = fault_report.summarize(data, _result(), t0 + 61.0, 30.0)["verdicts"]
    assert v["no_wrong_kv"]["ok"] and v["no_wrong_kv"]["check_outputs_differing"] == 1
    data["final_kvshare"]["decode0"]["vllm:kvshare_verified_loads_total"] = 0.0
    for sample in data["samples"]:
        for engine in sample["engines"].values():
            engine.get("counters", {}).pop("verified_loads_total", None)
    v = fault_report.summarize(data, _result(), t0 + 61.0, 30.0)["verdicts"]
    assert v["no_wrong_kv"]["verified_loads"] == 0 and not v["no_wrong_kv"]["ok"]
    # A stop: judged on "victim resumed"; never resumed (no such event): victim_rejoined FAIL.
    data = _fault_data(t0, action="stop")
    v = fault_report.summarize(data, _result(), t0 + 61.0, 30.0)["verdicts"]
    assert v["victim_rejoined"]["ok"]
    data["events"] = [e for e in data["events"] if e["event"] != "victim resumed"]
    v = fault_report.summarize(data, _result(), t0 + 61.0, 30.0)["verdicts"]
    assert not v["victim_rejoined"]["ok"]
    # A request that took longer than the probe timeout: no_hang FAIL.
    result = _result()
    result["itls"][30] = [40.0]
    v = fault_report.summarize(_fault_data(t0), result, t0 + 61.0, 30.0)["verdicts"]
    assert not v["no_hang"]["ok"] and v["no_hang"]["requests_past_timeout"] == 1


def test_counter_total_sums_across_restarts() -> None:
    assert fault_report.counter_total([None, 1.0, 3.0, None, 2.0, 4.0]) == 7.0
    assert fault_report.counter_total([]) == 0.0


def test_fault_matrix_cases_commands_and_table(tmp_path: Path) -> None:
    cases = fault_matrix.pick(None)
    assert [c.name for c in cases] == ["prefill_claim", "decode_read", "prefill_stop",
                                       "prefill_release", "prefill_flood",
                                       "decode_never_comes", "small_pools",
                                       "fault_free"]  # fmt: skip
    assert fault_matrix.pick(["b", "prefill_stop"]) == [cases[1], cases[2]]
    with pytest.raises(SystemExit):
        fault_matrix.pick(["z"])
    argvs = [fault_matrix.case_argv(c, i, "/m", tmp_path, ["--input-len", "1024"])
             for i, c in enumerate(cases)]  # fmt: skip
    ports = {a[a.index("--base-port") + 1] for a in argvs}
    sides = {a[a.index("--side-channel-port") + 1] for a in argvs}
    assert len(ports) == len(sides) == 8
    assert argvs[4][argvs[4].index("--fault-action") + 1] == "flood"
    assert argvs[5][argvs[5].index("--fault-action") + 1] == "drop"
    outs = [a[a.index("--out") + 1] for a in argvs]
    assert outs == [str(tmp_path / c.name) for c in cases]
    assert argvs[1][argvs[1].index("--extra-config") + 1] == '{"kv_lease_duration": 15}'
    assert argvs[0][-2:] == ["--input-len", "1024"]
    # Variants: every case again in other deployments (the proxy's drop not behind a router).
    crossed = fault_matrix.pick(None, ["1p1d", "router-1p2d", "noverify"])
    names = [c.name for c in crossed]
    assert len(crossed) == 23 and "decode_never_comes@router-1p2d" not in names
    assert "prefill_claim@router-1p2d" in names and "decode_read@noverify" in names
    read_noverify = crossed[names.index("decode_read@noverify")]
    assert read_noverify.argv[-2:] == ["--extra-config", '{"verify_kv": false}']
    argvs = [fault_matrix.case_argv(c, i, "/m", tmp_path, []) for i, c in enumerate(crossed)]
    ports = [int(a[a.index("--base-port") + 1]) for a in argvs]
    sides = [int(a[a.index("--side-channel-port") + 1]) for a in argvs]
    assert len(set(ports)) == len(set(sides)) == 23
    assert max(ports) + fault_matrix.PORT_STEP <= min(sides) and max(sides) < 32768
    two_prefills = fault_matrix.pick(["c"], ["2p1d"])
    assert [c.name for c in two_prefills] == ["prefill_stop@2p1d"]
    assert two_prefills[0].argv[-2:] == ["--num-prefill", "2"]
    with pytest.raises(SystemExit):
        fault_matrix.pick(None, ["3p3d"])
    # The table: one case with a summary, one with none (its process gave no result).
    t0 = 1_000_000.0
    summary = fault_report.summarize(_fault_data(t0), _result(), t0 + 61.0, 30.0)
    (tmp_path / "prefill_claim").mkdir()
    (tmp_path / "prefill_claim" / "faults.json").write_text(json.dumps(summary))
    rows = fault_matrix.write_table(tmp_path, cases[:2], {"prefill_claim": 0, "decode_read": 1})
    assert rows[0]["completed_failed_local"] == "50/10/2"
    text = (tmp_path / "fault_matrix.md").read_text()
    assert "| prefill_claim | prefill | SIGKILL | PASS | PASS | PASS | PASS | PASS | PASS | " \
           "50/10/2 | 12.2 | prefill0 0.0%, decode0 0.0% | 7.0 | — |  |" in text
    assert "| decode_read | decode | failpoint sink.read_posted | — | — | — | — | — | — | " in text
    assert "no result (exit 1, see decode_read.log)" in text
    assert "HTTP 503" in text


def test_fault_matrix_sets_throughput_against_the_fault_free_run(tmp_path: Path) -> None:
    """Decode's output throughput per case as a fraction of the fault-free run of the same
    deployment, judged (>= 90 %) only where the victim's requests have somewhere else to go."""
    cases = fault_matrix.pick(["a", "e", "f", "0"], ["1p1d", "2p1d"])
    judged = {c.name: fault_matrix.throughput_judged(c) for c in cases}
    assert judged == {"prefill_claim": False, "prefill_flood": True,
                      "decode_never_comes": False, "fault_free": False,
                      "prefill_claim@2p1d": True, "prefill_flood@2p1d": True,
                      "decode_never_comes@2p1d": False, "fault_free@2p1d": False}  # fmt: skip
    assert fault_matrix.throughput_judged(fault_matrix.pick(["b"], ["1p2d"])[0])
    assert [fault_matrix.engines(c) for c in fault_matrix.pick(["a"], ["1p1d", "1p2d",
            "router-1p2d", "2p1d"])] == [2, 3, 3, 3]  # fmt: skip
    assert not fault_matrix.throughput_judged(fault_matrix.pick(["c"], ["2p1d"])[0])
    t0 = 1_000_000.0
    tput = {"prefill_claim": 300.0, "prefill_flood": 250.0, "decode_never_comes": 200.0,
            "fault_free": 320.0, "prefill_claim@2p1d": 370.0, "prefill_flood@2p1d": 400.0,
            "fault_free@2p1d": 400.0}  # decode_never_comes@2p1d gave no result  # fmt: skip
    for name, value in tput.items():
        summary = fault_report.summarize(_fault_data(t0), {**_result(), "output_throughput":
                                         value}, t0 + 61.0, 30.0)  # fmt: skip
        (tmp_path / name).mkdir()
        (tmp_path / name / "faults.json").write_text(json.dumps(summary))
    rows = {r["case"]: r for r in fault_matrix.write_table(tmp_path, cases, {})}
    assert rows["prefill_claim"]["throughput_vs_fault_free"] == pytest.approx(300 / 320, abs=1e-3)
    assert rows["prefill_claim"]["throughput_ok"] is None  # 1P1D: every request needs prefill
    assert rows["prefill_flood"]["throughput_ok"] is False  # 78 % < 90 %
    assert rows["prefill_claim@2p1d"]["throughput_ok"] is True  # 370 / 400: 92.5 %
    assert rows["fault_free@2p1d"]["throughput_vs_fault_free"] == 1.0
    assert rows["decode_never_comes@2p1d"]["throughput_vs_fault_free"] is None
    text = (tmp_path / "fault_matrix.md").read_text()
    assert "| 250 (78 %) FAIL |" in text and "| 300 (94 %) |" in text
    assert "| 370 (92 %) PASS |" in text


def test_fault_matrix_compares_throughput_only_under_the_same_load(tmp_path: Path) -> None:
    """Small pools run at twice the rate: no ratio against the fault-free run (it would
    read as a loss), the load named instead; its preemptions are in the note."""
    cases = fault_matrix.pick(["0", "g", "a"])
    assert fault_matrix.load_of(cases[0]) == fault_matrix.load_of(cases[2])
    assert fault_matrix.load_of(cases[0]) != fault_matrix.load_of(cases[1])
    t0 = 1_000_000.0
    for case, value, preempted in zip(cases, (114.0, 92.0, 110.0), (0.0, 12.0, 0.0),
                                      strict=True):  # fmt: skip
        data = _fault_data(t0)
        data["final_kvshare"]["decode0"]["vllm:num_preemptions_total"] = preempted
        summary = fault_report.summarize(data, {**_result(), "output_throughput": value},
                                         t0 + 61.0, 30.0)  # fmt: skip
        assert summary["measured"]["preemptions"]["decode0"] == preempted
        (tmp_path / case.name).mkdir()
        (tmp_path / case.name / "faults.json").write_text(json.dumps(summary))
    rows = {r["case"]: r for r in fault_matrix.write_table(tmp_path, cases, {})}
    assert rows["small_pools"]["throughput_vs_fault_free"] is None
    assert rows["prefill_claim"]["throughput_vs_fault_free"] == pytest.approx(110 / 114, abs=1e-3)
    text = (tmp_path / "fault_matrix.md").read_text()
    small = "| 92 (another load: 8 req/s, 0.125 GiB of KV per engine) | preemptions: decode0 12 |"
    assert small in text
    assert "| 110 (96 %) |  |" in text


def test_scaling_report_marks_points_not_reached_and_plots(tmp_path: Path) -> None:
    """Synthetic raw JSON of a scaling run: 1k/4k x 1/16 ran, 16k and 32k did not."""
    raw = tmp_path / sr.RAW
    (raw / "bench").mkdir(parents=True)
    (raw / "reads").mkdir()
    deps = {"ours": {"kind": "ours", "router": "vllm-router",
                     "read_logs": ["reads/ours-decode0.jsonl", "reads/ours-decode1.jsonl"]},
            "nixl": {"kind": "nixl", "router": "vllm-router", "read_logs": []},
            "colocated": {"kind": "colocated", "router": "none", "read_logs": []}}  # fmt: skip
    (raw / "deployments.json").write_text(json.dumps(deps))
    (raw / "meta.json").write_text(json.dumps({"mode": "scaling", "router": "vllm-router"}))
    runs, reads, t = [], [[], []], 100.0
    for length in (1024, 4096, 16384, 32768):
        for conc in (1, 16):
            for name in deps:
                run = {"deployment": name, "kind": name, "round": 0, "input_len": length,
                       "concurrency": conc, "file": f"bench/{name}_r0_in{length}_c{conc}.json",
                       "warmup": False}  # fmt: skip
                if length > 4096:
                    runs.append({**run, "skipped": "time budget (3s left, ~40s needed)"})
                    continue
                ttft = length / 100 * (1.2 if name == "nixl" else 1.0)
                (raw / run["file"]).write_text(json.dumps(vllm_result(5.0, ttft, 8.0 + conc)))
                runs.append({**run, "start": t, "end": t + 5, "rc": 0})
                if name == "ours":
                    for i in range(4):  # half the reads on each decode: 200 GB/s
                        reads[i % 2].append({"time": t + 1, "bytes": length * 10**6,
                                             "descriptors": 1, "blocks": 4,
                                             "seconds": length * 5e-6})  # fmt: skip
                t += 10
    (raw / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    for k in (0, 1):
        (raw / "reads" / f"ours-decode{k}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in reads[k])
        )
    summary = sr.write_report(tmp_path)
    assert len(summary["points"]) == 4 and len(summary["not_reached"]) == 12
    ours = summary["points"][0]["deployments"]["ours"]
    assert ours["read_gbps"]["median"] == pytest.approx(200.0)
    assert ours["reads_per_request"]["median"] == pytest.approx(0.4)  # 4 reads, 10 completed
    text = (tmp_path / "summary.md").read_text()
    assert "## Scaling: TTFT p50 ms / ITL p50 ms / READ GB/s" in text
    assert "| 1024 | 1 | 10.2 / 9.0 | 12.3 / 9.0 | 10.2 / 9.0 / 200.0 |" in text
    assert "| 32768 | 16 | not reached | not reached | not reached |" in text
    assert "Not reached (12 runs): time budget" in text
    assert (tmp_path / "scaling.png").stat().st_size > 10_000


FAKE_IMPL = """
import json, time
def run(argv):
    opts = dict(zip(argv[::2], argv[1::2]))
    if opts.get("--label") == "boom":
        raise RuntimeError("no such model")
    if opts.get("--label") == "slow":
        time.sleep(60)
    print("running", opts["--label"])
    with open(opts["--result-dir"] + "/" + opts["--result-filename"], "w") as f:
        json.dump({"completed": 1}, f)
"""


def test_bench_worker_runs_fails_and_times_out(tmp_path: Path, monkeypatch: Any) -> None:
    (tmp_path / "fake_impl.py").write_text(FAKE_IMPL)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    raw = tmp_path / "raw"
    (raw / "bench").mkdir(parents=True)
    client = BenchClient(raw, None, "fake_impl:run")
    opts = ["--result-dir", str(raw / "bench"), "--result-filename"]
    try:
        client.start()
        assert client.run([*opts, "a.json", "--label", "ok"], raw / "a.log", 30) == 0
        pid = client.worker.pid
        assert client.run([*opts, "b.json", "--label", "boom"], raw / "b.log", 30) == 1
        assert "no such model" in (raw / "b.log").read_text()
        assert client.run([*opts, "c.json", "--label", "slow"], raw / "c.log", 2) == 124
        assert client.worker is None  # killed; the next run starts a new one
        assert client.run([*opts, "d.json", "--label", "ok"], raw / "d.log", 30) == 0
        assert client.worker.pid != pid
    finally:
        client.close()
    assert sorted(p.name for p in (raw / "bench").iterdir()) == ["a.json", "d.json"]
    assert "running ok" in (raw / "a.log").read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fault-action", "drop"], "the decode that never comes"),  # victim: prefill
        (["--fault-action", "drop", "--fault-victim", "decode", "--router", "vllm-router"],
         "through our proxy"),
        (["--fault-action", "flood", "--fault-victim", "decode"], "floods prefill's"),
        (["--fault-action", "stop", "--fault-point", "sink.read_posted"], "goes with"),
    ],
)  # fmt: skip
def test_fault_options_that_do_not_go_together_are_refused(argv: list[str], message: str,
                                                           capsys: Any) -> None:  # fmt: skip
    from benchmarks.gpu import bench_serving

    with pytest.raises(SystemExit):
        bench_serving.main(["--out", "/tmp/x", "--model-dir", "/m", "--mode", "faults", *argv])
    assert message in capsys.readouterr().err
