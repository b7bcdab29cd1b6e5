"""The scaling curve: prompt length x concurrency, one round, few prompts per point, under
a total time bound. Points run shortest first, every deployment at a point before the next
point (order rotated per point), so a cut leaves whole comparisons; a point whose estimated
time no longer fits is written to the manifest as skipped and the report lists it as not
reached."""

from __future__ import annotations

import time
from typing import Any

from lab.benchmarks.gpu.serving.runs import Runner

LENGTHS = [1024, 4096, 16384, 32768]
CONCURRENCY = [1, 16, 64]


def prompts_at(concurrency: int, per_slot: int, minimum: int) -> int:
    """Enough prompts to fill every concurrency slot ``per_slot`` times, at least ``minimum``
    (a concurrency-1 point still gives a few TTFT samples)."""
    return max(minimum, concurrency * per_slot)


def points(lengths: list[int], concurrency: list[int]) -> list[tuple[int, int]]:
    return [(n, c) for n in sorted(lengths) for c in sorted(concurrency)]


def estimate(history: list[tuple[int, float]], tokens: int, floor: float = 5.0) -> float:
    """Seconds a point of ``tokens`` prompt tokens (per deployment) will take, from the
    measured (tokens, seconds) of earlier points: the slowest per-token rate seen, plus the
    fixed cost of a run. No history: only the fixed cost."""
    if not history:
        return floor
    rate = max(max(s - floor, 0.0) / max(t, 1) for t, s in history)
    return floor + rate * tokens


def run_scaling(runner: Runner) -> None:
    a = runner.args
    runner.start_all()
    for p in runner.planned:
        runner.warmup(p)
    runner.write_agreement()
    order = list(runner.planned)
    history: list[tuple[int, float]] = []
    for idx, (length, conc) in enumerate(points(a.input_len, a.concurrency)):
        k = idx % len(order)
        rotated = order[k:] + order[:k]
        n = prompts_at(conc, a.prompts_per_slot, a.min_prompts)
        runs = [_run(p.name, idx, length, conc, n, a) for p in rotated]
        live = [p for p in rotated if p.name not in runner.broken]
        need = estimate(history, length * n) * max(1, len(live))
        if runner.left() < need:
            why = f"time budget ({runner.left():.0f}s left, ~{need:.0f}s needed)"
            print(f"[bench] point in{length}_c{conc}: not reached, {why}", flush=True)
            for p, run in zip(rotated, runs, strict=True):
                runner.skip(p, run, why)
            continue
        for p, run in zip(rotated, runs, strict=True):
            t0 = time.monotonic()
            runner.bench(p, run)
            if p.name not in runner.broken:
                history.append((length * n, time.monotonic() - t0))


def _run(name: str, idx: int, length: int, conc: int, n: int, a: Any) -> dict[str, Any]:
    file = f"bench/{name}_r0_in{length}_c{conc}.json"
    return dict(round=0, input_len=length, output_len=a.output_len, concurrency=conc,
                num_prompts=n, seed=a.seed + 10 * idx, file=file, warmup=False)  # fmt: skip
