"""Sweep reports: results JSON, a markdown table, and a PNG plot (PD vs baseline vs expected).

Written after every configuration, so a crash late in a long sweep keeps what was measured.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _score(result: dict[str, Any], side: str) -> float | None:
    part = result.get(side)
    return part.get("score") if isinstance(part, dict) else None


def markdown_table(results: Sequence[dict[str, Any]]) -> str:
    header = (
        "| config | model | layout | kvcached (contiguous) | block | max len | GPU mem | "
        "PD | baseline | same gen. | probe tokens | expected | status |"
    )
    lines = [header, "|" + "|".join(["---"] * (header.count("|") - 1)) + "|"]
    for r in results:
        c = r["config"]
        kvc = "on" if c.get("kvcached") else "off"
        if c.get("kvcached") and c.get("kvcached_contiguous_layout") is not None:
            kvc += f" ({str(c['kvcached_contiguous_layout']).lower()})"
        expected = r.get("expected_score")
        exp = "-" if expected is None else f"{expected:.3f} ± {r.get('tolerance', 0):.3f}"
        probe = r.get("probe") or {}
        probe_txt = f"{probe['tokens_equal']}/{probe['n']}" if probe.get("n") else "-"
        status = r["status"] + (f": {r['error'].splitlines()[0][:80]}" if r.get("error") else "")
        lines.append(
            f"| {r['name']} | {Path(str(c['model'])).name} | {c.get('layout') or '-'} | {kvc} | "
            f"{c.get('block_size') or '-'} | {c.get('max_model_len') or '-'} | "
            f"{c.get('gpu_memory_utilization') or '-'} | {_fmt(_score(r, 'pd'))} | "
            f"{_fmt(_score(r, 'baseline'))} | {_fmt(r.get('agreement'), 2)} | {probe_txt} | "
            f"{exp} | {status} |"
        )
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, results: Sequence[dict[str, Any]], meta: dict[str, Any]) -> None:
    metric = meta.get("metric", "")
    text = [
        "# KVShareConnector PD accuracy sweep",
        "",
        f"Configurations from `{meta.get('config_file')}`, started {meta.get('started')}.",
        f"Scores: lm-eval `{metric}` (task per configuration in results.json). "
        "PD = prefill/decode through the proxy; baseline = one colocated `vllm serve` with "
        "the same options. *same gen.* = fraction of documents whose generated text is "
        "identical in PD and baseline; *probe tokens* = greedy probe prompts whose tokens "
        "match exactly.",
        "",
        markdown_table(results),
    ]
    path.write_text("\n".join(text))


def write_plot(path: Path, results: Sequence[dict[str, Any]]) -> None:
    """Grouped bars (baseline, PD) per configuration; expected score ± tolerance as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in results]
    xs = range(len(results))
    width = 0.38
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(results) + 2), 4.2))
    base = [_score(r, "baseline") or 0.0 for r in results]
    pd = [_score(r, "pd") or 0.0 for r in results]
    ax.bar([x - width / 2 for x in xs], base, width, label="colocated baseline", color="#8da0cb")
    ax.bar([x + width / 2 for x in xs], pd, width, label="PD (KVShareConnector)", color="#fc8d62")
    for x, r, b, p in zip(xs, results, base, pd, strict=True):
        for dx, value, present in ((-width / 2, b, r.get("baseline")), (width / 2, p, r.get("pd"))):
            if present:
                ax.annotate(f"{value:.3f}", (x + dx, value), ha="center", va="bottom", fontsize=7)
        if r.get("agreement") is not None:
            ax.annotate(f"same gen. {r['agreement']:.2f}", (x, 0.98), ha="center", fontsize=7)
        if r.get("expected_score") is not None:
            e, tol = r["expected_score"], r.get("tolerance") or 0.0
            ax.fill_between([x - 0.45, x + 0.45], e - tol, e + tol, color="0.85", zorder=0)
            ax.plot([x - 0.45, x + 0.45], [e, e], color="0.3", lw=1.2)
        if r["status"] != "passed":
            ax.annotate(r["status"].upper(), (x, 0.02), ha="center", color="crimson", fontsize=8)
    ax.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel(results[0]["config"].get("metric", "score") if results else "score")
    ax.set_title("PD vs colocated accuracy (grey band: expected ± tolerance)")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_reports(
    out_dir: Path, results: Sequence[dict[str, Any]], meta: dict[str, Any]
) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / "results.json",
        "markdown": out_dir / "results.md",
        "plot": out_dir / "results.png",
    }
    paths["json"].write_text(
        json.dumps({"meta": meta, "results": list(results)}, indent=2, default=str) + "\n"
    )
    write_markdown(paths["markdown"], results, meta)
    if results:
        try:
            write_plot(paths["plot"], results)
        except ImportError as exc:  # e.g. a GPU host without matplotlib: re-render later
            logger.warning(
                "no plot (%s); re-render with `python -m %s %s`", exc, __name__, paths["json"]
            )
            paths.pop("plot")
    return paths


def merge_runs(runs: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One report from several results.json (e.g. one configuration per command on a host
    with a per-command time limit); a later run's configuration replaces an earlier one's."""
    by_name: dict[str, dict[str, Any]] = {}
    metas = [run.get("meta", {}) for run in runs]
    for run in runs:
        for result in run["results"]:
            by_name.pop(result["name"], None)
            by_name[result["name"]] = result
    started = [m["started"] for m in metas if m.get("started")]
    finished = [m["finished"] for m in metas if m.get("finished")]
    files = sorted({m["config_file"] for m in metas if m.get("config_file")})
    meta = {
        "config_file": ", ".join(files),
        "started": min(started) if started else None,
        "finished": max(finished) if finished else None,
        "metric": next((m["metric"] for m in metas if m.get("metric")), ""),
        "merged_from": len(runs),
    }
    return list(by_name.values()), meta


def main(argv: Sequence[str] | None = None) -> int:
    """Re-render results.md and results.png from one results.json (e.g. copied off a GPU
    host), or merge several into --out."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("results_json", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, help="directory of the merged report")
    args = parser.parse_args(argv)
    if len(args.results_json) > 1 and args.out is None:
        parser.error("several results.json need --out")
    runs = [json.loads(path.read_text()) for path in args.results_json]
    results, meta = (
        merge_runs(runs) if len(runs) > 1 else (runs[0]["results"], runs[0].get("meta", {}))
    )
    paths = write_reports(args.out or args.results_json[0].parent, results, meta)
    print("\n".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
