"""GPU (skipped without CUDA): shared-prefix loads byte for byte (issue 50).

Runs ``python -m lab.gpu_checks.kv_exact run --prefix --verify`` on the E2B-shaped cell: after the
main batch, prompts that start as its prompts load only what decode's prefix cache lacks (the
read log's tokens hit and loaded; fewer bytes than the main batch's loads of the same length)
and land byte for byte; their control, loaded with each group's block ids rotated, must
mismatch (``lab/gpu_checks/prefix_batches.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parents[2]


def test_shared_prefix_loads_read_past_the_hit_byte_for_byte(tmp_path):
    out = Path(os.environ.get("KVSHARE_GPU_OUT", tmp_path))
    gpus = "2" if torch.cuda.device_count() >= 2 else "1"
    run = subprocess.run(
        [sys.executable, "-m", "lab.gpu_checks.kv_exact", "run", "--out", str(out),
         "--cells", "e2b/plain", "--gpus", gpus, "--verify", "--prefix"],
        cwd=ROOT, timeout=1800, check=False,
    )  # fmt: skip
    (result,) = json.loads((out / "results.json").read_text())
    assert result["problems"] == [] and run.returncode == 0, result["problems"][:10]
    batches = {r["batch"] for r in result["requests"]}
    assert {"prefix", "prefix-control"} <= batches
