#!/usr/bin/env python3
"""Decode-side time of PD on one GPU: KVShareConnector vs vLLM's NixlConnector, with and
without kvcached, measured in one run, reported as ratios.

First batch = 4 prompts (40..900 tokens) right after startup, handshake and first READ
included; steady batch = the same shape later (median and range of 8). Cells run one at a
time so they do not disturb each other's timings. Colocated engines (prefill and decode in
one, no connector) under each kvcached mode time what kvcached costs by itself: the PD
ratios are read against theirs.

The first batch is one sample per cell and depends on what ran before it: the first PD cell
on a freshly installed host took 3.2-4.4 s where later ones took 1.1-1.7 s. So before
anything is timed, one colocated engine and, per connector among the cells, its first cell
run untimed (out/warmup); ``--rounds N`` then runs the cells N times, each round in a
rotated order, and reports the median over rounds and every round's first batch, with the
Triton kernels each run compiled (new entries in Triton's on-disk cache).

    python scripts/bench_pd_gpu.py --out OUT [--rounds N]   # a CUDA GPU with vLLM 0.26
    python scripts/bench_pd_gpu.py --report OUT             # tables from an earlier run
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
    """Per cell; with rounds (out/round*/), the median over rounds of each figure, and the
    first batch of every round in round order under ``first_rounds``."""
    result: dict[str, dict] = _timings_of_one_run(out)  # with rounds: the colocated ones
    rounds = sorted(out.glob("round*/"), key=lambda p: int(p.name[len("round") :]))
    per_round = [_timings_of_one_run(r) for r in rounds]
    for name in {n for t in per_round for n in t}:
        samples = [t[name] for t in per_round if name in t and "failed" not in t[name]]
        if not samples:
            result[name] = {"failed": 1.0}
            continue
        keys = set.intersection(*(set(s) for s in samples))
        result[name] = {k: statistics.median(s[k] for s in samples) for k in keys}
        result[name]["first_rounds"] = [s["first"] for s in samples]
        if all("kernels" in s for s in samples):
            result[name]["kernels_rounds"] = [s["kernels"] for s in samples]
    return result


def _timings_of_one_run(out: Path) -> dict[str, dict[str, float]]:
    result = {}
    for path in out.glob("*/cell.json"):
        cell = json.loads(path.read_text())
        log = path.parent / "reads.jsonl"
        reads = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
        result[cell["cell"]] = _with_kernels(_batch_times(cell.get("decode") or {}, reads), cell)
    for path in out.glob("colocated__*/baseline.json"):
        baseline = json.loads(path.read_text())
        result["colocated:g4tiny/" + path.parent.name.rsplit("__", 1)[1]] = _with_kernels(
            _batch_times(baseline, []), baseline
        )
    return result


def _with_kernels(times: dict[str, float], run: dict) -> dict[str, float]:
    """The Triton kernels the run compiled (runs from before this was recorded: none)."""
    if "failed" not in times and "triton_kernels_compiled" in run:
        times["kernels"] = run["triton_kernels_compiled"]
    return times


def run_colocated(out: Path, modes: dict[str, str | None], mem: float, timeout_s: float) -> None:
    for name, mode in modes.items():
        work = out / f"colocated__g4tiny__{name}"
        result = e2e.run_alone(work, e2e.cell_env({"kvcached": mode}), "g4tiny", mem, timeout_s)
        print(
            "done: colocated",
            name,
            "rc",
            result["rc"],
            "Triton kernels compiled",
            result["triton_kernels_compiled"],
            flush=True,
        )


def run_cells(out: Path, cells: list[str]) -> None:
    """PD cells one at a time (timings undisturbed), against no baseline of their own."""
    e2e.cmd_run(
        argparse.Namespace(
            out=str(out), cells=cells, parallel=1, mem=0.08, timeout=300, no_baseline=True
        )
    )


def warmup_cells(cells: list[str]) -> list[str]:
    """The first of the cells for each connector (ours, NixlConnector, ...)."""
    first: dict[str, str] = {}
    for name in cells:
        first.setdefault(e2e.CELLS[name].get("connector", "KVShareConnector"), name)
    return list(first.values())


def ratio(t: dict, a: str, b: str, key: str) -> str:
    if key not in t.get(a, {}) or key not in t.get(b, {}):
        return "n/a"
    return f"{t[a][key] / t[b][key]:.2f}x"


def report(out: Path) -> str:
    t = timings(out)
    lines = [
        "| cell | first batch s (each round) | steady batch s median [min-max] "
        "| READ ms: first batch slowest / steady median (reads) "
        "| Triton kernels compiled (each round) |",
        "|---|---|---|---|---|",
    ]
    for name in BENCH_CELLS + [f"colocated:g4tiny/{c}" for c in COLOCATED]:
        c = t.get(name)
        if c is None:
            continue
        if "failed" in c:
            lines.append(f"| {name} | failed | failed | - | - |")
            continue
        reads = (
            f"{c['first_read'] * 1e3:.1f} / {c['steady_read'] * 1e3:.1f} ({c['reads']:.0f})"
            if "first_read" in c
            else "-"
        )
        first = f"{c['first']:.3f}"
        if len(c.get("first_rounds", ())) > 1:
            first += " (" + ", ".join(f"{x:.2f}" for x in c["first_rounds"]) + ")"
        kernels = ", ".join(str(k) for k in c.get("kernels_rounds", [c.get("kernels", "-")]))
        lines.append(
            f"| {name} | {first} | {c['steady']:.3f} "
            f"[{c['steady_min']:.3f}-{c['steady_max']:.3f}] | {reads} | {kernels} |"
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
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the cells N times, each in a rotated order"
    )
    parser.add_argument(
        "--no-warmup", action="store_true", help="no untimed PD cell per connector first"
    )
    args = parser.parse_args()
    if args.report:
        print(report(Path(args.report)))
        return
    out = Path(args.out)
    # Host-level first-use costs (Triton's kernels compiled and cached on disk, ...) go to
    # untimed engines: a colocated one did not take away the first PD cell's slow first
    # batch (3.4 s after it), so one PD cell per connector runs untimed too.
    run_colocated(out / "warmup", {"plain": None}, 0.08, 300)
    if not args.no_warmup:
        run_cells(out / "warmup", warmup_cells(args.cells))
    if not args.no_colocated:
        run_colocated(out, COLOCATED, 0.08, 300)
    for i in range(args.rounds):
        order = args.cells[i % len(args.cells) :] + args.cells[: i % len(args.cells)]
        run_cells(out / f"round{i}" if args.rounds > 1 else out, order)
    print(report(out))


if __name__ == "__main__":
    main()
