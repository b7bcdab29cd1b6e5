#!/usr/bin/env python3
"""Where a PD request's time to first token went, request by request, from both sides.

Our proxy logs each request as it hands the decode leg over: when prefill answered (and
how long its leg took). Decode's ``read_log`` has, for the same request, the wall time of
its report and the load's timeline from decode's order. Joined by request id (vLLM builds
its own from the proxy's ``X-Request-Id``), each request splits into: prefill's leg, the
way from prefill's answer to decode's order (the proxy, decode's server, its wait for a
step), decode's order to the claim, the load, and the rest of the step it landed in.
Per deployment and point (the runs' windows in ``runs.jsonl``): p50 / p90 of each span,
beside the bench's TTFT p50; what the spans leave of it is decode's first token on its
way to the client.

    python -m lab.benchmarks.gpu.ttft_split OUT      (a serving run's OUT: raw/ or raw.tar.gz)

The proxy's log times are its host's local time; the GPU hosts run on UTC, and a join
whose clocks disagree by more than a minute is refused rather than reported.
"""

from __future__ import annotations

import datetime
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from lab.benchmarks.gpu.read_timeline import percentile
from lab.benchmarks.gpu.serving_report import load_raw

#: The proxy's line when it hands over the decode leg (older runs have no "prefill="), or
#: streams prefill's first token (logged as prefill answers: no decode time in it).
_PROXY = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO \S+ req=(\S+) .*?prefill ([\d.]+) ms, "
    r"(?:decode (?:stream opened|done) ([\d.]+) ms|first token from prefill)"
)
_VLLM_ID = re.compile(r"^(?:chat)?cmpl-(.+)-\d+-[0-9a-f]+$")
SPANS = ("prefill leg", "prefill answered -> decode order", "order -> claimed",
         "claimed -> in place", "in place -> reported")  # fmt: skip


def proxy_requests(log: str) -> dict[str, tuple[float, float]]:
    """Request id -> (wall time prefill answered, prefill leg in s), from a proxy log."""
    out = {}
    for line in log.splitlines():
        m = _PROXY.match(line)
        if not m:
            continue
        when = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
        logged = when.replace(tzinfo=datetime.UTC).timestamp()
        out[m.group(2)] = (logged - float(m.group(4) or 0) / 1e3, float(m.group(3)) / 1e3)
    return out


def proxy_id(vllm_request_id: str) -> str:
    m = _VLLM_ID.match(vllm_request_id)
    return m.group(1) if m else vllm_request_id


def split(read: dict[str, Any], answered: float, leg: float) -> dict[str, float] | None:
    """One request's spans in ms (None: its read log has no timeline)."""
    t = read.get("timeline") or {}
    if "reported" not in t or "claimed" not in t:
        return None
    order = read["time"] - t["reported"]  # the record is written when the load is reported
    in_place = t.get("verified", t.get("landed", t["reported"]))
    spans = (leg, order - answered, t["claimed"], in_place - t["claimed"],
             t["reported"] - in_place)  # fmt: skip
    return {name: v * 1e3 for name, v in zip(SPANS, spans, strict=True)}


def table(files: dict[str, bytes]) -> str:
    """The markdown table of a run's raw files (path under raw/ -> bytes)."""
    runs = [json.loads(x) for x in files["runs.jsonl"].decode().splitlines() if x.strip()]
    runs = [r for r in runs if "start" in r and not r.get("warmup") and not r.get("skipped")]
    deployments = json.loads(files["deployments.json"])
    rows: dict[tuple[str, int, int], list[dict[str, float]]] = defaultdict(list)
    ttft: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    for run in runs:
        result = files.get(run["file"])
        if result is not None and run.get("rc") == 0:
            key = (run["deployment"], run["input_len"], run["concurrency"])
            ttft[key].append(json.loads(result)["median_ttft_ms"])
    gaps = []
    for name, info in deployments.items():
        log = files.get(f"logs/{name}/proxy.log")
        if log is None or not info.get("read_logs"):
            continue
        proxy = proxy_requests(log.decode(errors="replace"))
        for path in info["read_logs"]:
            for line in files.get(path, b"").decode(errors="replace").splitlines():
                try:
                    read = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a killed engine
                seen = proxy.get(proxy_id(read.get("request_id", "")))
                when = read.get("time", 0)
                run = next((r for r in runs if r["deployment"] == name
                            and r["start"] <= when <= r["end"] + 1), None)  # fmt: skip
                spans = split(read, *seen) if seen and run else None
                if spans:
                    gaps.append(spans[SPANS[1]])
                    rows[(name, run["input_len"], run["concurrency"])].append(spans)
    if not rows:
        return "no request joined: no proxy log or no read log with timelines"
    skew = statistics.median(gaps) / 1e3
    if abs(skew) > 60:
        raise SystemExit("the proxy's clock and decode's disagree by more than a minute "
                         f"(median {skew:.0f} s): not in UTC?")  # fmt: skip
    head = ["deployment", "input x concurrency", "requests", *SPANS, "TTFT p50 (bench)",
            "left: reported -> first token"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for (name, length, conc), reqs in sorted(rows.items(), key=lambda kv: kv[0][1:] + kv[0][:1]):
        per_span = [[r[s] for r in reqs] for s in SPANS]
        cells = [f"{percentile(v, 0.5):.1f} / {percentile(v, 0.9):.1f}" for v in per_span]
        bench = ttft.get((name, length, conc))
        spent = sum(percentile(v, 0.5) for v in per_span)
        tail = (f"{statistics.median(bench):.1f} | {statistics.median(bench) - spent:.1f}"
                if bench else "- | -")  # fmt: skip
        lines.append(f"| {name} | {length} x {conc} | {len(reqs)} | " + " | ".join(cells)
                     + f" | {tail} |")  # fmt: skip
    return ("ms, p50 / p90 per span; the last column is the bench's TTFT p50 less the spans'"
            " p50s\n\n" + "\n".join(lines))  # fmt: skip


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(table(load_raw(Path(argv[0]), "proxy.log")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
