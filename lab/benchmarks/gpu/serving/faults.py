"""Fault under load (issues #13, #25): one engine of a PD deployment (the *victim*, prefill
or decode) hit while ``vllm bench serve`` drives it, then brought back, and the aftermath
measured.

How the fault lands (``--fault-action``, ``--fault-point``):

* ``kill`` with ``--fault-point NAME``: the victim starts with
  ``KVSHARE_FAILPOINTS="NAME=exit@K"`` and dies exactly there (inside the data path, after
  K hits: past the warm-up); the driver notices it ended (its process, or the failpoint's
  line in its log), kills what is left of its group, and restarts it without the failpoint.
  Not fired by ``--kill-after`` + 30 s: SIGKILLed and recorded as "did not fire".
* ``kill`` without a point: SIGKILL at ``--kill-after`` s of wall clock, then restarted.
* ``stop``: the victim's process group SIGSTOPped at ``--kill-after`` for
  ``--stop-seconds`` (longer than the handshake timeout), then SIGCONT; no restart.
* ``flood`` (prefill): from ``--kill-after`` for ``--stop-seconds``, a client without the
  secret floods the victim's side channel (``lab.tools.attacks.flood``) while decode claims
  through it; no restart.
* ``drop`` (decode, the decode that never comes): our proxy starts with the failpoint
  ``proxy.before_decode=fail*N@K`` (N: ``--fault-rate`` x ``--stop-seconds``): N requests
  past the warm-up get prefill's KV held and no decode leg (503, named); prefill's lease
  must free their blocks. "victim resumed" once the proxy logged all N.
* ``none``: no fault; "fault" and "victim resumed" are marked at ``--kill-after`` so the
  run reads as the others do. The fault-free reference of the fault matrix, and with small
  KV pools its small-pool case (prefill's holds fill its pool, decode preempts).

Timeline (every ``--sample-interval`` s): each engine's ``/health`` and metrics, one probe
per second through the front and one plain request per second straight to the survivor,
and the events. Before the load and after recovery the same greedy check prompts go through
the front (outputs compared: wrong KV shows as a different answer); afterwards every
engine's KV usage is polled until zero (a dead decode's blocks wait for prefill's lease).
Verdicts and numbers: fault_report.py.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from kvshare_connector.backends.options import ConnectorOptions
from kvshare_connector.common import failpoints
from kvshare_connector.toolkit.launcher import ServeConfig
from kvshare_connector.toolkit.procs import ManagedProcess
from lab.benchmarks.gpu.serving import checks, metrics
from lab.benchmarks.gpu.serving.deployments import Planned
from lab.benchmarks.gpu.serving.fault_report import good_request, markdown, summarize
from lab.benchmarks.gpu.serving.runs import Runner
from lab.tools import attacks

FIRE_GRACE_S = 30.0  # a failpoint not fired by --kill-after + this: SIGKILL instead
CHECK_PROMPTS = 8
#: After the victim rejoins, front probes go on until one is good (or this long), so the
#: time from "healthy" to the first good PD request is measured, not left to the load.
RECOVERY_WAIT_S = 30.0


def _probe(
    endpoint: str, model: str, vocab: int, timeout: float, seq: int,
    headers: dict[str, str] | None = None, **extra: Any,
) -> dict[str, Any]:  # fmt: skip
    """One short request (through the front, or straight to an engine): status, seconds
    (status None: no answer), and the ``kv_load_error`` decode returned, if any."""
    prompt = checks.prompt_ids(10_000 + seq, 1, 64, vocab)[0]
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    t0, wall = time.perf_counter(), time.time()
    try:
        resp = httpx.post(endpoint + "/v1/completions", json=body, timeout=timeout,
                          headers=headers)
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


def default_skip(args: Any) -> int:
    """Failpoint hits to let pass: the warm-up and the reference checks (each one request
    through the data path), then 10 more, so the fault lands under the load."""
    return args.warmup_requests + CHECK_PROMPTS + 10


def lease_seconds(args: Any) -> float:
    """Prefill's ``kv_lease_duration`` in this run (the connector's default 30 s)."""
    return float(json.loads(args.extra_config or "{}").get("kv_lease_duration", 30.0))


def drain_timeout(args: Any) -> float:
    """--drain-timeout, by default long enough for prefill's lease to free blocks a dead
    decode never released."""
    if args.drain_timeout is not None:
        return float(args.drain_timeout)
    return max(60.0, lease_seconds(args) + 30.0)


def drops(args: Any) -> int:
    """How many decode legs the ``drop`` action drops."""
    return max(1, round(args.fault_rate * args.stop_seconds))


def arm(planned: list[Planned], args: Any) -> None:
    """Before anything starts (and is described): the victim, only it, gets the failpoint
    (``drop``: the proxy in front of it)."""
    if args.fault_action == "drop":
        skip = args.fault_skip if args.fault_skip is not None else default_skip(args)
        planned[0].deployment.front_env[failpoints.ENV] = (
            f"proxy.before_decode=fail*{drops(args)}@{skip}")
        return
    point = args.fault_point
    if not point:
        return
    if point not in failpoints.POINTS:
        raise SystemExit(f"--fault-point {point!r}: one of {sorted(failpoints.POINTS)}")
    skip = args.fault_skip if args.fault_skip is not None else default_skip(args)
    victim = next(e for e in planned[0].deployment.engines if e.role == args.fault_victim)
    victim.env[failpoints.ENV] = f"{point}=exit@{skip}"


class FaultRun:
    """Drives one deployment through load, fault, recovery, checks and drain."""

    def __init__(self, runner: Runner) -> None:
        self.runner, self.args = runner, runner.args
        self.p = runner.planned[0]
        a = self.args
        engines = self.p.deployment.engines
        self.victim = next(e for e in engines if e.role == a.fault_victim)
        self.survivor = next(e for e in engines if e.role != a.fault_victim)
        self.decode = next(e for e in engines if e.role == "decode")
        self.skip = a.fault_skip if a.fault_skip is not None else default_skip(a)
        self.samples: list[dict[str, Any]] = []
        self.probes: list[dict[str, Any]] = []
        self.survivor_probes: list[dict[str, Any]] = []  # plain requests, no KV params
        self.stale: dict[str, Any] = {}
        self.resumed: float | None = None  # monotonic time of the SIGCONT (action stop)
        self.events: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self._log_offset = 0

    def event(self, what: str, **info: Any) -> None:
        self.events.append({"time": time.time(), "event": what, **info})
        print(f"[faults] {what} {info or ''}", flush=True)

    def sample(self) -> None:
        engines = {}
        for e in self.p.deployment.engines:
            summary = metrics.engine_summary(metrics.scrape(e.url, timeout=1.0))
            summary["healthy"] = _health(e.url)
            ours = summary.pop("kvshare", None) or {}
            summary["counters"] = {k: v for k, v in ours.items() if k.endswith("_total")}
            engines[e.name] = summary
        self.samples.append({"time": time.time(), "engines": engines})

    def _good_probe_since(self, mono: float) -> bool:
        """A front probe finished well after ``mono`` (a monotonic time)."""
        since = time.time() - (time.monotonic() - mono)
        return any(p["time"] + p["seconds"] >= since and good_request(p)
                   for p in list(self.probes))  # fmt: skip

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

    def _stale_load(self, params: dict[str, Any] | None) -> None:
        """Decode asked to load from the prefill just killed or stopped: it must fail
        closed (compute locally, ``kv_load_error``, or an error status), promptly."""
        if not params:
            self.stale = {"skipped": "prefill gave no kv_transfer_params"}
            return
        # Under the request id prefill answered for, as a PD proxy sends it.
        rid = {"X-Request-Id": str(params.get("remote_request_id"))}
        rec = _probe(self.decode.url, self.args.served_model_name, self.runner.vocab,
                     self.args.probe_timeout, 99_999, headers=rid,
                     kv_transfer_params=params)  # fmt: skip
        rec.pop("kv_transfer_params", None)
        self.stale = rec
        self.event("stale load answered", status=rec["status"],
                   seconds=round(rec["seconds"], 2), kv_load_error=rec.get("kv_load_error"))

    def _fired(self, proc: ManagedProcess) -> bool:
        """The armed failpoint fired: the victim's process ended, or its log says so (a
        vLLM engine core dies there; its API server may linger)."""
        if not proc.alive():
            return True
        try:
            with open(proc.log_path, "rb") as f:
                f.seek(self._log_offset)
                text = f.read()
        except OSError:
            return False
        marker = f"failpoint {self.args.fault_point}: exit".encode()
        found = marker in text
        self._log_offset += max(0, len(text) - len(marker))
        return found

    def _checks(self, tag: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The same greedy prompts through the front, one at a time (the same batch every
        time: outputs comparable before and after the fault)."""
        a = self.args
        prompts = checks.prompt_ids(a.seed + 4242, CHECK_PROMPTS, min(a.input_len[0], 1024),
                                    self.runner.vocab)  # fmt: skip
        records = checks.send_checks(self.p.endpoint, a.served_model_name, prompts, 8, 1, 120.0)
        verdict = checks.judge(records, 8)
        self.event(f"checks {tag}", ok=verdict["ok"], of=verdict["requests"])
        return records, verdict

    def _fault(self, proc: ManagedProcess, now: float) -> dict[str, Any] | None:
        """The fault, if it is due (or it fired): what happened, else None."""
        a, victim = self.args, self.victim
        info = {"victim": victim.role, "engine": victim.name}
        if a.fault_point:
            if self._fired(proc):
                proc.signal_group(signal.SIGKILL)  # what is left of it (orphaned workers)
                return {**info, "how": f"failpoint {a.fault_point}", "fired": True}
            if now >= a.kill_after + FIRE_GRACE_S:
                proc.signal_group(signal.SIGKILL)
                print(f"[faults] failpoint {a.fault_point} did not fire: SIGKILL", flush=True)
                return {**info, "how": f"SIGKILL (failpoint {a.fault_point} did not fire)",
                        "fired": False}  # fmt: skip
            return None
        if a.fault_action == "drop":
            if self._front_drops():
                return {**info, "how": f"proxy drops the decode leg of {drops(a)} requests",
                        "fired": True}  # fmt: skip
            if now >= a.kill_after + FIRE_GRACE_S:
                return {**info, "how": "proxy.before_decode did not fire", "fired": False}
            return None
        if now < a.kill_after:
            return None
        if a.fault_action == "none":
            return {**info, "how": "none (fault-free run)", "fired": True}
        if a.fault_action == "flood":
            port = int(victim.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
            threading.Thread(target=self._flood, args=(port,), daemon=True).start()
            return {**info, "how": f"side-channel flood on port {port}", "fired": True}
        stale = self._prefill_only(victim.url) if victim.role == "prefill" else None
        stop = a.fault_action == "stop"
        proc.signal_group(signal.SIGSTOP if stop else signal.SIGKILL)
        if stop:  # on a timer: sampling the stopped victim blocks the loop for seconds
            timer = threading.Timer(a.stop_seconds, self._resume, args=(proc,))
            timer.daemon = True
            timer.start()
        if victim.role == "prefill":
            threading.Thread(target=self._stale_load, args=(stale,), daemon=True).start()
        return {**info, "how": "SIGSTOP" if stop else "SIGKILL", "fired": True}

    def _front_drops(self) -> int:
        """Decode legs our proxy dropped so far (its failpoint's log lines)."""
        front = next((x for x in self.p.deployment.procs if x.name == "proxy"), None)
        try:
            text = Path(front.log_path).read_bytes() if front else b""
        except OSError:
            return 0
        return text.count(b"failpoint proxy.before_decode: fail")

    def _resume(self, proc: ManagedProcess) -> None:
        proc.signal_group(signal.SIGCONT)
        self.resumed = time.monotonic()
        self.event("victim resumed", engine=self.victim.name)

    def _flood(self, port: int) -> None:
        codes = attacks.flood(port, self.args.stop_seconds)
        self.event("flood ended", answers=dict(codes))

    def run(self) -> dict[str, Any]:
        a, runner, p = self.args, self.runner, self.p
        if not runner.start(p):
            return {"error": runner.broken.get(p.name)}
        runner.warmup(p)
        ref_records, _ = self._checks("before the load")
        victim = self.victim
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
                             args=(self.survivor.url, self.survivor_probes, 50_000), daemon=True),
        ]  # fmt: skip
        self.event("load start", prompts=n, rate=a.fault_rate)
        t0 = time.monotonic()
        load.start()
        for t in probers:
            t.start()
        fault = back = rejoined = load_done = None
        fired = True
        new_proc = None
        try:
            while True:
                mono = time.monotonic()
                if load_done is None and not load.is_alive():
                    load_done = mono
                    self.event("load end")
                if fault is None:
                    what = self._fault(proc, mono - t0)
                    if what is not None:
                        fault, fired = mono, what["fired"]
                        self.event("fault", **what)
                elif back is None and a.fault_action == "stop":
                    back = self.resumed  # set by the timer _fault started
                elif back is None and a.fault_action == "drop":
                    dropped = self._front_drops()
                    if dropped >= drops(a) or mono - fault >= a.rejoin_timeout:
                        back = mono
                        self.event("victim resumed", engine=victim.name, dropped=dropped)
                elif back is None and a.fault_action == "none":
                    back = mono
                    self.event("victim resumed", engine=victim.name, fault_free=True)
                elif back is None and a.fault_action == "flood":
                    if mono - fault >= a.stop_seconds:
                        back = mono
                        self.event("victim resumed", engine=victim.name)
                elif back is None and mono - fault >= a.restart_after:
                    env = {**victim.env, failpoints.ENV: ""}  # back without the failpoint
                    new_proc = p.deployment._spawn(f"{victim.name}-restarted", victim.argv, env)
                    back = mono
                    self.event("victim restarted", engine=victim.name, pid=new_proc.pid)
                if back and rejoined is None and _health(victim.url):
                    rejoined = time.monotonic()
                    self.event("victim rejoined", seconds_after_back=round(rejoined - back, 1))
                if new_proc is not None and not new_proc.alive() and rejoined is None:
                    self.event("restarted victim exited", log=str(new_proc.log_path))
                    break
                self.sample()
                waiting = (
                    fault is None
                    or back is None
                    or (rejoined is None and mono - back < a.rejoin_timeout)
                    or (
                        rejoined is not None
                        and not self._good_probe_since(rejoined)
                        and mono - rejoined < RECOVERY_WAIT_S
                    )
                )
                if not load.is_alive() and not waiting:
                    break
                time.sleep(a.sample_interval)
        finally:
            if a.fault_action == "stop":
                proc.signal_group(signal.SIGCONT)  # never leave it stopped
        load.join(timeout=a.bench_timeout)
        if load_done is None:
            self.event("load end", still_running=load.is_alive())
        self.stop.set()
        for t in probers:
            t.join(timeout=a.probe_timeout + 5)
        after_records: list[dict[str, Any]] = []
        after: dict[str, Any] = {}
        if rejoined:
            after_records, after = self._checks("after recovery")
        drained = self.drain()
        engines = p.deployment.engines
        final = {e.name: _raw_kvshare(e.url) for e in engines}
        usage = {k: v.get("kv_cache_usage") for k, v in self.samples[-1]["engines"].items()}
        fault_info = next((e for e in self.events if e["event"] == "fault"), {})
        return {"events": self.events, "samples": self.samples, "probes": self.probes,
                "survivor_probes": self.survivor_probes, "stale_load": self.stale,
                "reference_records": ref_records, "after_records": after_records,
                "after": after, "drained_s": drained, "usage_after_drain": usage,
                "final_kvshare": final, "bench_file": run["file"],
                "verify_kv": verifies(p.deployment.cfg),
                "fault": {"victim": victim.role, "engine": victim.name,
                          "survivor": self.survivor.name, "action": a.fault_action,
                          "point": a.fault_point, "skip": self.skip if a.fault_point else None,
                          "how": fault_info.get("how"), "fired": fired,
                          "roles": {e.name: e.role for e in engines}}}  # fmt: skip

    def drain(self) -> float | None:
        """Seconds until every engine's KV cache usage reads zero (None: not within the
        drain timeout); samples keep going meanwhile."""
        t0 = time.monotonic()
        limit = drain_timeout(self.args)
        while True:
            self.sample()
            usage = [e.get("kv_cache_usage") for e in self.samples[-1]["engines"].values()]
            if usage and all(u == 0 for u in usage):
                self.event("kv usage zero on every engine")
                return time.monotonic() - t0
            if time.monotonic() - t0 >= limit:
                break
            time.sleep(1.0)
        self.event("kv usage not zero", usage=self.samples[-1]["engines"])
        return None


def _raw_kvshare(url: str) -> dict[str, float] | None:
    """Our connector's series on one engine, and vLLM's preemption count (None: it does
    not answer)."""
    series = metrics.scrape(url, timeout=3.0)
    if series is None:
        return None
    return {k: v for k, v in series.items()
            if k.startswith("vllm:kvshare_") or k == metrics.PREEMPTIONS_TOTAL}  # fmt: skip


def run_faults(runner: Runner, out: Path) -> int:
    """The whole fault test; writes raw/faults.json, faults.md and faults.json under OUT."""
    a = runner.args
    fault = FaultRun(runner)
    data = fault.run()
    raw = runner.raw
    (raw / "faults.json").write_text(json.dumps(data, indent=1, default=str))
    if "error" in data:
        print(f"[faults] deployment did not start: {data['error']}", flush=True)
        (out / "faults.json").write_text(json.dumps({"error": data["error"]}, indent=1))
        return 1
    result_path = raw / data["bench_file"]
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    entry = next((r for r in _manifest(raw) if r["file"] == data["bench_file"]), {})
    end_wall = entry.get("end", time.time())
    summary = summarize(data, result, end_wall, a.probe_timeout, entry.get("output_len"))
    proxy_log = raw / "logs" / fault.p.name / "proxy.log"  # our proxy: one side was down
    text = proxy_log.read_text(errors="replace") if proxy_log.exists() else ""
    summary["measured"]["served_alone"] = {side: text.count(f"served by {side} alone")
                                           for side in ("decode", "prefill")}  # fmt: skip
    summary["setup"] = {"deployment": fault.p.name, "front": fault.p.router,
                        "victim": a.fault_victim, "action": a.fault_action,
                        "point": a.fault_point, "kill_after_s": a.kill_after,
                        "restart_after_s": a.restart_after, "stop_s": a.stop_seconds,
                        "load": f"{a.fault_rate} req/s for {a.load_seconds} s, input "
                                f"{a.input_len[0]}, output {a.output_len}"}  # fmt: skip
    (out / "faults.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "faults.md").write_text(markdown(summary))
    ok = all(v["ok"] is not False for v in summary["verdicts"].values())  # None: not judged
    return 0 if ok and data["fault"]["fired"] else 1


def verifies(cfg: ServeConfig) -> bool:
    """Whether the deployment's decode checks its loads: ``verify_kv`` as the connector reads
    it from the extra config and the engines' environment (on by default with NIXL, off with
    LMCache unless asked for)."""
    o = ConnectorOptions.parse(cfg.kv_extra_config, cfg.env)
    return o.verifies if o.backend == "nixl" else o.verify_kv is True


def _manifest(raw: Path) -> list[dict[str, Any]]:
    path = raw / "runs.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
