#!/usr/bin/env python3
"""Decode-side time of PD on one GPU: KVShareConnector vs vLLM's NixlConnector, with and
without kvcached, measured in one run, reported as ratios.

First batch = 4 prompts (40..900 tokens) right after startup, handshake and first READ
included; steady batch = the same shape later (median and range of 8). Cells run one at a
time so they do not disturb each other's timings. Colocated engines (prefill and decode in
one, no connector) under each kvcached mode time what kvcached costs by itself: the PD
ratios are read against theirs.

The first batch is one sample per cell and depends on what ran before it: the first PD
engine pair on a freshly installed host compiles Triton kernels (13 on the H200, whichever
connector: NixlConnector 4.6 s, ours 3.2-4.4 s, against 1.1-1.9 s later). So before
anything is timed, one colocated engine and, per connector among the cells, its first cell
run untimed (out/warmup); ``--rounds N`` then runs the cells N times, each round in a
rotated order, and reports the median over rounds, every round's first batch, the Triton
kernels each run compiled (new entries in Triton's on-disk cache), and the steady ratio
with an interval over rounds: rounds of the same cells differ by up to 1.5x on one host.

    python -m lab.benchmarks.gpu.bench_pd_gpu --out OUT [--rounds N]   # a CUDA GPU with vLLM 0.26
    python -m lab.benchmarks.gpu.bench_pd_gpu --report OUT [OUT ...]  # earlier runs pooled
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from lab.gpu_checks import gpu_pd_e2e as e2e
from lab.gpu_checks.cells import cell_env
from lab.gpu_checks.gpu_pd_e2e_report import cell_succeeded
from lab.gpu_checks.processes import stop_with_the_driver

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
        "steady_batches": steady,
    }
    first_reads = read_seconds(batches["main"], reads)
    steady_reads = [s for b in steady_batches for s in read_seconds(b, reads)]
    if first_reads and steady_reads:
        times["first_read"] = max(first_reads)  # the batch waits for its slowest READ
        times["steady_read"] = statistics.median(steady_reads)
        times["reads"] = len(first_reads) + len(steady_reads)
    return times


def timings(*outs: Path) -> dict[str, dict]:
    """Per cell over every round of every run given (a run's rounds are out/round*/, or the
    run is one round): the median over rounds of each figure, every round's first batch in
    order under ``first_rounds``. A round whose engines compiled Triton kernels paid a
    host's first-use cost (the first PD engine on a fresh host: 4.6 s for NixlConnector, 3.2-4.4 s
    for ours) that says nothing of the connector: it is flagged in ``cold_rounds`` and left
    out of the medians, unless every round of the cell was such a round."""
    return _aggregate([t for _, t in each_round(outs)])


def each_round(outs: tuple[Path, ...]) -> list[tuple[str, dict[str, dict]]]:
    """(label, timings) of every round of every run, in order: a run's top level (its
    colocated engines, or its cells when it has no rounds), then its out/round*/."""
    found = []
    for out in outs:
        rounds = sorted(out.glob("round*/"), key=lambda p: int(p.name[len("round") :]))
        found += [(str(r.relative_to(out.parent)), _timings_of_one_run(r)) for r in [out, *rounds]]
    return found


def _aggregate(per_round: list[dict[str, dict]]) -> dict[str, dict]:
    result: dict[str, dict] = {}
    for name in sorted({n for t in per_round for n in t}):
        samples = [t[name] for t in per_round if name in t and "failed" not in t[name]]
        if not samples:
            result[name] = {"failed": 1.0}
            continue
        warm = [s for s in samples if not s.get("kernels")]
        used = warm or samples
        keys = set.intersection(*(set(s) for s in used)) - {"steady_batches"}
        result[name] = {k: statistics.median(s[k] for s in used) for k in keys}
        result[name]["steady_rounds"] = [s["steady_batches"] for s in used]
        result[name]["first_rounds"] = [s["first"] for s in samples]
        result[name]["cold_rounds"] = [bool(warm) and s not in warm for s in samples]
        if all("kernels" in s for s in samples):
            result[name]["kernels_rounds"] = [s["kernels"] for s in samples]
    return result


def _timings_of_one_run(out: Path) -> dict[str, dict[str, float]]:
    result = {}
    for path in out.glob("*/cell.json"):
        cell = json.loads(path.read_text())
        log = path.parent / "reads.jsonl"
        reads = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
        decode = (cell.get("decode") or {}) if cell_succeeded(cell) else {}
        result[cell["cell"]] = _with_kernels(_batch_times(decode, reads), cell)
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
        result = e2e.run_alone(work, cell_env({"kvcached": mode}), "g4tiny", mem, timeout_s)
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


def all_batches(rounds: list[list[float]]) -> list[float]:
    return [batch for batches in rounds for batch in batches]


def pooled_steady_ratio(t: dict, a: str, b: str, resamples: int = 10_000) -> str:
    """Median steady batch of a over b's, every warm round's steady batches pooled, with a
    95% interval from resampling whole rounds. Rounds, not batches: the same cells differ
    by up to 1.5x from one round to the next on a shared host while a round's own batches
    move together, so one round alone (or batches treated as independent) would make a
    host's drift look like a difference between connectors."""
    x, y = (t.get(c, {}).get("steady_rounds", []) for c in (a, b))
    if not x or not y:
        return "n/a"
    point = statistics.median(all_batches(x)) / statistics.median(all_batches(y))
    counts = f"({len(x)} / {len(y)} rounds)"
    if min(len(x), len(y)) < 3:
        return f"{point:.2f}x, too few rounds for an interval {counts}"
    rng = np.random.default_rng(0)

    def resampled_medians(rounds: list[list[float]]) -> np.ndarray:
        picks = rng.integers(len(rounds), size=(resamples, len(rounds)))
        return np.array([np.median(np.concatenate([rounds[i] for i in row])) for row in picks])

    low, high = np.percentile(resampled_medians(x) / resampled_medians(y), [2.5, 97.5])
    return f"{point:.2f}x [{low:.2f}-{high:.2f}] {counts}"


def rounds_side_by_side(rounds: list[tuple[str, dict[str, dict]]], a: str, b: str) -> list[str]:
    """Cells a and b in each round that ran both: how far one round's ratio is from another's."""
    lines = [
        f"| round | {a} first / steady s | {b} first / steady s | ratio first / steady |",
        "|---|---|---|---|",
    ]
    for label, t in rounds:
        x, y = t.get(a, {}), t.get(b, {})
        if "first" not in x or "first" not in y:
            continue
        cold = "*" if x.get("kernels") or y.get("kernels") else ""
        lines.append(
            f"| {label}{cold} | {x['first']:.3f} / {x['steady']:.3f} "
            f"| {y['first']:.3f} / {y['steady']:.3f} | {x['first'] / y['first']:.2f}x / "
            f"{x['steady'] / y['steady']:.2f}x |"
        )
    return lines if len(lines) > 2 else []


def ratio(t: dict, a: str, b: str, key: str) -> str:
    if key not in t.get(a, {}) or key not in t.get(b, {}):
        return "n/a"
    return f"{t[a][key] / t[b][key]:.2f}x"


# (label, cell a, cell b, target) of each ratio the report gives, a over b
RATIOS = [
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


def cell_row(name: str, c: dict) -> str:
    """One cell's row of the timings table (``c``: its aggregated timings)."""
    if "failed" in c:
        return f"| {name} | failed | failed | - | - |"
    reads = (
        f"{c['first_read'] * 1e3:.1f} / {c['steady_read'] * 1e3:.1f} ({c['reads']:.0f})"
        if "first_read" in c
        else "-"
    )
    first = f"{c['first']:.3f}"
    if len(c["first_rounds"]) > 1:
        each = zip(c["first_rounds"], c["cold_rounds"], strict=True)
        first += " (" + ", ".join(f"{x:.2f}" + "*" * cold for x, cold in each) + ")"
    kernels = ", ".join(str(k) for k in c.get("kernels_rounds", [c.get("kernels", "-")]))
    return (
        f"| {name} | {first} | {c['steady']:.3f} "
        f"[{c['steady_min']:.3f}-{c['steady_max']:.3f}] | {reads} | {kernels} |"
    )


def report(*outs: Path) -> str:
    """Timings of every cell, then the ratios between cells, then round by round."""
    rounds = each_round(outs)
    t = _aggregate([timings_of_round for _, timings_of_round in rounds])
    lines = [
        "| cell | first batch s median (each round; * compiled Triton kernels, left out) "
        "| steady batch s median [min-max] "
        "| READ ms: first batch slowest / steady median (reads) "
        "| Triton kernels compiled (each round) |",
        "|---|---|---|---|---|",
    ]
    for name in BENCH_CELLS + [f"colocated:g4tiny/{c}" for c in COLOCATED]:
        if name in t:
            lines.append(cell_row(name, t[name]))
    lines += [
        "",
        "| ratio | first batch | steady batch | steady, batches pooled [95% CI over rounds] "
        "| target |",
        "|---|---|---|---|---|",
    ]
    for label, a, b, target in RATIOS:
        lines.append(
            f"| {label} | {ratio(t, a, b, 'first')} | {ratio(t, a, b, 'steady')} "
            f"| {pooled_steady_ratio(t, a, b)} | {target} |"
        )
    side_by_side = rounds_side_by_side(rounds, "g4tiny/plain", "nixl:g4tiny/plain")
    if side_by_side:
        lines += ["", "Each round (* its engines compiled Triton kernels):", "", *side_by_side]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--report", nargs="+", help="tables from earlier runs, pooled")
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
        print(report(*map(Path, args.report)))
        return
    out = Path(args.out)
    stop_with_the_driver()
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
