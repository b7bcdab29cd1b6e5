"""GPU end-to-end (skipped without CUDA): PD with KVShareConnector equals colocated vLLM.

Runs ``scripts/gpu_pd_e2e.py`` over the matrix (hybrid / single-group Gemma-4, kvcached
off / per-layer / contiguous, V2 model runner) and checks every cell: decode tokens equal
the colocated baseline's, and the negative control (remote block ids reversed) differs.
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


def test_pd_matrix_matches_colocated(tmp_path):
    out = Path(os.environ.get("KVSHARE_GPU_OUT", tmp_path))
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_pd_e2e.py"),
            "run",
            "--out",
            str(out),
            "--parallel",
            "3",
        ],
        check=True,
        cwd=ROOT,
        timeout=1800,
    )
    baselines = {}
    for path in out.glob("baseline__*/baseline.json"):
        b = json.loads(path.read_text())
        baselines[(b["model"], b["runner"])] = b
    cells = [json.loads(p.read_text()) for p in out.glob("*/cell.json")]
    assert len(cells) == 7
    for cell in cells:
        base = baselines[(cell["model"], cell.get("runner", "v1"))]
        decode = cell["decode"]
        assert decode["main"]["tokens"] == base["main"]["tokens"], cell["cell"]
        assert decode["corrupt"]["tokens"] != base["corrupt"]["tokens"], cell["cell"]
        assert any("sharing layer(s) not" in line for line in cell["decode_registration"])
