"""GPU end-to-end (skipped without CUDA): PD with KVShareConnector equals colocated vLLM.

Runs ``python -m lab.gpu_checks.gpu_pd_e2e`` over the matrix
(hybrid / single-group Gemma-4, kvcached off / per-layer / contiguous, V2 model runner) and
checks every cell: decode tokens equal
the colocated baseline's, and the negative control (remote block ids reversed) differs;
then the same for the LMCache backend's cells.
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


def _run(out: Path, *args: str) -> tuple[dict, list[dict]]:
    subprocess.run(
        [sys.executable, "-m", "lab.gpu_checks.gpu_pd_e2e", "run", "--out", str(out), *args],
        check=True,
        cwd=ROOT,
        timeout=1800,
    )
    baselines = {}
    for path in out.glob("baseline__*/baseline.json"):
        b = json.loads(path.read_text())
        baselines[(b["model"], b["runner"])] = b
    return baselines, [json.loads(p.read_text()) for p in out.glob("*/cell.json")]


def _check(cell: dict, baselines: dict) -> None:
    base = baselines[(cell["model"], cell.get("runner", "v1"))]
    decode = cell["decode"]
    batches = ["main"] + [b for b in decode if b.startswith("steady")]
    for batch in batches:  # the first batch (handshake) and every later one
        assert decode[batch]["tokens"] == base[batch]["tokens"], (cell["cell"], batch)
    assert decode["corrupt"]["tokens"] != base["corrupt"]["tokens"], cell["cell"]
    assert any("sharing layer(s) not" in line for line in cell["decode_registration"])


def test_pd_matrix_matches_colocated(tmp_path):
    out = Path(os.environ.get("KVSHARE_GPU_OUT", tmp_path))
    baselines, cells = _run(out, "--parallel", "3")
    assert len(cells) == 7
    for cell in cells:
        _check(cell, baselines)


def test_lmcache_backend_matches_colocated(tmp_path):
    """The LMCache backend through an lm:// server; the negative control skips the load."""
    pytest.importorskip("lmcache")
    out = Path(os.environ.get("KVSHARE_GPU_OUT", tmp_path)) / "lmcache"
    cells = ["lmcache:g4tiny/plain", "lmcache:g4uniform/cross-layer"]
    baselines, results = _run(out, "--parallel", "1", "--cells", *cells)
    assert sorted(c["cell"] for c in results) == cells
    for cell in results:
        _check(cell, baselines)
