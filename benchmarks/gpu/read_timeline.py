#!/usr/bin/env python3
"""Where a load's time went, from decode read logs (``read_log``): per phase of the read's
timeline (``transfer/records.py``), per step between phases, and the landing's host parts,
the p50 / p90 / p99 / max in milliseconds, as a markdown table.

    python -m benchmarks.gpu.read_timeline RAW/reads/ours-decode0.jsonl [...]
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

from kvshare_connector.transfer.records import PHASES


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
    for part in ("release", "scatter", "digests"):  # arrived -> launched, on decode's host
        out.append((f"landing on the host: {part}", [
            r["landing_host"][part] * 1e3 for r in moved if part in (r.get("landing_host") or {})
        ]))  # fmt: skip
    # planned ahead (digests while the claim was out, the scatter while the READ was):
    # decode's host time, not the load's
    for part in ("digest_plan", "scatter_plan"):
        out.append((f"planned ahead on the host: {part}", [
            r["landing_host"][part] * 1e3 for r in moved if part in (r.get("landing_host") or {})
        ]))  # fmt: skip
    return [(label, values) for label, values in out if values]


def table(records: list[dict]) -> str:
    lines = ["| span | reads | p50 ms | p90 ms | p99 ms | max ms |", "|---|---|---|---|---|---|"]
    for label, values in rows(records):
        lines.append(
            f"| {label} | {len(values)} | {percentile(values, 0.5):.2f} | "
            f"{percentile(values, 0.9):.2f} | {percentile(values, 0.99):.2f} | {max(values):.2f} |"
        )
    return "\n".join(lines)


def main(paths: list[str]) -> int:
    records = [json.loads(line) for p in paths for line in Path(p).read_text().splitlines()]
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
