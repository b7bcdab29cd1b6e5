#!/usr/bin/env python3
"""Decode-side time of PD on one GPU: KVShareConnector vs vLLM's NixlConnector, with and
without kvcached, measured in one run, reported as ratios.

First batch = 4 prompts (40..900 tokens) right after startup, handshake and first READ
included; steady batch = the same shape later (median and range of 3). Cells run one at a
time so they do not disturb each other's timings.

    python scripts/bench_pd_gpu.py --out OUT        # needs a CUDA GPU with vLLM 0.26
    python scripts/bench_pd_gpu.py --report OUT     # tables from an earlier run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_pd_e2e as e2e

BENCH_CELLS = [
    "g4tiny/plain",
    "g4tiny/kvcached-contiguous",
    "g4tiny/kvcached-per-layer",
    "nixl:g4tiny/plain",
    "nixl:g4tiny/kvcached-per-layer",
    "nixl:g4tiny/kvcached-contiguous",
]


def timings(out: Path) -> dict[str, dict[str, float]]:
    result = {}
    for path in out.glob("*/cell.json"):
        cell = json.loads(path.read_text())
        decode = cell.get("decode") or {}
        if "main" not in decode:
            result[cell["cell"]] = {"failed": 1.0}
            continue
        steady = [decode[k]["seconds"] for k in decode if k.startswith("steady")]
        result[cell["cell"]] = {
            "first": decode["main"]["seconds"],
            "steady": statistics.median(steady),
            "steady_min": min(steady),
            "steady_max": max(steady),
        }
    return result


def ratio(t: dict, a: str, b: str, key: str) -> str:
    if key not in t.get(a, {}) or key not in t.get(b, {}):
        return "n/a"
    return f"{t[a][key] / t[b][key]:.2f}x"


def report(out: Path) -> str:
    t = timings(out)
    lines = ["| cell | first batch s | steady batch s median [min-max] |", "|---|---|---|"]
    for name in BENCH_CELLS:
        c = t.get(name)
        if c is None:
            continue
        if "failed" in c:
            lines.append(f"| {name} | failed | failed |")
            continue
        lines.append(
            f"| {name} | {c['first']:.3f} | {c['steady']:.3f} "
            f"[{c['steady_min']:.3f}-{c['steady_max']:.3f}] |"
        )
    lines += ["", "| ratio | first batch | steady batch | target |", "|---|---|---|---|"]
    pairs = [
        (
            "ours kvcached contiguous / ours plain",
            "g4tiny/kvcached-contiguous",
            "g4tiny/plain",
            "<= 1.2",
        ),
        (
            "ours kvcached per-layer / ours plain",
            "g4tiny/kvcached-per-layer",
            "g4tiny/plain",
            "<= 1.2",
        ),
        ("ours plain / NixlConnector plain", "g4tiny/plain", "nixl:g4tiny/plain", "<= 1.0"),
        (
            "NixlConnector kvcached per-layer / NixlConnector plain",
            "nixl:g4tiny/kvcached-per-layer",
            "nixl:g4tiny/plain",
            "reference",
        ),
        (
            "ours kvcached per-layer / NixlConnector kvcached per-layer",
            "g4tiny/kvcached-per-layer",
            "nixl:g4tiny/kvcached-per-layer",
            "-",
        ),
    ]
    for label, a, b, target in pairs:
        lines.append(
            f"| {label} | {ratio(t, a, b, 'first')} | {ratio(t, a, b, 'steady')} | {target} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--report")
    parser.add_argument("--cells", nargs="*", default=BENCH_CELLS)
    args = parser.parse_args()
    if args.report:
        print(report(Path(args.report)))
        return
    out = Path(args.out)
    e2e.cmd_run(
        argparse.Namespace(
            out=str(out), cells=args.cells, parallel=1, mem=0.08, timeout=300, no_baseline=True
        )
    )
    print(report(out))


if __name__ == "__main__":
    main()
