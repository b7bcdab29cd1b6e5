"""Fault under load (issue #13 item 7): prefill SIGKILLed while ``vllm bench serve`` drives
a PD deployment, restarted, and the aftermath measured.

Timeline (wall clock, every ``--sample-interval`` s): each engine's ``/health`` and
metrics (running requests, requests served, KV cache usage), one small probe request per
second through the front, and the events (load start, kill, restart, rejoin, load end).
Afterwards: checked requests through the front (the restarted prefill serves again), every
engine's KV cache usage polled until zero, and our connector's ``vllm:kvshare_*`` series.
Verdicts: decode kept serving, nothing hung (the load ended, every probe answered within
its timeout), prefill rejoined and served, KV usage back to zero, connector series live.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.gpu.serving import checks, metrics
from benchmarks.gpu.serving.runs import Runner


def _probe(
    endpoint: str, model: str, vocab: int, timeout: float, seq: int, **extra: Any
) -> dict[str, Any]:
    """One short request (through the front, or straight to an engine): status, seconds
    (status None: no answer), and the ``kv_load_error`` decode returned, if any."""
    prompt = checks.prompt_ids(10_000 + seq, 1, 64, vocab)[0]
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    t0, wall = time.perf_counter(), time.time()
    try:
        resp = httpx.post(endpoint + "/v1/completions", json=body, timeout=timeout)
        kv = (resp.json().get("kv_transfer_params") or {}) if resp.status_code == 200 else {}
        return {"time": wall, "status": resp.status_code, "seconds": time.perf_counter() - t0,
                "kv_load_error": kv.get("kv_load_error"), "kv_transfer_params": kv or None,
                "body": None if resp.status_code == 200 else resp.text[:300]}  # fmt: skip
    except (httpx.HTTPError, ValueError) as exc:
        return {"time": wall, "status": None, "seconds": time.perf_counter() - t0,
                "error": type(exc).__name__}  # fmt: skip


def _health(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


class FaultRun:
    """Drives one deployment through load, kill, restart, checks and drain."""

    def __init__(self, runner: Runner) -> None:
        self.runner, self.args = runner, runner.args
        self.p = runner.planned[0]
        self.samples: list[dict[str, Any]] = []
        self.probes: list[dict[str, Any]] = []
        self.decode_probes: list[dict[str, Any]] = []  # straight to decode, no KV params
        self.stale: dict[str, Any] = {}
        self.events: list[dict[str, Any]] = []
        self.stop = threading.Event()

    def event(self, what: str, **info: Any) -> None:
        self.events.append({"time": time.time(), "event": what, **info})
        print(f"[faults] {what} {info or ''}", flush=True)

    def sample(self) -> None:
        engines = {}
        for e in self.p.deployment.engines:
            summary = metrics.engine_summary(metrics.scrape(e.url, timeout=1.0))
            summary["healthy"] = _health(e.url)
            summary.pop("kvshare", None)
            engines[e.name] = summary
        self.samples.append({"time": time.time(), "engines": engines})

    def _probe_loop(self, url: str, into: list[dict[str, Any]], offset: int) -> None:
        seq = offset
        while not self.stop.is_set():
            t0 = time.monotonic()
            into.append(_probe(url, self.args.served_model_name, self.runner.vocab,
                               self.args.probe_timeout, seq))  # fmt: skip
            seq += 1
            self.stop.wait(max(0.0, 1.0 - (time.monotonic() - t0)))

    def _prefill_only(self, url: str) -> dict[str, Any] | None:
        """A prefill-only request straight to prefill (as a proxy sends it): the
        kv_transfer_params decode would get, for blocks prefill now holds."""
        params = {"do_remote_decode": True, "do_remote_prefill": False}
        rec = _probe(url, self.args.served_model_name, self.runner.vocab,
                     self.args.probe_timeout, 99_999, max_tokens=1,
                     kv_transfer_params=params)  # fmt: skip
        return rec.get("kv_transfer_params")

    def _stale_load(self, decode_url: str, params: dict[str, Any] | None) -> None:
        """Decode asked to load from the prefill just killed: it must fail closed
        (compute locally, ``kv_load_error``, or an error status), promptly, not hang."""
        if not params:
            self.stale = {"skipped": "prefill gave no kv_transfer_params"}
            return
        rec = _probe(decode_url, self.args.served_model_name, self.runner.vocab,
                     self.args.probe_timeout, 99_999, kv_transfer_params=params)  # fmt: skip
        rec.pop("kv_transfer_params", None)
        self.stale = rec
        self.event(
            "stale load answered",
            status=rec["status"],
            seconds=round(rec["seconds"], 2),
            kv_load_error=rec.get("kv_load_error"),
        )

    def run(self) -> dict[str, Any]:
        a, runner, p = self.args, self.runner, self.p
        if not runner.start(p):
            return {"error": runner.broken.get(p.name)}
        runner.warmup(p)
        victim = next(e for e in p.deployment.engines if e.role == "prefill")
        decode = next(e for e in p.deployment.engines if e.role == "decode")
        proc = next(x for x in p.deployment.procs if x.name == victim.name)
        n = max(1, int(a.fault_rate * a.load_seconds))
        run = dict(round=0, input_len=a.input_len[0], output_len=a.output_len,
                   concurrency=max(a.concurrency), num_prompts=n, request_rate=a.fault_rate,
                   seed=a.seed, file=f"bench/{p.name}_fault_load.json", warmup=False,
                   detailed=True)  # fmt: skip
        load = threading.Thread(target=runner.bench, args=(p, run), daemon=True)
        probers = [
            threading.Thread(target=self._probe_loop, args=(p.endpoint, self.probes, 0),
                             daemon=True),
            threading.Thread(target=self._probe_loop,
                             args=(decode.url, self.decode_probes, 50_000), daemon=True),
        ]  # fmt: skip
        self.event("load start", prompts=n, rate=a.fault_rate)
        t0 = time.monotonic()
        load.start()
        for t in probers:
            t.start()
        killed = restarted = rejoined = load_done = None
        new_proc = None
        stale_params = None
        while load.is_alive() or (restarted and not rejoined and
                                  time.monotonic() - restarted < a.rejoin_timeout):  # fmt: skip
            now = time.monotonic() - t0
            if load_done is None and not load.is_alive():
                load_done = time.monotonic()
                self.event("load end")
            if killed is None and now >= a.kill_after:
                stale_params = self._prefill_only(victim.url)
                proc.signal_group(signal.SIGKILL)
                killed = time.monotonic()
                self.event("prefill killed", engine=victim.name, signal="SIGKILL")
                threading.Thread(target=self._stale_load, args=(decode.url, stale_params),
                                 daemon=True).start()  # fmt: skip
            if killed and restarted is None and time.monotonic() - killed >= a.restart_after:
                new_proc = p.deployment._spawn(f"{victim.name}-restarted", victim.argv, victim.env)
                restarted = time.monotonic()
                self.event("prefill restarted", engine=victim.name, pid=new_proc.pid)
            if restarted and rejoined is None and _health(victim.url):
                rejoined = time.monotonic()
                self.event("prefill rejoined", seconds_after_restart=round(rejoined - restarted, 1))
            if new_proc is not None and not new_proc.alive() and rejoined is None:
                self.event("restarted prefill exited", log=str(new_proc.log_path))
                break
            self.sample()
            time.sleep(a.sample_interval)
        load.join(timeout=a.bench_timeout)
        if load_done is None:
            self.event("load end", still_running=load.is_alive())
        self.stop.set()
        for t in probers:
            t.join(timeout=a.probe_timeout + 5)
        after = {}
        if rejoined:
            prompts = checks.prompt_ids(a.seed + 4242, 8, min(a.input_len[0], 1024), runner.vocab)
            records = checks.send_checks(p.endpoint, a.served_model_name, prompts, 8, 4, 120.0)
            after = checks.judge(records, 8)
            self.event("checks after rejoin", ok=after["ok"], of=after["requests"])
        drained = self.drain()
        final = {e.name: _raw_kvshare(e.url) for e in p.deployment.engines}
        return {"events": self.events, "samples": self.samples, "probes": self.probes,
                "decode_probes": self.decode_probes, "stale_load": self.stale,
                "after_rejoin": after, "drained_s": drained, "final_kvshare": final,
                "bench_file": run["file"]}  # fmt: skip

    def drain(self) -> float | None:
        """Seconds until every engine's KV cache usage reads zero (None: not within
        --drain-timeout); samples keep going meanwhile."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.args.drain_timeout:
            self.sample()
            usage = [e.get("kv_cache_usage") for e in self.samples[-1]["engines"].values()]
            if usage and all(u == 0 for u in usage):
                self.event("kv usage zero on every engine")
                return time.monotonic() - t0
            time.sleep(1.0)
        self.event("kv usage not zero", usage=self.samples[-1]["engines"] if self.samples else None)
        return None


def _raw_kvshare(url: str) -> dict[str, float] | None:
    """Our connector's series on one engine (None: it does not answer)."""
    series = metrics.scrape(url, timeout=3.0)
    if series is None:
        return None
    return {k: v for k, v in series.items() if k.startswith("vllm:kvshare_")}


# ---- pure parts: alignment, timeline, verdicts, markdown (tested on CPU) --------------------


def bench_requests(result: dict[str, Any], end_wall: float) -> list[dict[str, Any]]:
    """Per request of a ``--save-detailed`` result: approximate wall start (vLLM records
    perf_counter starts; the run's first request is placed at its end minus its duration,
    within about a second), success, error."""
    starts = result.get("start_times") or []
    errors = result.get("errors") or [""] * len(starts)
    ttfts = result.get("ttfts") or [None] * len(starts)
    itls = result.get("itls") or [[]] * len(starts)
    if not starts:
        return []
    first = min(starts)
    origin = end_wall - float(result.get("duration") or 0.0)
    return [
        {"time": origin + (s - first), "ok": not err, "error": (err or "")[:200], "ttft": t,
         "latency": (t + sum(i or [])) if t is not None and not err else None}
        for s, err, t, i in zip(starts, errors, ttfts, itls, strict=False)
    ]  # fmt: skip


def bins(items: list[dict[str, Any]], t0: float, width: float) -> dict[int, dict[str, int]]:
    """Items with ``time`` and ``ok`` counted per ``width``-second bin from ``t0``."""
    out: dict[int, dict[str, int]] = {}
    for it in items:
        k = int((it["time"] - t0) // width)
        slot = out.setdefault(k, {"ok": 0, "failed": 0})
        slot["ok" if it["ok"] else "failed"] += 1
    return dict(sorted(out.items()))


def _at(events: list[dict[str, Any]], what: str) -> float | None:
    return next((e["time"] for e in events if e["event"] == what), None)


def verdicts(data: dict[str, Any], requests: list[dict[str, Any]], probe_timeout: float,
             decode: str, prefill: str) -> dict[str, Any]:  # fmt: skip
    """The five questions of the fault test, each with what answers it. "Decode kept
    serving": decode stayed healthy, answered plain requests sent straight to it all along,
    and a load naming the killed prefill was answered promptly (fail closed: computed
    locally with ``kv_load_error``, or an error status). Requests through the front fail
    while the only prefill is down (the proxy has nowhere to prefill): evidence, not a
    verdict."""
    events, samples = data["events"], data["samples"]
    probes = data["probes"] + data.get("decode_probes", [])
    killed = _at(events, "prefill killed") or 0.0
    end = _at(events, "load end")
    after_kill = [r for r in requests if r["time"] >= killed]
    in_flight = [r for r in requests if r["time"] < killed <= r["time"] + (r["latency"] or 0)]
    decode_up = [s["engines"].get(decode, {}).get("healthy") for s in samples
                 if s["time"] >= killed]  # fmt: skip
    direct = [p for p in data.get("decode_probes", []) if p["time"] >= killed]
    stale = data.get("stale_load") or {}
    stale_ok = "skipped" in stale or (
        stale.get("status") is not None and stale.get("seconds", 1e9) < probe_timeout
    )
    hung = [p for p in probes if p["status"] is None and p["seconds"] >= probe_timeout - 0.5]
    load_ended = end is not None and not next(
        (e.get("still_running") for e in events if e["event"] == "load end"), False
    )
    final = data.get("final_kvshare") or {}
    dec = final.get(decode) or {}
    pre = final.get(prefill) or {}
    after = data.get("after_rejoin") or {}
    return {
        "decode_kept_serving": {
            "ok": bool(decode_up) and all(decode_up) and all(p["status"] == 200 for p in direct)
            and stale_ok,
            "decode_healthy_samples": f"{sum(map(bool, decode_up))}/{len(decode_up)}",
            "direct_decode_probes_ok": f"{sum(p['status'] == 200 for p in direct)}/{len(direct)}",
            "stale_load": {k: stale.get(k) for k in ("status", "seconds", "kv_load_error",
                                                      "body", "skipped") if stale.get(k)},
            "in_flight_at_kill": f"{sum(r['ok'] for r in in_flight)}/{len(in_flight)} ok",
            "front_requests_after_kill_ok": f"{sum(r['ok'] for r in after_kill)}/"
                                            f"{len(after_kill)}",
        },
        "no_hang": {"ok": load_ended and not hung, "load_ended": load_ended,
                    "probes": len(probes), "probes_without_answer": len(hung)},
        "prefill_rejoined": {
            "ok": _at(events, "prefill rejoined") is not None and after.get("requests", 0) > 0
            and after.get("ok") == after.get("requests"),
            "checks_after": f"{after.get('ok', 0)}/{after.get('requests', 0)}",
            "problems": after.get("problems", [])[:5],
        },
        "kv_usage_zero": {"ok": data.get("drained_s") is not None,
                          "seconds": data.get("drained_s")},
        "connector_series_live": {
            "ok": (metrics.total(dec, "vllm:kvshare_read_seconds_count") or 0) > 0,
            "decode": {k.removeprefix("vllm:kvshare_"): v for k, v in dec.items()
                       if k.endswith(("_total", "_count"))},
            "prefill": {k.removeprefix("vllm:kvshare_"): v for k, v in pre.items()
                        if k.endswith(("_total", "_count"))},
        },
    }  # fmt: skip


def markdown(summary: dict[str, Any]) -> str:
    lines = ["# Fault under load: prefill SIGKILLed, restarted", ""]
    lines += [f"- {k}: {v}" for k, v in summary.get("setup", {}).items()]
    lines += ["", "| check | result | evidence |", "|---|---|---|"]
    for name, v in summary["verdicts"].items():
        ev = {k: x for k, x in v.items() if k != "ok"}
        lines.append(f"| {name} | {'PASS' if v['ok'] else 'FAIL'} | `{json.dumps(ev)}` |")
    lines += ["", "## Events (s from load start)", ""]
    t0 = summary["t0"]
    lines += [f"- {e['time'] - t0:7.1f}  {e['event']}" for e in summary["events"]]
    lines += ["", "## Requests per 2 s bin (vllm bench serve / probes), s from kill", "",
              "| bin | bench ok | bench failed | front probes ok | failed | decode probes ok "
              "| failed |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    b, pr = summary["bench_bins"], summary["probe_bins"]
    dp = summary.get("decode_probe_bins", {})
    for k in sorted({*b, *pr, *dp}, key=int):
        cells = [c.get(x, 0) for c in (b.get(k, {}), pr.get(k, {}), dp.get(k, {}))
                 for x in ("ok", "failed")]  # fmt: skip
        lines.append(f"| {int(k) * 2:+d} | " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


def summarize(data: dict[str, Any], result: dict[str, Any] | None, end_wall: float,
              probe_timeout: float, decode: str, prefill: str) -> dict[str, Any]:  # fmt: skip
    """Verdicts, binned timeline and events from the raw fault data (and the bench JSON)."""
    requests = bench_requests(result or {}, end_wall)
    killed = _at(data["events"], "prefill killed") or (data["events"] or [{"time": 0}])[0]["time"]
    probes = [{"time": p["time"], "ok": p["status"] == 200 and not p.get("kv_load_error")}
              for p in data["probes"]]  # fmt: skip
    direct = [{"time": p["time"], "ok": p["status"] == 200} for p in data.get("decode_probes", [])]
    return {
        "verdicts": verdicts(data, requests, probe_timeout, decode, prefill),
        "events": data["events"],
        "t0": _at(data["events"], "load start") or killed,
        "bench": {k: (result or {}).get(k) for k in ("completed", "failed", "duration")},
        "bench_errors": sorted({r["error"] for r in requests if r["error"]})[:10],
        "bench_bins": {str(k): v for k, v in bins(requests, killed, 2.0).items()},
        "probe_bins": {str(k): v for k, v in bins(probes, killed, 2.0).items()},
        "decode_probe_bins": {str(k): v for k, v in bins(direct, killed, 2.0).items()},
    }


def run_faults(runner: Runner, out: Path) -> int:
    """The whole fault test; writes raw/faults.json, faults.md and faults.json under OUT."""
    a = runner.args
    fault = FaultRun(runner)
    data = fault.run()
    raw = runner.raw
    (raw / "faults.json").write_text(json.dumps(data, indent=1, default=str))
    if "error" in data:
        print(f"[faults] deployment did not start: {data['error']}", flush=True)
        return 1
    result_path = raw / data["bench_file"]
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    end_wall = next((r["end"] for r in _manifest(raw) if r["file"] == data["bench_file"]),
                    time.time())  # fmt: skip
    engines = fault.p.deployment.engines
    decode = next(e.name for e in engines if e.role == "decode")
    prefill = next(e.name for e in engines if e.role == "prefill")
    summary = summarize(data, result, end_wall, a.probe_timeout, decode, prefill)
    summary["setup"] = {"deployment": fault.p.name, "front": fault.p.router,
                        "kill_after_s": a.kill_after, "restart_after_s": a.restart_after,
                        "load": f"{a.fault_rate} req/s, input {a.input_len[0]}, "
                                f"output {a.output_len}"}  # fmt: skip
    (out / "faults.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "faults.md").write_text(markdown(summary))
    return 0 if all(v["ok"] for v in summary["verdicts"].values()) else 1


def _manifest(raw: Path) -> list[dict[str, Any]]:
    path = raw / "runs.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
