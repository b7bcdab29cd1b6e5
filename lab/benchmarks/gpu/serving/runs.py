"""Running the serving benchmark: start deployments, warm them up with checked generations,
timed ``vllm bench serve`` runs in rotated rounds, engine metrics before and after, and
always stop what was started."""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvshare_connector.toolkit.procs import LaunchError
from lab.benchmarks.gpu.serving import checks, metrics
from lab.benchmarks.gpu.serving.client import BenchClient, bench_options
from lab.benchmarks.gpu.serving.deployments import Planned


class Runner:
    """Deployments, benches and the manifest ``runs.jsonl`` (one line per run, with its
    wall-clock window so our read_log's READs are attributed to the run they fell in)."""

    def __init__(
        self, args: argparse.Namespace, planned: list[Planned], tokenizer: Path, raw: Path,
        client: BenchClient, vocab: int,
    ) -> None:  # fmt: skip
        self.args, self.planned, self.tokenizer, self.raw = args, planned, tokenizer, raw
        self.client, self.vocab = client, vocab
        self.up: list[Planned] = []
        self.broken: dict[str, str] = {}
        self.failures = 0
        self.t0 = time.monotonic()
        self.check_records: dict[str, list[dict[str, Any]]] = {}
        self.durations: list[float] = []  # seconds of the timed runs so far
        # (input_len, concurrency) -> (prompts, seconds) of each run there, shape warmup
        # included: what the next run at that point will take
        self.at_point: dict[tuple[int, int], list[tuple[int, float]]] = {}

    # -- deployments ---------------------------------------------------------------------

    def start(self, p: Planned) -> bool:
        if p.name in self.broken:
            return False
        t0 = time.monotonic()
        try:
            p.deployment.start()
        except LaunchError as exc:
            self.broken[p.name] = str(exc).splitlines()[0]
            print(f"[bench] {p.name} failed to start: {exc}", flush=True)
            return False
        self.up.append(p)
        print(f"[bench] {p.name} up at {p.endpoint} in {time.monotonic() - t0:.0f}s", flush=True)
        self.event(p.name, "up", seconds=round(time.monotonic() - t0, 1))
        return True

    def stop(self, p: Planned) -> None:
        if p in self.up:
            self.snapshot(p, "end")
        p.deployment.stop()
        if p in self.up:
            self.up.remove(p)

    def stop_all(self) -> None:
        for p in reversed(list(self.up)):
            self.stop(p)

    def start_all(self) -> None:
        # A lone engine first when vLLM compiles: it fills the compile cache, so the
        # engines started together after it find it instead of compiling into it at once.
        # Eager engines compile nothing (a lone first start only cost ~65 s of each run).
        ordered = sorted(self.planned, key=lambda p: p.kind != "colocated")
        first, rest = ([], ordered) if self.args.enforce_eager else (ordered[:1], ordered[1:])
        for p in first:
            self.start(p)
        if not self.args.kv_cache_gib:
            for p in rest:
                self.start(p)
            return
        # A fixed KV size (no memory profiling): the other deployments start together.
        with ThreadPoolExecutor(max_workers=max(1, len(rest))) as pool:
            list(pool.map(self.start, rest))
        self.up.sort(key=self.planned.index)

    def event(self, name: str, what: str, **info: Any) -> None:
        rec = {"time": time.time(), "deployment": name, "event": what, **info}
        with open(self.raw / "events.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    def snapshot(self, p: Planned, tag: str) -> None:
        """Each engine's requests served, KV usage and our connector's series, to
        engine_metrics.jsonl (shows e.g. that both decodes behind a router served)."""
        engines = {
            e.name: metrics.engine_summary(metrics.scrape(e.url)) for e in p.deployment.engines
        }
        rec = {"time": time.time(), "deployment": p.name, "tag": tag, "engines": engines}
        with open(self.raw / "engine_metrics.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    # -- warmup with checks --------------------------------------------------------------

    def warmup(self, p: Planned) -> None:
        """A handful of greedy requests (the same prompts for every deployment), checked."""
        a = self.args
        if a.warmup_requests <= 0 or p.name in self.broken:
            return
        length = min(min(a.input_len), a.warmup_len)
        prompts = checks.prompt_ids(a.seed + 777, a.warmup_requests, length, self.vocab)
        t0 = time.monotonic()
        records = checks.send_checks(
            p.endpoint, a.served_model_name, prompts, a.warmup_tokens,
            min(a.warmup_requests, max(a.concurrency)), a.ready_timeout,
        )  # fmt: skip
        verdict = checks.judge(records, a.warmup_tokens)
        self.check_records[p.name] = records
        out = {"deployment": p.name, "input_len": length, "max_tokens": a.warmup_tokens,
               **verdict, "records": records}  # fmt: skip
        (self.raw / "checks").mkdir(exist_ok=True)
        (self.raw / "checks" / f"{p.name}.json").write_text(json.dumps(out, indent=1))
        print(f"[bench] {p.name} warmup: {verdict['ok']}/{verdict['requests']} ok in "
              f"{time.monotonic() - t0:.0f}s {verdict['problems'][:3]}", flush=True)  # fmt: skip
        self.snapshot(p, "after-warmup")

    def shape_warmup(self, p: Planned) -> None:
        """One untimed wave per point (``concurrency`` prompts of each input length) before
        the timed rounds: a deployment's first run at a new batch shape paid seconds of
        one-time work (2026-12-03b: whichever deployment ran a point first in round 0 had
        a TTFT p99 of 2.3-3.4 s there). ``--shape-warmup-len`` caps the prompts' length:
        the batch shapes are the concurrency's and the chunked-prefill budget's, and a
        32k x 64 wave took ~110 s per deployment (2026-12-04). In runs.jsonl as
        ``warmup``; the report skips them."""
        a = self.args
        if not a.shape_warmup or p.name in self.broken:
            return
        cap = a.shape_warmup_len or max(a.input_len)
        lengths = sorted({min(length, cap) for length in a.input_len})
        for length in lengths:
            for conc in a.concurrency:
                self.bench(p, dict(round=-1, input_len=length, output_len=a.output_len,
                                   concurrency=conc, num_prompts=conc, seed=a.seed + 555,
                                   file=f"bench/warmup/{p.name}_in{length}_c{conc}.json",
                                   warmup=True))  # fmt: skip
        self.snapshot(p, "after-warmup")  # the engines' request counts start from here

    def write_agreement(self) -> None:
        if "colocated" in self.check_records:
            agree = checks.agreement(self.check_records, "colocated")
            (self.raw / "checks" / "agreement.json").write_text(json.dumps(agree, indent=1))

    # -- timed runs ----------------------------------------------------------------------

    def left(self) -> float:
        """Seconds left of --time-budget (inf without one)."""
        if not self.args.time_budget:
            return float("inf")
        return self.args.time_budget - (time.monotonic() - self.t0)

    def bench(self, p: Planned, run: dict[str, Any]) -> None:
        """One ``vllm bench serve``, bounded by --bench-timeout and the time budget."""
        if p.name in self.broken:
            return
        dead = p.deployment.dead()
        if dead:
            self.broken[p.name] = f"{dead[0].name} exited (log {dead[0].log_path})"
            print(f"[bench] {p.name}: {self.broken[p.name]}; skipping its runs", flush=True)
            return
        stem = Path(run["file"]).stem
        options = bench_options(self.args, p.endpoint, p.name, self.tokenizer, run, self.raw)
        (self.raw / run["file"]).parent.mkdir(parents=True, exist_ok=True)
        run = {**run, "deployment": p.name, "kind": p.kind, "router": p.router,
               "start": time.time()}  # fmt: skip
        timeout = max(5.0, min(self.args.bench_timeout, self.left()))
        rc = self.client.run(options, self.raw / "logs" / "bench" / f"{stem}.log", timeout)
        run.update(end=time.time(), rc=rc)
        if rc != 0:
            self.failures += 1
        else:
            seconds = run["end"] - run["start"]
            if not run["warmup"]:
                self.durations.append(seconds)
            point = (run["input_len"], run["concurrency"])
            self.at_point.setdefault(point, []).append((run["num_prompts"], seconds))
        with open(self.raw / "runs.jsonl", "a") as f:
            f.write(json.dumps(run) + "\n")
        if not run["warmup"]:
            self.snapshot(p, f"run:{run['file']}")  # this run's engine means: since the last
        print(f"[bench] {stem}: rc {rc} in {run['end'] - run['start']:.0f}s", flush=True)

    def need(self, run: dict[str, Any]) -> float:
        """Seconds to allow for ``run``: the slowest run at its point so far, scaled to its
        prompts (else the slowest timed run anywhere, else 30), plus 5. Per point, so a
        budget too short for the next long point still runs the short ones after it (on
        2026-12-04 a 16k curve's 38 s runs at concurrency 64 stopped every later 10 s run
        at concurrency 1)."""
        seen = self.at_point.get((run["input_len"], run["concurrency"]))
        if seen:
            return max(s * run["num_prompts"] / max(n, 1) for n, s in seen) + 5.0
        return max(self.durations, default=30.0) + 5.0

    def skip(self, p: Planned, run: dict[str, Any], why: str) -> None:
        """A run not made (time budget): in the manifest, so the report says so."""
        rec = {**run, "deployment": p.name, "kind": p.kind, "router": p.router, "skipped": why}
        with open(self.raw / "runs.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    def runs_for(self, p: Planned, rnd: int) -> list[dict[str, Any]]:
        a = self.args
        out = []
        for i, length in enumerate(a.input_len):
            for j, conc in enumerate(a.concurrency):
                seed = a.seed + 1000 * rnd + 10 * i + j
                file = f"bench/{p.name}_r{rnd}_in{length}_c{conc}.json"
                n = a.num_prompts or max(a.min_prompts, conc * a.prompts_per_slot)
                out.append(dict(round=rnd, input_len=length, output_len=a.output_len,
                                concurrency=conc, num_prompts=n, seed=seed,
                                file=file, warmup=False))  # fmt: skip
        return out

    def run_rounds(self) -> None:
        """Every point once per deployment per round, the deployment order rotated."""
        order = list(self.planned)
        if not self.args.one_at_a_time:
            self.start_all()
            for p in order:
                self.warmup(p)
            self.write_agreement()
            for p in order:
                self.shape_warmup(p)
        for rnd in range(self.args.rounds):
            k = rnd % len(order)
            rotated = order[k:] + order[:k]
            print(f"[bench] round {rnd}: {[p.name for p in rotated]}", flush=True)
            if self.args.one_at_a_time:
                for p in rotated:
                    if self.start(p):
                        self.warmup(p)
                        self.shape_warmup(p)
                        for run in self.runs_for(p, rnd):
                            self.bench(p, run)
                    self.stop(p)
                continue
            points = list(zip(*(self.runs_for(p, rnd) for p in rotated), strict=True))
            for at_point in points:
                for p, run in zip(rotated, at_point, strict=True):
                    need = self.need(run)
                    if self.left() < need:
                        self.skip(
                            p, run, f"time budget ({self.left():.0f}s left, ~{need:.0f}s needed)"
                        )
                    else:
                        self.bench(p, run)
