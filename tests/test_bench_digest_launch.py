"""``lab/benchmarks/gpu/bench_digest_launch.py`` on the CPU: both modes run over the same blocks
and agree, and its control (one byte changed) is caught, so a GPU run measures real work."""

from __future__ import annotations

import json
import subprocess
import sys

from lab.benchmarks.gpu import bench_digest_launch as bench


def test_the_benchmark_runs_both_modes_on_the_cpu():
    out = subprocess.run(
        [sys.executable, "-m", "lab.benchmarks.gpu.bench_digest_launch", "--device", "cpu",
         "--rounds", "1", "--tokens", "1024", "--blocks", "128"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    result = json.loads(out)["1024"]
    assert set(result) == {"bytes_digested", "before", "after"}
    for mode in ("before", "after"):
        assert result[mode]["launch_ms"]["p50"] > 0 < result[mode]["ready_ms"]["p50"]
    # 64 full blocks x 3 layers x 32 KiB, and 12 sliding layers x the window's 33 blocks
    assert result["bytes_digested"] == 64 * 3 * 32768 + 12 * 33 * 16384


def test_sliding_layers_keep_the_window_and_null_the_rest():
    import numpy as np

    full, sliding = bench.request_blocks(1024, 128, np.random.default_rng(1))
    assert len(full) == len(sliding) == 64 and 0 not in full
    assert sliding[:31] == [0] * 31 and 0 not in sliding[31:]
