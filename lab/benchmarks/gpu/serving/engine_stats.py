"""What the serving benchmark reads from its raw files besides vllm bench serve's results:
JSON-lines files, and the engines' metrics snapshots (``engine_metrics.jsonl``, written
by ``runs.Runner.snapshot``): requests each engine served, verify_kv's counts, and vLLM's
own per-engine latency means per run."""

from __future__ import annotations

import json
from typing import Any


def jsonl(data: bytes | None) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file, a line cut short skipped."""
    rows = []
    for line in (data or b"").decode(errors="replace").splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a killed engine
    return rows


def engine_requests(files: dict[str, bytes]) -> dict[str, dict[str, Any]]:
    """Per deployment and engine, requests it served between the warmup and the end (from
    ``vllm:request_success_total``): shows how a router spread the load."""
    first: dict[tuple[str, str], float] = {}
    last: dict[tuple[str, str], float] = {}
    for snap in jsonl(files.get("engine_metrics.jsonl")):
        for engine, summary in snap["engines"].items():
            key = (snap["deployment"], engine)
            if summary.get("requests") is None:
                continue
            if snap["tag"] == "after-warmup":
                first[key] = summary["requests"]
            else:
                last[key] = summary["requests"]
    out: dict[str, dict[str, Any]] = {}
    for (dep, engine), value in sorted(last.items()):
        out.setdefault(dep, {})[engine] = value - first.get((dep, engine), 0.0)
    return out


def verify_counts(files: dict[str, bytes]) -> dict[str, dict[str, float]]:
    """Per deployment, verify_kv's loads verified and refused over its engines' lifetimes
    (warmup included: every one is an untampered load), from the last snapshot of each."""
    last: dict[tuple[str, str], dict[str, float]] = {}
    for snap in jsonl(files.get("engine_metrics.jsonl")):
        for engine, summary in snap["engines"].items():
            if summary.get("kvshare"):
                last[(snap["deployment"], engine)] = summary["kvshare"]
    out: dict[str, dict[str, float]] = {}
    for (dep, _), ours in sorted(last.items()):
        row = out.setdefault(dep, {"verified": 0.0, "failures": 0.0})
        row["verified"] += ours.get("verified_loads_total", 0.0)
        row["failures"] += ours.get("verify_failures_total", 0.0)
    return {dep: row for dep, row in out.items() if row["verified"] or row["failures"]}


def engine_seconds(files: dict[str, bytes]) -> dict[str, dict[str, dict[str, float]]]:
    """Per timed run (its bench file), per engine, vLLM's mean TTFT / queue / prefill time
    in ms over the run: the histograms' delta between the snapshot after the run and the
    deployment's snapshot before it."""
    before: dict[str, dict[str, Any]] = {}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for snap in jsonl(files.get("engine_metrics.jsonl")):
        dep, then = snap["deployment"], before.get(snap["deployment"])
        before[dep] = snap["engines"]
        if not snap["tag"].startswith("run:") or then is None:
            continue
        per: dict[str, dict[str, float]] = {}
        for engine, now in snap["engines"].items():
            old = (then.get(engine) or {}).get("seconds") or {}
            for key, (sum1, n1) in (now.get("seconds") or {}).items():
                sum0, n0 = old.get(key) or (None, None)
                if None not in (sum1, n1, sum0, n0) and n1 > n0:
                    per.setdefault(engine, {})[key] = (sum1 - sum0) / (n1 - n0) * 1e3
        out[snap["tag"].removeprefix("run:")] = per
    return out
