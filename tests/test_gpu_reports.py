"""The GPU drivers' report side, on the raw results a GPU run committed (no GPU needed):
what the next lease's tables are computed from must keep parsing what the engines wrote."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RAW = ROOT / "results" / "gpu" / "2026-11-29b" / "raw"
sys.path.insert(0, str(ROOT / "scripts"))

import bench_pd_gpu  # noqa: E402
import gpu_pd_e2e  # noqa: E402


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
    assert gpu_pd_e2e.registration(nixl["decode_registration"]).startswith(
        "6 owners / 4 sharers skipped (1 region"
    )
    lmcache = json.loads((RAW / "lm" / "lmcache_g4tiny__plain" / "cell.json").read_text())
    assert gpu_pd_e2e.registration(lmcache["decode_registration"]) == (
        "6 owners handed to LMCache / 4 sharers not"
    )
    assert gpu_pd_e2e.registration(["an unrelated line"]) == "-"


def test_lmcache_hit_tokens_summed_from_its_log_lines():
    lines = [
        "INFO Reqid: 0-a, Total tokens 900, Inference Engine computed tokens: 0, "
        "LMCache hit tokens: 768, need to load: 768",
        "INFO Reqid: 1-b, Total tokens 40, Inference Engine computed tokens: 0, "
        "LMCache hit tokens: 0, need to load: 0",
    ]
    assert gpu_pd_e2e.lmcache_hits(lines) == "LMCache hit 768 of 940 prompt tokens"
    failed = json.loads((RAW / "lm2" / "lmcache-native_g4tiny__plain" / "cell.json").read_text())
    assert gpu_pd_e2e.lmcache_hits(failed["decode_lmcache_hits"]) == "no LMCache hit logged"
    table = gpu_pd_e2e.report([RAW / "lm", RAW / "lm2"])
    assert "| lmcache-native:g4tiny/plain | FAILED (rc 1/-9) |" in table
    assert "| lmcache:g4tiny/plain | 4/4 | 36/36 | 0/4 |" in table


def test_token_agreement_counts_every_batch():
    """LMCache's own connector on single-group Gemma-4 (sharing layers) and ours, each with
    an lm:// server of the same kind, one session: its prompts that load KV from LMCache
    decode differently, ours decode every batch like the colocated engine."""
    raw = ROOT / "results" / "gpu" / "2026-11-29c" / "raw"
    table = gpu_pd_e2e.report([raw / "lm2", raw / "lm3", raw / "lm4"])
    # 4 prompts x (first + 8 later batches); the 40-token prompt is shorter than LMCache's
    # 256-token chunk, so decode computes it itself: 9 of the 10 matches.
    assert "| lmcache-native:g4uniform/plain | 1/4 | 10/36 | n/a |" in table
    # Every prompt's KV loaded (its last partial chunk stored too): no prompt matches.
    assert "| lmcache-native:g4uniform/unfull-chunks | 0/4 | 0/36 | n/a |" in table
    assert "| lmcache:g4uniform/cross-layer | 4/4 | 36/36 | 0/4 |" in table
    cell = {"decode": {"main": {"tokens": [[1, 2], [3]]}}}
    assert gpu_pd_e2e.compare(cell, {"main": {"tokens": [[1, 2], [4]]}}, ["main"]) == "1/2"
    assert gpu_pd_e2e.compare(cell, None, ["main"]) == "n/a"
    assert gpu_pd_e2e.compare(cell, {"main": {"tokens": [[1, 2], [3]]}}, ["corrupt"]) == "n/a"


def test_bench_rounds_report_the_median_and_every_first_batch(tmp_path):
    """--rounds: cells of each round under out/round<i>/, colocated engines under out/."""
    later = ROOT / "results" / "gpu" / "2026-11-29c" / "raw" / "bench2"
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
    assert gpu_pd_e2e.triton_cache_entries() == 0  # no cache yet
    for key in ("a1", "b2", "c3"):  # Triton keeps one directory per compiled kernel
        (cache / key).mkdir(parents=True)
    assert gpu_pd_e2e.triton_cache_entries() == 3
