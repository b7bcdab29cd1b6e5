#!/usr/bin/env python3
"""Issue 21's curve out of several serving runs: one markdown table and one PNG across
prompt lengths, from the ``results.json`` each ``fast_lane.sh curve`` call wrote (one prompt
length per call fits the device's 10 minutes). Each cell is the median over rounds with its
min-max; ratios are of medians, against NixlConnector and against the colocated engine of
the same run (deployments that ran side by side, never across runs).

    python -m lab.benchmarks.gpu.curve_table RESULTS.json... [--md OUT.md] [--png OUT.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

NIXL, COLOCATED = "nixl", "colocated"
HEAD = ["point", "deployment", "rounds", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "req/s",
        "TTFT p50 / NIXL", "TTFT p99 / NIXL", "req/s / NIXL", "TTFT p50 / colocated"]  # fmt: skip


def load(paths: list[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every point of every run (shortest prompt first), and every run not made."""
    points, missing = [], []
    for path in paths:
        data = json.loads(path.read_text())
        points += data.get("points") or []
        missing += data.get("not_reached") or []
    points.sort(key=lambda p: (p["input_len"], p["concurrency"]))
    return points, missing


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _median(row: dict[str, Any] | None, key: str) -> float | None:
    cell = (row or {}).get(key)
    return cell.get("median") if isinstance(cell, dict) else None


def _cell(row: dict[str, Any], key: str, digits: int = 0) -> str:
    cell = row.get(key)
    if not isinstance(cell, dict) or cell.get("median") is None:
        return "-"
    text = f"{cell['median']:.{digits}f}"
    if cell.get("n", 1) > 1:
        text += f" ({cell['min']:.{digits}f}-{cell['max']:.{digits}f})"
    return text


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def _order(name: str) -> tuple[int, str]:
    return ({COLOCATED: 0, NIXL: 1}.get(name, 2), name)


def table(points: list[dict[str, Any]], missing: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    for p in points:
        deps = p["deployments"]
        nixl, colo = deps.get(NIXL), deps.get(COLOCATED)
        for name in sorted(deps, key=_order):
            row = deps[name]
            ours = name not in (NIXL, COLOCATED)
            ratios = [
                _ratio(_median(row, "median_ttft_ms"), _median(nixl, "median_ttft_ms")),
                _ratio(_median(row, "p99_ttft_ms"), _median(nixl, "p99_ttft_ms")),
                _ratio(_median(row, "request_throughput"), _median(nixl, "request_throughput")),
            ] if ours else ["-"] * 3  # fmt: skip
            to_colo = "-" if name == COLOCATED else _ratio(
                _median(row, "median_ttft_ms"), _median(colo, "median_ttft_ms"))  # fmt: skip
            cells = [f"{_k(p['input_len'])} x {p['concurrency']}", name, row.get("ok_rounds", "-"),
                     _cell(row, "median_ttft_ms"), _cell(row, "p99_ttft_ms"),
                     _cell(row, "median_itl_ms", 1), _cell(row, "request_throughput", 1),
                     *ratios, to_colo]  # fmt: skip
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    gone: dict[tuple[int, int], list[str]] = {}
    for m in missing:
        gone.setdefault((m["input_len"], m["concurrency"]), []).append(m["deployment"])
    if gone:
        lines.append("")
        lines.append("Rounds the call's time budget left out (the rounds column counts those "
                     "made; a point not in the table had none): " + "; ".join(
            f"{_k(n)} x {c}: {', '.join(sorted(d, key=_order))}"
            for (n, c), d in sorted(gone.items())) + ".")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(points: list[dict[str, Any]], path: Path) -> bool:
    """TTFT p50 against prompt length, one panel per concurrency, min-max as error bars."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    concs = sorted({p["concurrency"] for p in points})
    if not concs:
        return False
    fig, axes = plt.subplots(1, len(concs), figsize=(5 * len(concs), 4), squeeze=False)
    for ax, conc in zip(axes[0], concs, strict=True):
        at = [p for p in points if p["concurrency"] == conc]
        for name in sorted({d for p in at for d in p["deployments"]}, key=_order):
            xs, ys, lo, hi = [], [], [], []
            for p in at:
                cell = p["deployments"].get(name, {}).get("median_ttft_ms")
                if isinstance(cell, dict) and cell.get("median") is not None:
                    xs.append(p["input_len"])
                    ys.append(cell["median"])
                    lo.append(cell["median"] - cell["min"])
                    hi.append(cell["max"] - cell["median"])
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=name)
        ax.set_xscale("log", base=2)
        lengths = sorted({p["input_len"] for p in points})
        ax.set_xticks(lengths, [_k(n) for n in lengths])
        ax.set_yscale("log")
        ax.set_title(f"concurrency {conc}")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT p50 ms (median over rounds, min-max)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", type=Path, help="results.json of each curve call")
    p.add_argument("--md", type=Path, help="write the table here (default: print it)")
    p.add_argument("--png", type=Path, help="TTFT p50 against prompt length")
    args = p.parse_args(argv)
    points, missing = load(args.results)
    text = table(points, missing)
    if args.md:
        args.md.write_text(text)
    else:
        print(text, end="")
    if args.png and not plot(points, args.png):
        print("curve_table: no plot (matplotlib missing or no point)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
