#!/usr/bin/env python3
"""Tables and plots for bench_serving.py, recomputed from its raw files only.

The raw files are what ``vllm bench serve --save-result`` wrote (one JSON per deployment,
point and round), our decode's ``read_log`` (one JSON line per finished READ) and the
runner's manifest ``runs.jsonl`` (which file is which run, and the wall-clock window of
each, so READs are attributed to the run they happened in). They live in ``OUT/raw/``
while a run is going and in ``OUT/raw.tar.gz`` after it; this module reads either, so
``--report OUT`` reproduces summary.md, results.json and scaling.png at any later time.

    python -m lab.benchmarks.gpu.serving_report OUT
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tarfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from lab.benchmarks.gpu.serving.engine_stats import (
    engine_requests,
    engine_seconds,
    jsonl,
    verify_counts,
)

RAW = "raw"
TARBALL = "raw.tar.gz"
#: (key in vllm bench serve's result JSON, column header); all higher-is-better come first.
METRICS: list[tuple[str, str]] = [
    ("request_throughput", "req/s"),
    ("output_throughput", "out tok/s"),
    ("mean_ttft_ms", "TTFT mean ms"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("median_itl_ms", "ITL p50 ms"),
    ("p99_itl_ms", "ITL p99 ms"),
]
READ_METRICS: list[tuple[str, str]] = [
    ("read_gbps", "READ GB/s"),
    ("read_p50_ms", "READ p50 ms"),
    ("descriptors_per_read", "desc/req"),
    ("reads_per_request", "reads/req"),
]


def load_raw(out: Path, log_name: str | None = None) -> dict[str, bytes]:
    """Every raw file, keyed by its path under ``raw/``; of the logs (engines', benches',
    the front's: most of the bytes) only those called ``log_name``."""

    def wanted(name: str) -> bool:
        return not name.endswith(".log") or name.rpartition("/")[2] == log_name

    files: dict[str, bytes] = {}
    raw_dir = out / RAW
    if raw_dir.is_dir():
        for path in raw_dir.rglob("*"):
            if path.is_file() and wanted(path.name):
                files[path.relative_to(raw_dir).as_posix()] = path.read_bytes()
        return files
    with tarfile.open(out / TARBALL, "r:gz") as tar:
        for member in tar.getmembers():
            name = member.name.removeprefix(f"{RAW}/")
            if member.isfile() and wanted(name):
                data = tar.extractfile(member)
                if data is not None:
                    files[name] = data.read()
    return files


def pack(out: Path, keep: bool) -> None:
    """raw/ -> raw.tar.gz (few files to bring back); raw/ is removed unless ``keep``."""
    with tarfile.open(out / TARBALL, "w:gz") as tar:
        tar.add(out / RAW, arcname=RAW)
    if not keep:
        shutil.rmtree(out / RAW)


def read_stats(reads: list[dict[str, Any]], start: float, end: float) -> dict[str, float]:
    """READs (with bytes) whose finish time falls in [start, end]: bandwidth as total
    bytes over total READ seconds, the median READ time, descriptors per READ."""
    sel = [r for r in reads if start <= r.get("time", -1.0) <= end and r.get("bytes")]
    if not sel:
        return {}
    seconds = sum(r["seconds"] for r in sel)
    return {
        "reads": float(len(sel)),
        "read_gbps": sum(r["bytes"] for r in sel) / seconds / 1e9 if seconds > 0 else 0.0,
        "read_p50_ms": statistics.median(r["seconds"] for r in sel) * 1e3,
        "descriptors_per_read": statistics.median(r["descriptors"] for r in sel),
        "blocks_per_read": statistics.median(r["blocks"] for r in sel),
        "mb_per_read": statistics.median(r["bytes"] for r in sel) / 1e6,
    }


def _read_logs(info: dict[str, Any]) -> list[str]:
    """A deployment's read logs: one per decode engine (older runs: one ``read_log``)."""
    logs = list(info.get("read_logs") or [])
    return logs or ([info["read_log"]] if info.get("read_log") else [])


def collect(files: dict[str, bytes]) -> dict[str, Any]:
    """One record per timed run: its manifest entry, vLLM's metrics, our READ stats; runs
    the time budget left out go to ``skipped``."""
    manifest = jsonl(files.get("runs.jsonl"))
    deployments = json.loads(files.get("deployments.json", b"{}"))
    meta = json.loads(files.get("meta.json", b"{}"))
    reads: dict[str, list[dict[str, Any]]] = {}
    for name, info in deployments.items():
        logs = _read_logs(info)
        if logs:
            reads[name] = [r for log in logs for r in jsonl(files.get(log))]
    runs, skipped = [], []
    engine_ms = engine_seconds(files)
    for entry in manifest:
        if entry.get("warmup"):
            continue
        if entry.get("skipped"):
            skipped.append(entry)
            continue
        rec = dict(entry)
        result = files.get(entry["file"])
        rec["ok"] = result is not None and entry.get("rc") == 0
        if result is not None:
            data = json.loads(result)
            rec["metrics"] = {k: data.get(k) for k, _ in METRICS}
            rec["metrics"]["failed"] = data.get("failed")
            rec["metrics"]["completed"] = data.get("completed")
        rec["engine_ms"] = engine_ms.get(entry["file"], {})
        if entry["deployment"] in reads:
            stats = read_stats(reads[entry["deployment"]], entry["start"], entry["end"])
            done = (rec.get("metrics") or {}).get("completed") or 0
            if stats and done:
                stats["reads_per_request"] = stats["reads"] / done
            rec["reads"] = stats
        runs.append(rec)
    return {"meta": meta, "deployments": deployments, "runs": runs, "skipped": skipped,
            "checks": _checks(files), "engines": engine_requests(files),
            "verify_kv": verify_counts(files),
            "first_tokens": first_token_counts(files)}  # fmt: skip


def first_token_counts(files: dict[str, bytes]) -> dict[str, dict[str, int]]:
    """Per deployment behind our proxy (``logs/NAME/proxy.log``, which ``load_raw`` loads): the
    requests whose first token came from prefill, of all the PD requests it logged."""
    out = {}
    for name, data in files.items():
        parts = name.split("/")
        if len(parts) == 3 and parts[0] == "logs" and parts[2] == "proxy.log":
            text = data.decode(errors="replace")
            handed = text.count(", first token from prefill;")
            classic = text.count(", decode stream opened ") + text.count(", decode done ")
            out[parts[1]] = {"from_prefill": handed, "requests": handed + classic}
    return out


def _checks(files: dict[str, bytes]) -> dict[str, Any]:
    """The warmup's generation checks per deployment, and text agreement with colocated."""
    out: dict[str, Any] = {}
    for name, data in files.items():
        if name.startswith("checks/") and name.endswith(".json") and "agreement" not in name:
            c = json.loads(data)
            out[c["deployment"]] = {k: c.get(k) for k in ("requests", "ok", "problems")}
    agree = json.loads(files.get("checks/agreement.json", b"{}"))
    for name, frac in agree.items():
        out.setdefault(name, {})["agreement"] = frac
    return out


def _spread(values: list[float]) -> dict[str, float] | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def aggregate(collected: dict[str, Any]) -> dict[str, Any]:
    """Per (input_len, concurrency) point and deployment: median and range over rounds;
    per point the ratios of each ``ours*`` deployment's medians to nixl's and colocated's."""
    groups: dict[tuple[int, int], dict[str, list[dict[str, Any]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    kinds = {n: d.get("kind", n) for n, d in collected["deployments"].items()}
    for run in collected["runs"]:
        groups[(run["input_len"], run["concurrency"])][run["deployment"]].append(run)
    points = []
    for (input_len, conc), by_dep in sorted(groups.items()):
        deps: dict[str, Any] = {}
        for name, runs in sorted(by_dep.items()):
            good = [r for r in runs if r["ok"]]
            row: dict[str, Any] = {"rounds": len(runs), "ok_rounds": len(good)}
            for key, _ in [*METRICS, ("failed", "")]:
                row[key] = _spread([r["metrics"][key] for r in good])
            for key, _ in READ_METRICS:
                row[key] = _spread([r["reads"].get(key) for r in good if r.get("reads")])
            cells = sorted({(e, k) for r in good for e, ms in r.get("engine_ms", {}).items()
                            for k in ms})  # fmt: skip
            row["engine_ms"] = {
                f"{e} {k}": _spread([r["engine_ms"].get(e, {}).get(k) for r in good])
                for e, k in cells
            }
            deps[name] = row
        ratios: dict[str, dict[str, dict[str, float | None]]] = {}
        base = {k: [n for n in deps if kinds.get(n) == k] for k in ("nixl", "colocated")}
        for name in deps:
            if kinds.get(name) != "ours":
                continue
            for kind, names in base.items():
                if not names:
                    continue
                ratios.setdefault(name, {})[f"/{kind}"] = {
                    key: _ratio(deps[name].get(key), deps[names[0]].get(key)) for key, _ in METRICS
                }
        points.append(
            {"input_len": input_len, "concurrency": conc, "deployments": deps, "ratios": ratios}
        )
    not_reached = sorted(
        {(s["input_len"], s["concurrency"], s["deployment"], s["skipped"])
         for s in collected.get("skipped", [])}
    )  # fmt: skip
    return {
        "meta": collected["meta"],
        "points": points,
        "not_reached": [
            {"input_len": n, "concurrency": c, "deployment": d, "why": w}
            for n, c, d, w in not_reached
        ],
        "checks": collected.get("checks", {}),
        "engines": collected.get("engines", {}),
        "verify_kv": collected.get("verify_kv", {}),
        "first_tokens": collected.get("first_tokens", {}),
        "routers": {n: d.get("router") for n, d in collected["deployments"].items()},
    }


def _ratio(a: dict[str, float] | None, b: dict[str, float] | None) -> float | None:
    if not a or not b or not b["median"]:
        return None
    return a["median"] / b["median"]


def _cell(spread: dict[str, float] | None, digits: int = 1) -> str:
    if not spread:
        return "n/a"
    med = f"{spread['median']:.{digits}f}"
    if spread["n"] > 1:
        return f"{med} ({spread['min']:.{digits}f}-{spread['max']:.{digits}f})"
    return med


def markdown(summary: dict[str, Any]) -> str:
    """Per point: one row per deployment (median over rounds, min-max in brackets), then
    the ours/nixl and ours/colocated ratios of medians."""
    meta = summary["meta"]
    lines = ["# Serving benchmark: PD (ours, NixlConnector) vs colocated", ""]
    if meta:
        lines += [
            f"- mode `{meta.get('mode', 'rounds')}`; PD front `{meta.get('router', 'kvshare')}`"
            f", {meta.get('num_prefill', 1)} prefill x {meta.get('num_decode', 1)} decode "
            f"engines; time budget {meta.get('time_budget')} s",
            f"- model: `{meta.get('model_dir')}`; tokenizer `{meta.get('tokenizer')}`",
            f"- output {meta.get('output_len')} tokens, {meta.get('num_prompts')} prompts per "
            f"run, {meta.get('rounds')} rounds (order rotated), kvcached "
            f"`{meta.get('kvcached')}` on {meta.get('kvcached_on')}, gpu mem "
            f"{meta.get('gpu_mem')} per engine, one at a time: {meta.get('one_at_a_time')}",
            f"- GPUs: {meta.get('gpus', 'unknown')}; started {meta.get('started')}",
            "",
        ]
    lines += [
        "Cells: median over rounds (min-max). TTFT/ITL in ms, lower is better; READ columns "
        "from our decode's read_log (bytes / READ seconds, per-READ median time and "
        "descriptors; reads/req < 1 means some requests were computed locally).",
        "",
    ]
    lines += _checks_md(summary) + _scaling_md(summary)
    heads = [h for _, h in METRICS] + ["failed"] + [h for _, h in READ_METRICS]
    for point in summary["points"]:
        lines += [f"## input {point['input_len']} tokens, concurrency {point['concurrency']}", ""]
        lines += ["| deployment | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
        for name, row in point["deployments"].items():
            cells = [_cell(row[k], 1) for k, _ in METRICS] + [_cell(row["failed"], 0)]
            cells += [_cell(row[k], 2) for k, _ in READ_METRICS]
            note = (
                ""
                if row["ok_rounds"] == row["rounds"]
                else f" ({row['ok_rounds']}/{row['rounds']} ok)"
            )
            lines.append(f"| {name}{note} | " + " | ".join(cells) + " |")
        if point["ratios"]:
            cols = [(n, b) for n, by in point["ratios"].items() for b in by]
            lines += ["", "| ratio of medians | " + " | ".join(f"{n}{b}" for n, b in cols) + " |"]
            lines.append("|---" * (len(cols) + 1) + "|")
            for key, head in METRICS:
                vals = [point["ratios"][n][b][key] for n, b in cols]
                lines.append(
                    f"| {head} | "
                    + " | ".join("n/a" if v is None else f"{v:.3f}" for v in vals)
                    + " |"
                )
        lines += _engine_ms_md(point)
        lines.append("")
    return "\n".join(lines)


def _engine_ms_md(point: dict[str, Any]) -> list[str]:
    """vLLM's own per-engine means of the point (where a PD request's TTFT went: prefill's
    engine, then decode's from its server's arrival)."""
    rows = [(n, r["engine_ms"]) for n, r in point["deployments"].items() if r.get("engine_ms")]
    if not rows:
        return []
    lines = ["", "vLLM's per-engine means over each run, ms (median over rounds): TTFT from the "
             "engine's server's arrival, time queued, prefill time", ""]  # fmt: skip
    for name, cells in rows:
        text = ", ".join(f"{k} {_cell(v, 1)}" for k, v in cells.items() if v)
        lines.append(f"- {name}: {text}")
    return lines


def _checks_md(summary: dict[str, Any]) -> list[str]:
    """Warmup generation checks, and how many requests each engine served."""
    lines: list[str] = []
    checks = summary.get("checks") or {}
    if checks:
        lines += ["## Generation checks (warmup: greedy, token-id prompts, the same for all)", "",
                  "| deployment | front | ok / requests | same text as colocated | problems |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for name, c in sorted(checks.items()):
            agree = c.get("agreement")
            lines.append(
                f"| {name} | {summary.get('routers', {}).get(name) or '-'} | "
                f"{c.get('ok', '-')} / {c.get('requests', '-')} | "
                f"{'-' if agree is None else f'{agree:.0%}'} | "
                f"{'; '.join((c.get('problems') or [])[:3]) or '-'} |"
            )
        lines.append("")
    engines = summary.get("engines") or {}
    if engines:
        lines += ["Requests each engine served after the warmup (`vllm:request_success_total`):",
                  ""]  # fmt: skip
        for dep, counts in sorted(engines.items()):
            lines.append(f"- {dep}: " + ", ".join(f"{e} {v:.0f}" for e, v in counts.items()))
        lines.append("")
    firsts = summary.get("first_tokens") or {}
    if any(c["requests"] for c in firsts.values()):
        lines += ["First token from prefill (our proxy's log, warmup included): " + ", ".join(
            f"{dep} {c['from_prefill']}/{c['requests']}" for dep, c in sorted(firsts.items())
        ), ""]  # fmt: skip
    verify = summary.get("verify_kv") or {}
    if verify:
        lines += [
            "verify_kv over each deployment's run, warmup included "
            "(`vllm:kvshare_verified_loads_total` / `_verify_failures_total`):",
            "",
        ]
        for dep, row in sorted(verify.items()):
            lines.append(
                f"- {dep}: {row['verified']:.0f} loads verified, {row['failures']:.0f} refused"
            )
        lines.append("")
    return lines


def _scaling_md(summary: dict[str, Any]) -> list[str]:
    """One compact table over every point (TTFT p50, ITL p50, READ GB/s per deployment),
    with the points the time budget left out marked."""
    points = summary["points"]
    missing = summary.get("not_reached") or []
    if len(points) + len(missing) < 2:
        return []
    names = sorted(
        {n for p in points for n in p["deployments"]} | {m["deployment"] for m in missing}
    )
    keys = sorted({(p["input_len"], p["concurrency"]) for p in points}
                  | {(m["input_len"], m["concurrency"]) for m in missing})  # fmt: skip
    by = {(p["input_len"], p["concurrency"]): p["deployments"] for p in points}
    lines = ["## Scaling: TTFT p50 ms / ITL p50 ms / READ GB/s (median)", "",
             "| input | concurrency | " + " | ".join(names) + " |",
             "|---|---|" + "---|" * len(names)]  # fmt: skip
    for key in keys:
        cells = []
        for name in names:
            row = by.get(key, {}).get(name)
            if row is None:
                cells.append("not reached")
                continue
            ttft, itl, gbps = (row.get(k) for k in ("median_ttft_ms", "median_itl_ms", "read_gbps"))
            cells.append(" / ".join(_cell(x and {**x, "n": 1}, 1) for x in (ttft, itl))
                         + ("" if not gbps else f" / {gbps['median']:.1f}"))  # fmt: skip
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    if missing:
        lines += ["", f"Not reached ({len(missing)} runs): " + missing[0]["why"]]
    return [*lines, ""]


def plot(summary: dict[str, Any], path: Path) -> bool:
    """TTFT, ITL and READ GB/s against input length, one column per concurrency."""
    points = summary["points"]
    if len(points) < 2:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concs = sorted({p["concurrency"] for p in points})
    names = sorted({n for p in points for n in p["deployments"]})
    rows = [
        ("median_ttft_ms", "TTFT p50 (ms)"),
        ("median_itl_ms", "ITL p50 (ms)"),
        ("read_gbps", "READ GB/s (ours)"),
    ]
    fig, axes = plt.subplots(
        len(rows), len(concs), figsize=(5 * len(concs), 3.2 * len(rows)), squeeze=False
    )
    for col, conc in enumerate(concs):
        at = sorted((p for p in points if p["concurrency"] == conc), key=lambda p: p["input_len"])
        for row, (key, label) in enumerate(rows):
            ax = axes[row][col]
            for name in names:
                xs, ys, lo, hi = [], [], [], []
                for p in at:
                    s = p["deployments"].get(name, {}).get(key)
                    if s:
                        xs.append(p["input_len"])
                        ys.append(s["median"])
                        lo.append(s["median"] - s["min"])
                        hi.append(s["max"] - s["median"])
                if xs:
                    color = f"C{names.index(name) % 10}"  # one colour per deployment
                    ax.errorbar(
                        xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=name, color=color
                    )
            ax.set_title(f"{label}, concurrency {conc}", fontsize=9)
            ax.set_xlabel("input tokens")
            lengths = sorted({p["input_len"] for p in points})
            if lengths[-1] >= 4 * lengths[0]:  # 1k..32k: even spacing per doubling
                ax.set_xscale("log", base=2)
                ax.set_xticks(lengths, [f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths])
            ax.grid(alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(out: Path) -> dict[str, Any]:
    """summary.md, results.json (aggregate plus every run) and scaling.png under ``out``."""
    collected = collect(load_raw(out, "proxy.log"))  # for first_token_counts
    summary = aggregate(collected)
    (out / "summary.md").write_text(markdown(summary))
    (out / "results.json").write_text(
        json.dumps({**summary, "runs": collected["runs"]}, indent=1, default=str)
    )
    plot(summary, out / "scaling.png")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    write_report(Path(args[0]))
    print((Path(args[0]) / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
