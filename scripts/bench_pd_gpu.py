#!/usr/bin/env python3
"""Decode-side time of PD on one GPU: KVShareConnector vs vLLM's NixlConnector, with and
without kvcached, measured in one run, reported as ratios.

First batch = 4 prompts (40..900 tokens) right after startup, handshake and first READ
included; steady batch = the same shape later (median and range of 8). Cells run one at a
time so they do not disturb each other's timings. Colocated engines (prefill and decode in
one, no connector) under each kvcached mode time what kvcached costs by itself: the PD
ratios are read against theirs.

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


# Colocated engines (no PD) under each kvcached mode: what kvcached costs an engine by
# itself, to set against what it costs our PD decode.
COLOCATED = {"plain": None, "kvcached-per-layer": "per_layer", "kvcached-contiguous": "contiguous"}


def read_seconds(batch: dict, reads: list[dict]) -> list[float]:
    """Our connector's per-request READ times (its read_log) that fell in a batch."""
    start, end = batch.get("window", (0.0, -1.0))
    return [r["seconds"] for r in reads if start <= r["time"] <= end and r["bytes"]]


def _batch_times(batches: dict, reads: list[dict]) -> dict[str, float]:
    if "main" not in batches:
        return {"failed": 1.0}
    steady_batches = [batches[k] for k in batches if k.startswith("steady")]
    steady = [b["seconds"] for b in steady_batches]
    times = {
        "first": batches["main"]["seconds"],
        "steady": statistics.median(steady),
        "steady_min": min(steady),
        "steady_max": max(steady),
    }
    first_reads = read_seconds(batches["main"], reads)
    steady_reads = [s for b in steady_batches for s in read_seconds(b, reads)]
    if first_reads and steady_reads:
        times["first_read"] = max(first_reads)  # the batch waits for its slowest READ
        times["steady_read"] = statistics.median(steady_reads)
        times["reads"] = len(first_reads) + len(steady_reads)
    return times


def timings(out: Path) -> dict[str, dict[str, float]]:
    result = {}
    for path in out.glob("*/cell.json"):
        cell = json.loads(path.read_text())
        log = path.parent / "reads.jsonl"
        reads = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
        result[cell["cell"]] = _batch_times(cell.get("decode") or {}, reads)
    for path in out.glob("colocated__*/baseline.json"):
        result["colocated:g4tiny/" + path.parent.name.rsplit("__", 1)[1]] = _batch_times(
            json.loads(path.read_text()), []
        )
    return result


def run_colocated(out: Path, modes: dict[str, str | None], mem: float, timeout_s: float) -> None:
    for name, mode in modes.items():
        work = out / f"colocated__g4tiny__{name}"
        work.mkdir(parents=True, exist_ok=True)
        env = e2e.cell_env({"kvcached": mode})
        proc = e2e.spawn("baseline", work, work / "baseline.log", env, None, "g4tiny", 0, mem)
        rc = e2e.wait(proc, timeout_s)
        result_path = work / "baseline.result.json"
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
        (work / "baseline.json").write_text(json.dumps({"rc": rc, **result}))
        print("done: colocated", name, "rc", rc, flush=True)


def ratio(t: dict, a: str, b: str, key: str) -> str:
    if key not in t.get(a, {}) or key not in t.get(b, {}):
        return "n/a"
    return f"{t[a][key] / t[b][key]:.2f}x"


def report(out: Path) -> str:
    t = timings(out)
    lines = [
        "| cell | first batch s | steady batch s median [min-max] "
        "| READ ms: first batch slowest / steady median (reads) |",
        "|---|---|---|---|",
    ]
    for name in BENCH_CELLS + [f"colocated:g4tiny/{c}" for c in COLOCATED]:
        c = t.get(name)
        if c is None:
            continue
        if "failed" in c:
            lines.append(f"| {name} | failed | failed | - |")
            continue
        reads = (
            f"{c['first_read'] * 1e3:.1f} / {c['steady_read'] * 1e3:.1f} ({c['reads']:.0f})"
            if "first_read" in c
            else "-"
        )
        lines.append(
            f"| {name} | {c['first']:.3f} | {c['steady']:.3f} "
            f"[{c['steady_min']:.3f}-{c['steady_max']:.3f}] | {reads} |"
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
            "colocated kvcached contiguous / colocated plain (kvcached's own cost)",
            "colocated:g4tiny/kvcached-contiguous",
            "colocated:g4tiny/plain",
            "-",
        ),
        (
            "ours kvcached per-layer / ours plain",
            "g4tiny/kvcached-per-layer",
            "g4tiny/plain",
            "<= 1.2",
        ),
        ("ours plain / NixlConnector plain", "g4tiny/plain", "nixl:g4tiny/plain", "<= 1.0"),
        (
            "colocated kvcached per-layer / colocated plain",
            "colocated:g4tiny/kvcached-per-layer",
            "colocated:g4tiny/plain",
            "-",
        ),
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
    parser.add_argument(
        "--no-colocated", action="store_true", help="skip the colocated engines under kvcached"
    )
    args = parser.parse_args()
    if args.report:
        print(report(Path(args.report)))
        return
    out = Path(args.out)
    # On a fresh host the first engine compiles Triton's kernels (seconds, cached on disk
    # after): one colocated engine does that before anything is timed (out/warmup, not
    # reported); otherwise the first cell's first batch carries it (seen: 3.2 s vs 1.1 s).
    run_colocated(out / "warmup", {"plain": None}, 0.08, 300)
    if not args.no_colocated:
        run_colocated(out, COLOCATED, 0.08, 300)
    e2e.cmd_run(
        argparse.Namespace(
            out=str(out), cells=args.cells, parallel=1, mem=0.08, timeout=300, no_baseline=True
        )
    )
    print(report(out))


if __name__ == "__main__":
    main()
