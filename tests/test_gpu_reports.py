"""The GPU drivers' report side, on raw results GPU runs wrote (tests/fixtures/gpu_runs):
what the next lease's tables are computed from must keep parsing what the engines wrote."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab.benchmarks.gpu import bench_pd_gpu
from lab.gpu_checks import gpu_pd_e2e_report as e2e_report
from lab.gpu_checks import processes as driver_processes

ROOT = Path(__file__).resolve().parent.parent
RAW = ROOT / "tests" / "fixtures" / "gpu_runs" / "2026-11-29b" / "raw"


def test_reads_are_attributed_to_their_batches():
    timings = bench_pd_gpu.timings(RAW / "bench")
    for cell in ("g4tiny/plain", "g4tiny/kvcached-contiguous", "g4tiny/kvcached-per-layer"):
        log = RAW / "bench" / cell.replace("/", "__") / "reads.jsonl"
        logged = len(log.read_text().splitlines())
        # 4 prompts x (first + 8 steady) batches; the negative-control batch's 4 reads fall
        # outside those windows and must not be counted.
        assert logged == 40 and timings[cell]["reads"] == 36, cell
        assert 0 < timings[cell]["steady_read"] < timings[cell]["steady"]
    assert "reads" not in timings["nixl:g4tiny/plain"]  # vLLM's connector keeps no read_log
    assert timings["nixl:g4tiny/kvcached-contiguous"] == {"failed": 1.0}


def test_registration_lines_of_both_backends():
    nixl = json.loads((RAW / "bench" / "g4tiny__plain" / "cell.json").read_text())
    assert e2e_report.registration(nixl["decode_registration"]).startswith(
        "6 owners / 4 sharers skipped (1 region"
    )
    lmcache = json.loads((RAW / "lm" / "lmcache_g4tiny__plain" / "cell.json").read_text())
    assert e2e_report.registration(lmcache["decode_registration"]) == (
        "6 owners handed to LMCache / 4 sharers not"
    )
    assert e2e_report.registration(["an unrelated line"]) == "-"
    # The line since the backends split: the seconds follow the brackets.
    line = (
        "KVShareConnector e (kv_consumer, per_layer layout, backend NixlWorker): registered 6 "
        "owner layer(s) in 1 region(s) (12.0 MiB) in 0.41 s from 10 tensor(s) handed over; "
        "4 sharing layer(s) not registered"
    )
    assert e2e_report.registration([line]) == "6 owners / 4 sharers skipped (1 region, 0.41 s)"


def test_lmcache_hit_tokens_summed_from_its_log_lines():
    lines = [
        "INFO Reqid: 0-a, Total tokens 900, Inference Engine computed tokens: 0, "
        "LMCache hit tokens: 768, need to load: 768",
        "INFO Reqid: 1-b, Total tokens 40, Inference Engine computed tokens: 0, "
        "LMCache hit tokens: 0, need to load: 0",
    ]
    assert e2e_report.lmcache_hits(lines) == "LMCache hit 768 of 940 prompt tokens"
    failed = json.loads((RAW / "lm2" / "lmcache-native_g4tiny__plain" / "cell.json").read_text())
    assert e2e_report.lmcache_hits(failed["decode_lmcache_hits"]) == "no LMCache hit logged"
    table = e2e_report.report([RAW / "lm", RAW / "lm2"])
    assert "| lmcache-native:g4tiny/plain | FAILED (rc 1/-9) |" in table
    assert "| lmcache:g4tiny/plain | 4/4 | 36/36 | 0/4 |" in table


def test_token_agreement_counts_every_batch():
    """LMCache's own connector on single-group Gemma-4 (sharing layers) and ours, each with
    an lm:// server of the same kind, one session: its prompts that load KV from LMCache
    decode differently, ours decode every batch like the colocated engine."""
    raw = ROOT / "tests" / "fixtures" / "gpu_runs" / "2026-11-29c" / "raw"
    table = e2e_report.report([raw / "lm2", raw / "lm3", raw / "lm4"])
    # 4 prompts x (first + 8 later batches); the 40-token prompt is shorter than LMCache's
    # 256-token chunk, so decode computes it itself: 9 of the 10 matches.
    assert "| lmcache-native:g4uniform/plain | 1/4 | 10/36 | n/a |" in table
    # Every prompt's KV loaded (its last partial chunk stored too): no prompt matches.
    assert "| lmcache-native:g4uniform/unfull-chunks | 0/4 | 0/36 | n/a |" in table
    assert "| lmcache:g4uniform/cross-layer | 4/4 | 36/36 | 0/4 |" in table
    cell = {"decode": {"main": {"tokens": [[1, 2], [3]]}}}
    assert e2e_report.compare(cell, {"main": {"tokens": [[1, 2], [4]]}}, ["main"]) == "1/2"
    assert e2e_report.compare(cell, None, ["main"]) == "n/a"
    assert e2e_report.compare(cell, {"main": {"tokens": [[1, 2], [3]]}}, ["corrupt"]) == "n/a"


def test_bench_rounds_report_the_median_and_every_first_batch(tmp_path):
    """--rounds: cells of each round under out/round<i>/, colocated engines under out/."""
    later = ROOT / "tests" / "fixtures" / "gpu_runs" / "2026-11-29c" / "raw" / "bench2"
    (tmp_path / "round0").symlink_to(RAW / "bench")  # two earlier runs as two rounds
    (tmp_path / "round1").symlink_to(later)
    colocated = "colocated__g4tiny__kvcached-per-layer"
    (tmp_path / colocated).symlink_to(RAW / "colocated" / colocated)
    t = bench_pd_gpu.timings(tmp_path)
    first = [bench_pd_gpu.timings(r)["nixl:g4tiny/plain"]["first"] for r in (RAW / "bench", later)]
    nixl = t["nixl:g4tiny/plain"]
    assert nixl["first_rounds"] == first and nixl["first"] == sum(first) / 2
    only_once = bench_pd_gpu.timings(RAW / "bench")["g4tiny/plain"]["first"]
    assert t["g4tiny/plain"]["first_rounds"] == [only_once]
    assert t["nixl:g4tiny/kvcached-contiguous"] == {"failed": 1.0}  # failed in its one round
    assert "colocated:g4tiny/kvcached-per-layer" in t
    table = bench_pd_gpu.report(tmp_path)
    assert f"| nixl:g4tiny/plain | {nixl['first']:.3f} ({first[0]:.2f}, {first[1]:.2f}) |" in table


def test_bench_warms_up_one_cell_per_connector():
    cells = ["g4tiny/kvcached-contiguous", "nixl:g4tiny/plain", "g4tiny/plain"]
    assert bench_pd_gpu.warmup_cells(cells) == ["g4tiny/kvcached-contiguous", "nixl:g4tiny/plain"]
    assert bench_pd_gpu.warmup_cells(bench_pd_gpu.BENCH_CELLS) == [
        "g4tiny/plain",
        "nixl:g4tiny/plain",
    ]


def test_bench_reports_the_triton_kernels_each_run_compiled(tmp_path, monkeypatch):
    """Runs record how many kernels they added to Triton's cache; runs from before that
    was recorded show '-'."""
    cell = json.loads((RAW / "bench" / "nixl_g4tiny__plain" / "cell.json").read_text())
    for i, compiled in enumerate((12, 0)):
        work = tmp_path / f"round{i}" / "nixl_g4tiny__plain"
        work.mkdir(parents=True)
        (work / "cell.json").write_text(json.dumps({**cell, "triton_kernels_compiled": compiled}))
    assert bench_pd_gpu.timings(tmp_path)["nixl:g4tiny/plain"]["kernels_rounds"] == [12, 0]
    assert "| 12, 0 |" in bench_pd_gpu.report(tmp_path)
    old = bench_pd_gpu.report(RAW / "bench")
    assert "| nixl:g4tiny/plain | 1.241 |" in old and old.splitlines()[2].endswith("| - |")
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    assert driver_processes.triton_cache_entries() == 0  # no cache yet
    for key in ("a1", "b2", "c3"):  # Triton keeps one directory per compiled kernel
        (cache / key).mkdir(parents=True)
    assert driver_processes.triton_cache_entries() == 3


FOURTH = ROOT / "tests" / "fixtures" / "gpu_runs" / "2026-11-29d" / "raw"


def test_bench_leaves_out_rounds_that_compiled_triton_kernels():
    """Fourth lease, fresh host: NixlConnector's first PD engine compiled 13 Triton kernels
    and took 4.61 s for its first batch; the round after, nothing compiled, 1.94 s."""
    nixl = bench_pd_gpu.timings(FOURTH / "a")["nixl:g4tiny/plain"]
    assert nixl["kernels_rounds"] == [13, 0]
    assert nixl["cold_rounds"] == [True, False] and nixl["first_rounds"][0] > 4
    assert nixl["first"] == nixl["first_rounds"][1]  # the median of the warm round alone
    assert len(nixl["steady_rounds"]) == 1  # the cold round's steady batches left out too
    assert "(4.61*, 1.94)" in bench_pd_gpu.report(FOURTH / "a")
    ours = bench_pd_gpu.timings(FOURTH / "a")["g4tiny/plain"]
    assert ours["cold_rounds"] == [False, False] and [len(r) for r in ours["steady_rounds"]] == [
        8,
        8,
    ]


def test_bench_pools_the_steady_batches_of_several_runs():
    runs = [FOURTH / r for r in "abcd"]
    t = bench_pd_gpu.timings(*runs)
    # 8 rounds of ours (2 + 2 + 1 + 3), 7 warm of NixlConnector's, 8 steady batches each
    assert len(t["g4tiny/plain"]["steady_rounds"]) == 8
    assert len(t["nixl:g4tiny/plain"]["steady_rounds"]) == 7
    pooled = bench_pd_gpu.pooled_steady_ratio(t, "g4tiny/plain", "nixl:g4tiny/plain")
    m = re.fullmatch(r"([\d.]+)x \[([\d.]+)-([\d.]+)\] \(8 / 7 rounds\)", pooled)
    assert m and float(m[2]) <= float(m[1]) <= float(m[3]), pooled
    ours, nixl = (
        statistics.median(bench_pd_gpu.all_batches(t[c]["steady_rounds"]))
        for c in ("g4tiny/plain", "nixl:g4tiny/plain")
    )
    assert m[1] == f"{ours / nixl:.2f}"
    assert bench_pd_gpu.pooled_steady_ratio(t, "g4tiny/plain", "no/such-cell") == "n/a"
    table = bench_pd_gpu.report(*runs)
    assert f"| ours plain / NixlConnector plain | 0.83x | 1.00x | {pooled} | <= 1.0 |" in table
    # every round side by side, the one that compiled kernels starred
    assert "| a/round0* | 1.142 / 0.499 | 4.610 / 0.508 | 0.25x / 0.98x |" in table
    assert "| d/round2 | 1.631 / 0.668 | 1.847 / 0.604 | 0.88x / 1.11x |" in table


def test_a_cell_whose_engine_failed_is_reported_failed():
    """Fourth lease: the LMCache cell rerun into the directory of a finished run found that
    run's `stop` file, its prefill engine ended at once and decode failed (rc 1); the
    results left there from the earlier run must not read as this one's."""
    failed = e2e_report.report([FOURTH / "lm"])
    assert "| lmcache:g4uniform/cross-layer | FAILED (rc 0/1) | n/a | n/a | n/a | n/a |" in failed
    earlier = e2e_report.report([FOURTH / "lm", FOURTH / "lm2"])  # the earlier run: rc 0/0
    assert "| lmcache:g4uniform/cross-layer | 4/4 | 36/36 | 0/4 |" in earlier
    assert bench_pd_gpu._timings_of_one_run(FOURTH / "lm")["lmcache:g4uniform/cross-layer"] == {
        "failed": 1.0
    }


def test_a_rerun_starts_from_a_work_dir_without_earlier_outputs(tmp_path):
    work = tmp_path / "g4tiny__plain"
    (work / "g4tiny").mkdir(parents=True)
    (work / "g4tiny" / "config.json").write_text("{}")
    for name in driver_processes.RUN_OUTPUTS:
        (work / name).write_text("from an earlier run")
    driver_processes.fresh_work_dir(work)
    assert sorted(p.name for p in work.iterdir()) == ["g4tiny"]
    assert (work / "g4tiny" / "config.json").exists()


def test_a_stopped_driver_takes_its_engines_with_it():
    """Engines run in their own sessions; what the driver started goes when it stops, child
    processes included, so no engine keeps GPU memory into the next command."""
    proc = driver_processes.started(
        subprocess.Popen(
            ["bash", "-c", "sleep 60 & echo $! ; wait"],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    )
    grandchild = int(proc.stdout.readline())
    driver_processes.stop_started_processes()
    assert proc.poll() == -9 and not driver_processes._STARTED
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(grandchild):
        time.sleep(0.05)
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = (
        Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}").exists() else "X"
    )
    return state != "Z"


def test_sigterm_to_the_driver_stops_its_engines():
    """`timeout` stops a driver with SIGTERM: the engines it started go with it."""
    driver = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, time;"
            "import lab.gpu_checks.processes as e;"
            "e.stop_with_the_driver();"
            "p = e.started(subprocess.Popen(['sleep', '60'], start_new_session=True));"
            "print(p.pid, flush=True); time.sleep(60)",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    engine = int(driver.stdout.readline())
    driver.terminate()
    assert driver.wait(timeout=10) == 128 + 15
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(engine):
        time.sleep(0.05)
    assert not _alive(engine)


def test_one_round_gives_no_interval():
    """One run of each cell: batches of one round move together, so no interval is given
    (batches resampled as if independent gave 1.47x [1.13-1.70] for run c, which the other
    seven rounds contradict)."""
    t = bench_pd_gpu.timings(FOURTH / "c")
    assert bench_pd_gpu.pooled_steady_ratio(t, "g4tiny/plain", "nixl:g4tiny/plain") == (
        "1.47x, too few rounds for an interval (1 / 1 rounds)"
    )


def test_read_timeline_splits_the_claim_into_prefills_share_and_the_rest():
    from lab.benchmarks.gpu import read_timeline

    records = [{"bytes": 1 << 20, "prefill_held_s": 0.05, "prefill_answer_s": 0.001 * i,
                "claims": 1 + (i == 3),
                "timeline": {"asked": 0.001, "claimed": 0.02 + 0.01 * i, "posted": 0.03 + 0.01 * i,
                             "reported": 0.05 + 0.01 * i}}
               for i in range(4)] + [{"bytes": 0, "timeline": {}}]  # fmt: skip
    rows = dict(read_timeline.rows(records))
    assert rows["asked -> claimed"] == pytest.approx([19.0, 29.0, 39.0, 49.0])
    assert rows["prefill answering the claim"] == pytest.approx([0.0, 1.0, 2.0, 3.0])
    assert rows["claims per read (count, not ms)"] == [1.0, 1.0, 1.0, 2.0]
    assert "| asked -> claimed | 4 |" in read_timeline.table(records)
    old = [{k: v for k, v in r.items() if k not in ("prefill_answer_s", "claims")}
           for r in records]  # a read log from before: no such rows  # fmt: skip
    assert "prefill answering the claim" not in dict(read_timeline.rows(old))
    records[0]["landing_host"] = {"release": 0.0001, "scatter": 0.0004, "digests": 0.001}
    records[1]["landing_host"] = {"digests": 0.002}  # an unpacked verified read
    rows = dict(read_timeline.rows(records))
    assert rows["landing on the host: scatter"] == pytest.approx([0.4])
    assert rows["landing on the host: digests"] == pytest.approx([1.0, 2.0])
    assert "landing on the host: release" not in dict(read_timeline.rows(old))


def test_read_timeline_gives_the_effective_rate_and_a_line_per_run(tmp_path, capsys):
    """Issue 21's effective rate: bytes over posted -> landed; runs cut at quiet gaps."""
    from lab.benchmarks.gpu import read_timeline

    def read(t: float, landed_ms: float, prepared: bool = False) -> dict:
        timeline = {"posted": 0.010, "arrived": 0.0105, "landed": 0.010 + landed_ms / 1e3}
        if prepared:  # logs since 2026-12-06f: the post's start, 0.2 ms before its return
            timeline["prepared"] = 0.0098
        return {"time": t, "bytes": 20_000_000, "timeline": timeline}

    records = [read(100.0, 1.0), read(100.5, 2.0), read(110.0, 0.1, True),
               read(110.2, 0.2, True), read(110.4, 0.4, True),
               {"bytes": 0, "timeline": {}}]  # fmt: skip
    rows = dict(read_timeline.rows(records))
    rates = rows["posted -> landed, effective GB/s (not ms)"]
    assert rates == pytest.approx([20.0, 10.0, 200.0, 100.0, 50.0])
    whole = rows["prepared -> landed (from the post's start), effective GB/s (not ms)"]
    assert whole == pytest.approx([200 / 3, 50.0, 100 / 3])  # only reads that have it
    runs = read_timeline.split_runs(records, gap_s=5.0)
    assert [len(r) for r in runs] == [2, 3]
    lines = read_timeline.runs_table(records, gap_s=5.0).splitlines()
    assert lines[2] == "| 0 | 2 | 20.0 | 0.50 | 1.50 | 15.0 | 20.0 | nan |"  # older logs
    assert lines[3] == "| 1 | 3 | 20.0 | 0.50 | 0.20 | 100.0 | 200.0 | 50.0 |"
    log = tmp_path / "decode0.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert read_timeline.main([str(log), "--runs", "5"]) == 0
    printed = capsys.readouterr().out
    assert "| posted -> landed, effective GB/s (not ms) | 5 |" in printed
    assert lines[3] in printed.splitlines()


def test_curve_table_joins_the_runs_of_each_prompt_length(tmp_path):
    """issue 21's curve across calls: every point of every run, ratios against the
    NixlConnector and colocated engine of the same run, rounds left out named."""
    from lab.benchmarks.gpu import curve_table

    res = ROOT / "tests" / "fixtures" / "gpu_runs"
    runs = [res / "2026-12-03d" / "raw" / "curve1024_results.json",
            res / "2026-12-04" / "raw" / "curve16384_results.json",
            res / "2026-12-04" / "raw" / "curve32768_results.json"]  # fmt: skip
    md, png = tmp_path / "curve.md", tmp_path / "curve.png"
    assert curve_table.main([*map(str, runs), "--md", str(md), "--png", str(png)]) == 0
    rows = [line.split(" | ") for line in md.read_text().splitlines() if line.startswith("| 1")]
    by = {(r[0].lstrip("| "), r[1]): r for r in rows}
    assert len(rows) == 4 * 3 + 4 * 2 + 1  # 1k: 3 points, 16k: 2 points of 4 and ours-packed x 64
    packed = by[("1k x 16", "ours-packed")]
    assert packed[2] == "3" and packed[3] == "523 (482-616)"
    assert packed[7:10] == ["1.01", "0.97", "1.01"] and packed[10].rstrip(" |") == "3.49"
    assert by[("16k x 64", "ours-packed")][7] == "-"  # no NixlConnector run at that point
    assert "32k x 64: colocated, nixl, ours-direct, ours-packed" in md.read_text()
    assert png.stat().st_size > 10_000
