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

from lab.benchmarks.gpu import serving_report as sr
from lab.benchmarks.gpu.serving import checks, metrics, scaling
from lab.benchmarks.gpu.serving.client import BenchClient

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
    from lab.benchmarks.gpu.bench_serving import build_parser
    from lab.benchmarks.gpu.serving.runs import Runner

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
    from lab.benchmarks.gpu import bench_serving

    with pytest.raises(SystemExit):
        bench_serving.main(["--out", "/tmp/x", "--model-dir", "/m", "--mode", "faults", *argv])
    assert message in capsys.readouterr().err


def test_a_lone_engine_gets_the_benchmarks_flags(tmp_path: Path, capsys: Any) -> None:
    """``fast_lane.sh kvcached033`` starts one ``vllm serve`` outside a benchmark: it gets the
    flags the benchmark's engines get (2026-12-06b: without them the engine stopped on the
    tokenizer, then on ``--hf-overrides`` quoted twice, before kvcached could say anything)."""
    import subprocess
    import sys
    import tempfile

    from kvshare_connector.demo.cpu_stack import model_dir
    from lab.benchmarks.gpu import bench_serving

    model = model_dir("gemma4_e2b_shape", tmp_path)
    argv = ["--engine-flags", "--model-dir", str(model), "--enforce-eager", "--kv-cache-gib", "2"]
    assert bench_serving.main(argv) == 0
    flags = capsys.readouterr().out.splitlines()
    assert flags[flags.index("--tokenizer") + 1].startswith(tempfile.gettempdir())
    assert json.loads(flags[flags.index("--hf-overrides") + 1]) == {"global_head_dim": 512}
    assert flags[flags.index("--attention-backend") + 1] == "TRITON_ATTN"
    assert "--enforce-eager" in flags
    assert flags[flags.index("--kv-cache-memory-bytes") + 1] == str(2 << 30)
    root = Path(bench_serving.__file__).resolve().parents[2]
    command = [sys.executable, "-m", "lab.benchmarks.gpu.bench_serving", *argv]
    printed = subprocess.run(
        command, capture_output=True, text=True, check=True, cwd=root, timeout=120
    )
    assert printed.stdout.splitlines() == flags
