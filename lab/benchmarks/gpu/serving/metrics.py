"""Prometheus text from ``/metrics`` of ``vllm serve``: parse it, keep the series the
benchmark reports (vLLM's request and KV-cache gauges, our connector's ``vllm:kvshare_*``).

Names as vLLM 0.26 registers them (vllm/v1/metrics/loggers.py): ``vllm:kv_cache_usage_perc``
(a 0-1 fraction despite the name), ``vllm:num_requests_running``/``_waiting``,
``vllm:request_success_total`` (by ``finished_reason``), ``vllm:prompt_tokens_total``; ours
(kvshare_connector/vllm/prometheus.py): ``vllm:kvshare_read_seconds`` / ``_read_bytes`` /
``_read_descriptors`` histograms and a ``vllm:kvshare_<counter>_total`` per counter.
"""

from __future__ import annotations

import re
from typing import Any

import httpx

#: vLLM's own latency histograms, kept as (sum, count): the delta of two snapshots is the
#: mean per engine over what happened between them (a decode's TTFT runs from the
#: arrival at its own server, so PD's decode leg shows apart from the prefill leg).
SECONDS = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
           "prefill": "vllm:request_prefill_time_seconds"}  # fmt: skip
PREEMPTIONS = "vllm:num_preemptions"  # a counter: ``_total`` in the exposition
PREEMPTIONS_TOTAL = PREEMPTIONS + "_total"
KEEP = (
    PREEMPTIONS,
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:kvshare_",
    *(f"{name}_{part}" for name in SECONDS.values() for part in ("sum", "count")),
)
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse(text: str, keep: tuple[str, ...] = KEEP) -> dict[str, float]:
    """``name{labels}`` -> value for series whose name starts with one of ``keep``; the
    labels are kept as written except vLLM's constant ``model_name``/``engine`` ones."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m or not m.group(1).startswith(keep):
            continue
        labels = [
            f'{k}="{v}"'
            for k, v in _LABEL.findall(m.group(2) or "")
            if k not in ("model_name", "engine")
        ]
        key = m.group(1) + ("{" + ",".join(labels) + "}" if labels else "")
        try:
            out[key] = out.get(key, 0.0) + float(m.group(3))
        except ValueError:
            continue
    return out


def total(series: dict[str, float], name: str) -> float | None:
    """Sum of every labelled series called ``name`` (None when there is none)."""
    vals = [v for k, v in series.items() if k == name or k.startswith(name + "{")]
    return sum(vals) if vals else None


def scrape(url: str, timeout: float = 3.0) -> dict[str, float] | None:
    """One engine's kept series, or None when it does not answer."""
    try:
        resp = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout)
    except httpx.HTTPError:
        return None
    return parse(resp.text) if resp.status_code == 200 else None


def engine_summary(series: dict[str, float] | None) -> dict[str, Any]:
    """What a table shows of one engine: requests served, KV usage, our connector's series."""
    if series is None:
        return {"up": False}
    ours = {
        k.removeprefix("vllm:kvshare_"): v
        for k, v in series.items()
        if k.startswith("vllm:kvshare_") and (k.endswith("_total") or k.endswith("_count"))
    }
    return {
        "up": True,
        "requests": total(series, "vllm:request_success_total"),
        "kv_cache_usage": total(series, "vllm:kv_cache_usage_perc"),
        "running": total(series, "vllm:num_requests_running"),
        "waiting": total(series, "vllm:num_requests_waiting"),
        "preemptions": total(series, PREEMPTIONS_TOTAL),
        "kvshare": ours,
        "seconds": {k: [total(series, f"{name}_sum"), total(series, f"{name}_count")]
                    for k, name in SECONDS.items()},
    }  # fmt: skip
