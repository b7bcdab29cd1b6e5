#!/usr/bin/env python3
"""Where a load's time went, from decode read logs (``read_log``): per phase of the read's
timeline (``transfer/device/records.py``), per step between phases, and the landing's host parts,
the p50 / p90 / p99 / max in milliseconds, as a markdown table; and the effective rate of
issue 21's target, bytes over posted -> landed (the READ and the scatter: bytes in place).
``--runs GAP`` adds a line per run: reads apart by more than GAP s of quiet begin a new one
(a serving benchmark's runs, e.g. concurrency 1 and 16, sit seconds apart).

    python -m lab.benchmarks.gpu.read_timeline RAW/reads/ours-decode0.jsonl [...] [--runs 5]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

from kvshare_connector.transfer.device.records import PHASES


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rows(records: list[dict]) -> list[tuple[str, list[float]]]:
    """(label, milliseconds) per phase since the order, per step between phases, and
    prefill's hold age when the claim came."""
    moved = [r for r in records if r.get("bytes") and r.get("timeline")]
    out = []
    present = [p for p in PHASES if any(p in r["timeline"] for r in moved)]
    for phase in present:
        out.append((f"order -> {phase}", [r["timeline"][phase] * 1e3 for r in moved
                                          if phase in r["timeline"]]))  # fmt: skip
    for a, b in itertools.pairwise(present):
        steps = [(r["timeline"][b] - r["timeline"][a]) * 1e3 for r in moved
                 if a in r["timeline"] and b in r["timeline"]]  # fmt: skip
        out.append((f"{a} -> {b}", steps))
    held = [r["prefill_held_s"] * 1e3 for r in moved if r.get("prefill_held_s") is not None]
    if held:
        out.append(("prefill held before the claim", held))
    # The claim's round trip split: prefill's own answer time, the rest is the way there
    # and back (sockets, threads, GIL, decode's next look) and any "not held yet" retry.
    answer = [r["prefill_answer_s"] * 1e3 for r in moved if r.get("prefill_answer_s") is not None]
    out.append(("prefill answering the claim", answer))
    if answer:
        out.append(("claims per read (count, not ms)", [float(r.get("claims", 1)) for r in moved]))
    # arrived -> launched, on decode's host
    for part in ("release", "scatter", "digests"):
        out.append((f"landing on the host: {part}", [
            r["landing_host"][part] * 1e3 for r in moved if part in (r.get("landing_host") or {})
        ]))  # fmt: skip
    # planned ahead (digests while the claim was out, the scatter while the READ was):
    # decode's host time, not the load's
    for part in ("digest_plan", "digest_upload", "scatter_plan", "scatter_upload"):
        out.append((f"planned ahead on the host: {part}", [
            r["landing_host"][part] * 1e3 for r in moved if part in (r.get("landing_host") or {})
        ]))  # fmt: skip
    out.append(("posted -> landed, effective GB/s (not ms)", effective_gbps(moved)))
    out.append(("prepared -> landed (from the post's start), effective GB/s (not ms)",
                effective_gbps(moved, "prepared")))  # fmt: skip
    return [(label, values) for label, values in out if values]


def effective_gbps(records: list[dict], since: str = "posted") -> list[float]:
    """Bytes over ``since`` -> landed, per read, in GB/s (``prepared``: from the start of
    NIXL's post call, its request made; ``posted``: from its return)."""
    rates = []
    for r in records:
        t = r.get("timeline") or {}
        if r.get("bytes") and since in t and "landed" in t and t["landed"] > t[since]:
            rates.append(r["bytes"] / (t["landed"] - t[since]) / 1e9)
    return rates


def split_runs(records: list[dict], gap_s: float) -> list[list[dict]]:
    """Reads in the order they were logged, cut where more than ``gap_s`` passed."""
    timed = sorted((r for r in records if r.get("bytes") and "time" in r), key=lambda r: r["time"])
    runs: list[list[dict]] = []
    for r in timed:
        if not runs or r["time"] - runs[-1][-1]["time"] > gap_s:
            runs.append([])
        runs[-1].append(r)
    return runs


def runs_table(records: list[dict], gap_s: float) -> str:
    lines = ["| run | reads | MB per read p50 | posted -> arrived p50 ms | posted -> landed p50 ms "
             "| effective GB/s p50 | best | from the post's start GB/s p50 |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for i, run in enumerate(split_runs(records, gap_s)):
        t = [r["timeline"] for r in run if "posted" in r.get("timeline", {})]
        arrived = [(x["arrived"] - x["posted"]) * 1e3 for x in t if "arrived" in x]
        landed = [(x["landed"] - x["posted"]) * 1e3 for x in t if "landed" in x]
        rates = effective_gbps(run)
        cells = [statistics.median(v) if v else float("nan") for v in (arrived, landed, rates)]
        best = max(rates) if rates else float("nan")
        whole = effective_gbps(run, "prepared")  # logs before 2026-12-06f have no "prepared"
        from_start = statistics.median(whole) if whole else float("nan")
        mb = statistics.median(r["bytes"] for r in run) / 1e6
        lines.append(f"| {i} | {len(run)} | {mb:.1f} | {cells[0]:.2f} | {cells[1]:.2f} | "
                     f"{cells[2]:.1f} | {best:.1f} | {from_start:.1f} |")  # fmt: skip
    return "\n".join(lines)


def table(records: list[dict]) -> str:
    lines = ["| span | reads | p50 ms | p90 ms | p99 ms | max ms |", "|---|---|---|---|---|---|"]
    for label, values in rows(records):
        lines.append(
            f"| {label} | {len(values)} | {percentile(values, 0.5):.2f} | "
            f"{percentile(values, 0.9):.2f} | {percentile(values, 0.99):.2f} | {max(values):.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", help="decode read logs (JSON lines)")
    p.add_argument("--runs", type=float, metavar="GAP", help="also a line per run")
    args = p.parse_args(argv)
    records = [json.loads(line) for f in args.paths for line in Path(f).read_text().splitlines()]
    print(table(records))
    if args.runs:
        print()
        print(runs_table(records, args.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
