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
    assert "| lmcache:g4tiny/plain | 4/4 | 0.00e+00 | 0/4 |" in table
