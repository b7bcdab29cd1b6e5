#!/usr/bin/env python3
"""Which UCX lane the READs of serving engines took, from their logs (``UCX_PROTO_INFO=y``).

UCX prints, per endpoint configuration and operation, a table of the protocol it chose:
``remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda | 0..inf | zero-copy |
cuda_ipc/cuda`` is the NVLink/IPC lane; ``software emulation | tcp/lo`` is the slow one
(0.4 GB/s on an H200 host, results/gpu/2026-11-30). This reads every engine log under
``RAW/logs`` and every read log under ``RAW/reads`` (``bench_serving.py --keep-raw``) and
prints, per engine, the lanes of its reads of GPU memory, and the GB/s of our READs.

    python -m lab.benchmarks.gpu.serving_lanes OUT/serving/raw
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

PREFIX = re.compile(r"^(\([^)]*pid=\d+\) )?\[[\d.]+\] \[[^\]]*\]\s*")
ROW = re.compile(r"^\|\s*(\S+)\s*\|\s*(.+?)\s*\|\s*(.+?)\s*\|$")
ENDPOINT = re.compile(r"ucp_worker\.c:\d+\s+UCX\s+INFO\s+(.*cfg#\d+.*)$")
WARNING = re.compile(r"UCX\s+(WARN|ERROR)\s+(.*)$")


@dataclass(frozen=True)
class Lane:
    """One row of a UCX protocol table: for ``operation`` in byte ``range``, ``config``."""

    endpoint: str  # e.g. "decode intra-node cfg#2"
    operation: str  # e.g. "remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda"
    range: str
    description: str  # zero-copy, software emulation, ...
    config: str  # transport/device, e.g. cuda_ipc/cuda or tcp/lo


def lanes(text: str) -> list[Lane]:
    """Every protocol-table row of a log (UCX prints each table between +---+ borders:
    endpoint line, operation line, the column header, then one row per range)."""
    out: list[Lane] = []
    cells: list[str] = []
    for raw in text.splitlines():
        line = PREFIX.sub("", raw).strip()
        if line.startswith("+-"):
            continue
        if not (line.startswith("|") and line.endswith("|")):
            cells = []
            continue
        row = ROW.match(line)
        if row is None:  # a one-cell line: endpoint, then operation
            cells = [*cells[-1:], line.strip("| ").strip()]
            continue
        first = row.group(1)
        if first == "Range" or len(cells) < 2:
            continue
        out.append(Lane(cells[0], cells[1], first, row.group(2), row.group(3)))
    return out


def gpu_reads(found: list[Lane]) -> list[Lane]:
    """The lanes of reads whose remote side is GPU memory: what a READ of KV takes."""
    return [
        lane
        for lane in found
        if lane.operation.startswith("remote memory read") and " from cuda" in lane.operation
    ]


def endpoints(text: str) -> list[str]:
    """UCX's endpoint configurations: which transports each lane uses (``device(cuda_ipc/
    cuda)`` present or not is the first sign of an IPC-capable endpoint)."""
    return [" ".join(m.group(1).split()) for m in map(ENDPOINT.search, text.splitlines()) if m]


def warnings(text: str) -> list[str]:
    return [" ".join(m.group(0).split()) for m in map(WARNING.search, text.splitlines()) if m]


def read_rates(path: Path) -> list[tuple[float, int, float]]:
    """(MB, descriptors, GB/s) per READ of a read log."""
    out = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("seconds", 0) > 0 and r.get("bytes", 0) > 0:
            out.append((r["bytes"] / 1e6, r["descriptors"], r["bytes"] / r["seconds"] / 1e9))
    return out


def report(raw: Path) -> str:
    lines = [f"# UCX lanes of the serving engines under {raw}", ""]
    logs = sorted(
        p
        for p in (raw / "logs").glob("*/*.log")
        if p.parent.name != "bench" and not p.stem.startswith(("proxy", "router"))
    )
    for log in logs:
        text = log.read_text(errors="replace")
        reads = Counter(
            (lane.operation, lane.range, lane.description, lane.config)
            for lane in gpu_reads(lanes(text))
        )
        lines.append(f"## {log.parent.name}/{log.name}")
        if not reads:
            lines.append("- no protocol table for reads of GPU memory (UCX_PROTO_INFO=y unset?)")
        for (op, rng, desc, config), count in reads.most_common():
            lines.append(f"- {op} | {rng} | {desc} | **{config}** ({count}x)")
        for endpoint in sorted(set(endpoints(text)))[:10]:
            lines.append(f"- endpoint: `{endpoint[:200]}`")
        for warning in sorted(set(warnings(text)))[:10]:
            lines.append(f"- `{warning[:200]}`")
        lines.append("")
    for path in sorted((raw / "reads").glob("*.jsonl")):
        rates = read_rates(path)
        lines.append(f"## READs in {path.name}: {len(rates)}")
        if rates:
            gbps = sorted(r[2] for r in rates)
            mb = statistics.median(r[0] for r in rates)
            lines.append(
                f"- GB/s min / median / max: {gbps[0]:.2f} / {statistics.median(gbps):.2f} / "
                f"{gbps[-1]:.2f}; MB per READ, median: {mb:.1f}"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(report(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
