"""serving_lanes reads UCX's protocol tables out of engine logs: checked on the real UCX logs
of the 2026-11-30 diagnosis (cudaMalloc memory took cuda_ipc; kvcached-style memory fell
back to software emulation over tcp)."""

from __future__ import annotations

import json
from pathlib import Path

from lab.benchmarks.gpu import serving_lanes

ROOT = Path(__file__).resolve().parents[1]

DIAG = ROOT / "tests" / "fixtures" / "gpu_runs" / "2026-11-30" / "raw" / "diag"


def _initiator_log(name: str, variant: str) -> str:
    data = json.loads((DIAG / f"{name}.json").read_text())
    return next(v for v in data["variants"] if v["name"] == variant)["logs"]["initiator"]


def test_lanes_of_real_ucx_logs() -> None:
    ipc = serving_lanes.gpu_reads(serving_lanes.lanes(_initiator_log("visibility", "default")))
    assert ipc and {lane.config for lane in ipc} == {"cuda_ipc/cuda"}
    assert all(lane.description == "zero-copy" for lane in ipc)
    assert ipc[0].endpoint.startswith("initiator") and "cfg#" in ipc[0].endpoint
    slow = serving_lanes.gpu_reads(
        serving_lanes.lanes(_initiator_log("memory", "vis=0,1/1,0+alloc=cumem"))
    )
    assert slow and {(lane.description, lane.config) for lane in slow} == {
        ("software emulation", "tcp/lo")
    }


def test_report_per_engine_with_vllm_prefixes(tmp_path: Path) -> None:
    """Engine logs as vllm serve writes them (a process prefix before UCX's own), read logs."""
    logs = tmp_path / "logs"
    for name, text in {
        "ours/decode0.log": _initiator_log("visibility", "default"),
        "nixl/decode0.log": _initiator_log("memory", "vis=0,1/1,0+alloc=cumem"),
    }.items():
        (logs / name).parent.mkdir(parents=True, exist_ok=True)
        prefixed = "\n".join(f"(EngineCore_DP0 pid=42) {line}" for line in text.splitlines())
        (logs / name).write_text(prefixed)
    (logs / "bench").mkdir()
    (logs / "bench" / "worker.log").write_text("| 0..inf | zero-copy | cuda_ipc/cuda |\n")
    (tmp_path / "reads").mkdir()
    rec = {"bytes": 18_874_368, "descriptors": 1, "seconds": 0.0472}
    (tmp_path / "reads" / "ours-decode0.jsonl").write_text(json.dumps(rec) + "\n")
    text = serving_lanes.report(tmp_path)
    ours, nixl = text.split("## ours/decode0.log")[1], text.split("## nixl/decode0.log")[1]
    assert "**cuda_ipc/cuda**" in ours.split("##")[0]
    assert "**tcp/lo**" in nixl.split("##")[0] and "software emulation" in nixl.split("##")[0]
    # The endpoint offered cuda_ipc; the read of that memory still could not use it.
    assert "device(cuda_ipc/cuda)" in nixl.split("##")[0]
    assert "bench/" not in text
    assert "GB/s min / median / max: 0.40 / 0.40 / 0.40" in text
