"""lab/benchmarks/gpu/serving_report.py: summary, ratios, READ columns and the curve from a
serving run's raw files (as bench_serving writes them, or its tarball)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lab.benchmarks.gpu import bench_serving as bs
from lab.benchmarks.gpu import serving_report as sr


def vllm_result(rps: float, ttft: float, itl: float, completed: int = 10) -> dict[str, Any]:
    """What vLLM 0.26's ``vllm bench serve --save-result`` writes (no --save-detailed)."""
    return {
        "date": "20261130-223216", "endpoint_type": "openai", "backend": "openai",
        "label": "x", "model_id": "kvshare-bench", "tokenizer_id": "/tmp/tok",
        "num_prompts": completed, "request_rate": "inf", "burstiness": 1.0,
        "max_concurrency": 4, "duration": completed / rps, "completed": completed,
        "failed": 0, "total_input_tokens": 640, "total_output_tokens": 80,
        "request_throughput": rps, "request_goodput": None, "output_throughput": rps * 8,
        "total_token_throughput": rps * 72, "max_output_tokens_per_s": 72.0,
        "max_concurrent_requests": 4, "rtfx": 0.0,
        "mean_ttft_ms": ttft * 1.1, "median_ttft_ms": ttft, "std_ttft_ms": 1.0,
        "p50_ttft_ms": ttft, "p90_ttft_ms": ttft * 1.5, "p99_ttft_ms": ttft * 2,
        "mean_tpot_ms": itl, "median_tpot_ms": itl, "std_tpot_ms": 0.1, "p50_tpot_ms": itl,
        "p90_tpot_ms": itl, "p99_tpot_ms": itl,
        "mean_itl_ms": itl, "median_itl_ms": itl, "std_itl_ms": 0.1, "p50_itl_ms": itl,
        "p90_itl_ms": itl * 1.2, "p99_itl_ms": itl * 3,
        "mean_e2el_ms": 100.0, "median_e2el_ms": 100.0, "std_e2el_ms": 1.0,
        "p50_e2el_ms": 100.0, "p90_e2el_ms": 110.0, "p99_e2el_ms": 120.0,
        "kvshare_deployment": "x", "kvshare_round": "0",
    }  # fmt: skip


def write_raw(out: Path, lengths: tuple[int, ...] = (64,)) -> None:
    """Two rounds of ours/nixl/colocated per length, a warmup, and our reads."""
    raw = out / sr.RAW
    (raw / "bench").mkdir(parents=True)
    (raw / "reads").mkdir()
    deployments = {
        "ours": {"kind": "ours", "read_log": "reads/ours.jsonl"},
        "nixl": {"kind": "nixl", "read_log": None},
        "colocated": {"kind": "colocated", "read_log": None},
    }
    (raw / "deployments.json").write_text(json.dumps(deployments))
    (raw / "meta.json").write_text(json.dumps({"model_dir": "/m", "rounds": 2}))
    runs, reads, t = [], [], 1000.0
    base = {"ours": (10.0, 50.0, 5.0), "nixl": (8.0, 60.0, 5.0), "colocated": (5.0, 40.0, 10.0)}
    # A warmup READ: must not count.
    runs.append({"deployment": "ours", "kind": "ours", "round": -1, "input_len": lengths[0],
                 "concurrency": 4, "file": "warmup/ours.json", "warmup": True,
                 "start": t, "end": t + 5, "rc": 0})  # fmt: skip
    reads.append({"time": t + 1, "request_id": "w", "bytes": 1, "descriptors": 999,
                  "blocks": 1, "seconds": 9.0})  # fmt: skip
    t += 10
    for length in lengths:
        for rnd in range(2):
            for name, (rps, ttft, itl) in base.items():
                file = f"bench/{name}_r{rnd}_in{length}_c4.json"
                scale = 1 + rnd * 0.5  # round 1 is 1.5x slower
                (raw / file).write_text(json.dumps(vllm_result(rps / scale, ttft * scale, itl)))
                runs.append({"deployment": name, "kind": name, "round": rnd, "input_len": length,
                             "output_len": 8, "concurrency": 4, "num_prompts": 10, "seed": rnd,
                             "file": file, "warmup": False, "start": t, "end": t + 5,
                             "rc": 0})  # fmt: skip
                if name == "ours":
                    for i in range(10):  # length MB in length*10 us: 100 GB/s
                        reads.append({"time": t + 1 + i * 0.1, "request_id": f"r{i}",
                                      "bytes": length * 1_000_000, "descriptors": 30 + i,
                                      "blocks": 4, "seconds": length * 1e-5})  # fmt: skip
                    reads.append({"time": t + 2, "request_id": "hit", "bytes": 0,
                                  "descriptors": 0, "blocks": 0, "seconds": 0.0})  # fmt: skip
                t += 10
    (raw / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))

    # Per engine its last snapshot counts for verify_kv (cumulative over its life); a run's
    # vLLM latency means are the delta of the snapshot after it and the one before.
    def snap(tag: str, n: float, ttft_s: float) -> dict[str, Any]:
        decode = {
            "up": True,
            "requests": n,
            "seconds": {"ttft": [ttft_s, n], "queue": [None, n]},
            "kvshare": {"verified_loads_total": n, "verify_failures_total": n // 10},
        }
        return {"deployment": "ours", "tag": tag, "engines": {
            "ours-prefill0": {"up": True, "requests": 0.0, "kvshare": {"holds_total": n}},
            "ours-decode0": decode}}  # fmt: skip

    snaps, n, ttft_s = [snap("after-warmup", 4.0, 0.4)], 4.0, 0.4
    for run in runs:
        if run["deployment"] == "ours" and not run["warmup"]:
            n, ttft_s = n + 20, ttft_s + 20 * 0.05 * (1 + run["round"])  # 50 ms, then 100
            snaps.append(snap(f"run:{run['file']}", n, ttft_s))
    snaps[-1]["engines"]["ours-decode0"]["kvshare"]["verify_failures_total"] = 4.0
    snaps.append({"deployment": "nixl", "tag": "end", "engines": {"nixl-decode0": {"up": False}}})
    (raw / "engine_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in snaps))
    (raw / "reads" / "ours.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reads) + "{cut")
    # Our proxy's lines (first token from prefill, or the classic legs), as it logs them.
    line = "2026-12-05 10:00:00,000 INFO kvshare_connector.toolkit.proxy: req=r{} /v1/completions"
    handed = line + " prefill=p decode=d: prefill 9.0 ms, first token from prefill; prompt as 3"
    classic = line + " prefill=p decode=d stream=True: prefill 9.0 ms, decode stream opened 2.0 ms"
    for name, lines in (("ours", [handed] * 3 + [classic]), ("nixl", [classic] * 2)):
        (raw / "logs" / name).mkdir(parents=True)
        text = "\n".join(x.format(i) for i, x in enumerate(lines))
        (raw / "logs" / name / "proxy.log").write_text(text + "\nINFO: Started server\n")


def test_report_from_tarball(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_raw(out)
    sr.pack(out, keep=False)
    assert not (out / sr.RAW).exists() and (out / sr.TARBALL).exists()
    summary = sr.write_report(out)
    (point,) = summary["points"]
    assert (point["input_len"], point["concurrency"]) == (64, 4)
    ours = point["deployments"]["ours"]
    assert ours["rounds"] == ours["ok_rounds"] == 2
    assert ours["request_throughput"] == {"median": 8.333333333333334 * 1.0, "min": 10 / 1.5,
                                          "max": 10.0, "n": 2}  # fmt: skip
    assert ours["median_ttft_ms"]["median"] == pytest.approx(62.5)
    assert ours["p99_itl_ms"]["median"] == pytest.approx(15.0)
    assert ours["read_gbps"]["median"] == pytest.approx(100.0)
    assert ours["read_p50_ms"]["median"] == pytest.approx(0.64)
    assert ours["descriptors_per_read"]["median"] == pytest.approx(34.5)
    assert ours["reads_per_request"]["median"] == pytest.approx(1.0)
    assert point["deployments"]["nixl"]["read_gbps"] is None
    ratios = point["ratios"]["ours"]
    assert ratios["/nixl"]["request_throughput"] == pytest.approx(10 / 8)
    assert ratios["/colocated"]["median_ttft_ms"] == pytest.approx(50 / 40)
    text = (out / "summary.md").read_text()
    assert "| ours | 8.3 (6.7-10.0) |" in text and "ours/nixl" in text and "ours/colocated" in text
    results = json.loads((out / "results.json").read_text())
    assert len(results["runs"]) == 6 and results["points"][0]["input_len"] == 64
    assert not (out / "scaling.png").exists()  # one point: no curve
    assert summary["verify_kv"] == {"ours": {"verified": 44.0, "failures": 4.0}}
    (cell,) = ours["engine_ms"].items()  # the queue's sum is missing: left out
    assert cell[0] == "ours-decode0 ttft" and cell[1]["n"] == 2
    assert [cell[1][k] for k in ("median", "min", "max")] == pytest.approx([75.0, 50.0, 100.0])
    assert "- ours: ours-decode0 ttft 75.0 (50.0-100.0)" in text
    assert "- ours: 44 loads verified, 4 refused" in text
    assert summary["first_tokens"] == {"ours": {"from_prefill": 3, "requests": 4},
                                       "nixl": {"from_prefill": 0, "requests": 2}}  # fmt: skip
    assert "First token from prefill (our proxy's log, warmup included): nixl 0/2, ours 3/4" in text


def test_report_scaling_plot_and_failed_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_raw(out, lengths=(64, 128))
    (out / sr.RAW / "bench" / "nixl_r1_in128_c4.json").unlink()  # a run that left no result
    summary = sr.write_report(out)
    nixl = summary["points"][1]["deployments"]["nixl"]
    assert (nixl["rounds"], nixl["ok_rounds"]) == (2, 1)
    assert "| nixl (1/2 ok) |" in (out / "summary.md").read_text()
    assert (out / "scaling.png").stat().st_size > 10_000
    assert bs.main(["--report", str(out)]) == 0  # the CLI's report mode, raw dir still there


# ---- one whole run, fake servers, the real proxy --------------------------------------------
