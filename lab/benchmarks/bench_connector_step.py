#!/usr/bin/env python3
"""What KVShareConnector adds to each engine step on the decode side, on the CPU.

A decode engine (vLLM's real Scheduler + our connector in both roles, over vLLM-made KV
tensors, ``lab/tools/engine_sim.py``) takes ``--requests`` requests prefilled by another
process, READs their KV over NIXL and decodes ``--tokens-out`` tokens each. Every connector
method vLLM calls (scheduler side, from inside ``Scheduler.schedule`` / ``update_from_output``;
worker side, where the model runner calls them) is timed, and set against the whole step
(scheduling, connector, emulated forward, output processing) measured in the same run. The
GPU decode step it would sit in is reported for scale: a steady batch of 4 requests x 24
tokens on the H200 took 0.34-0.58 s, ~14-24 ms a step (results/gpu/2026-11-29c). The
per-layer hooks (``wait_for_layer_load``, ``save_kv_layer``) are empty in ours, as in vLLM's
NixlConnector, and are not timed.

    .venv/bin/python -m lab.benchmarks.bench_connector_step [--requests 4] [--tokens-out 64]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from lab.tools.engine_sim import READY, Engine, start_prefill

ROOT = Path(__file__).resolve().parent.parent

# What vLLM 0.26 calls on a connector during a step (scheduler side, then worker side).
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "take_events",
    "get_kv_connector_stats",
)
WORKER_HOOKS = (
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_save",
    "get_finished",
    "get_kv_connector_stats",
    "build_connector_worker_meta",
    "get_block_ids_with_load_errors",
    "clear_connector_metadata",
)


class HookTimer:
    """Wraps a connector instance's hooks; seconds per hook for the current step."""

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)

    def wrap(self, connector: Any, side: str, hooks: tuple[str, ...]) -> None:
        for name in hooks:
            method = getattr(connector, name, None)
            if method is None:
                continue
            setattr(connector, name, self._timed(f"{side}.{name}", method))

    def _timed(self, label: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.step[label] += time.perf_counter() - t0

        return timed

    def take(self) -> dict[str, float]:
        step, self.step = dict(self.step), defaultdict(float)
        return step


def run(requests: int, tokens_out: int, prompt_tokens: int, port: int) -> dict[str, Any]:
    prefill = start_prefill(port, prompt_tokens, requests, "--lease-s", "120", cwd=str(ROOT))
    try:
        produced = prefill.wait_json(READY, 240)["requests"]
        engine = Engine("g4tiny", "per_layer", "kv_consumer", port + 1)
        timer = HookTimer()
        timer.wrap(engine.scheduler.connector, "scheduler", SCHEDULER_HOOKS)
        timer.wrap(engine.worker, "worker", WORKER_HOOKS)
        engine.check_loaded = lambda req_id: []  # the test's pattern check is not the engine's
        for i, (rid, info) in enumerate(sorted(produced.items())):
            engine.add(
                "d" + rid[1:], prompt_tokens + 37 * i, tokens_out, info["kv_transfer_params"], i
            )
        steps = []
        deadline = time.monotonic() + 120
        while len(engine.outputs) < requests and time.monotonic() < deadline:
            loading = bool(engine.worker.worker.backend.in_flight())
            t0 = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t0
            hooks = timer.take()
            steps.append({"total": total, "hooks": hooks, "loading": loading})
            if loading:
                time.sleep(0.001)  # let the READ progress, as a GPU forward would take time
        engine.close()
    finally:
        prefill.kill()
    if len(engine.outputs) < requests:
        raise RuntimeError(f"only {len(engine.outputs)} of {requests} requests finished")
    return summarize(steps, requests, tokens_out)


def summarize(steps: list[dict[str, Any]], requests: int, tokens_out: int) -> dict[str, Any]:
    # Steady: every request is decoding (loads done), as in the GPU run's steady batches.
    steady = [s for s in steps if not s["loading"]][2:-2]
    hook_names = sorted({h for s in steady for h in s["hooks"]})
    per_hook = {h: statistics.median(s["hooks"].get(h, 0.0) for s in steady) for h in hook_names}
    connector = [sum(s["hooks"].values()) for s in steady]
    total = [s["total"] for s in steady]
    return {
        "requests": requests,
        "tokens_out": tokens_out,
        "steps": len(steps),
        # Steps that started with a load in flight: each costs a whole forward on a GPU,
        # so this (not the connector's microseconds) is what a READ adds to TTFT.
        "load_steps": sum(1 for s in steps if s["loading"]),
        "steady_steps": len(steady),
        "per_hook_us": {h: v * 1e6 for h, v in per_hook.items()},
        "connector_us": statistics.median(connector) * 1e6,
        "connector_p90_us": sorted(connector)[int(0.9 * (len(connector) - 1))] * 1e6,
        "step_us": statistics.median(total) * 1e6,
        "connector_share_of_step": statistics.median(
            c / t for c, t in zip(connector, total, strict=True)
        ),
    }


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| requests decoding | steps with a load in flight | steady steps | connector us/step "
        "median (p90) | whole CPU step us (median) | connector / whole step | connector / "
        "14 ms GPU step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['requests']} | {r.get('load_steps', '-')} | {r['steady_steps']} | "
            f"{r['connector_us']:.0f} "
            f"({r['connector_p90_us']:.0f}) | {r['step_us']:.0f} | "
            f"{r['connector_share_of_step']:.2f} | {r['connector_us'] / 14000:.4f} |"
        )
    hooks = sorted({h for r in results for h in r["per_hook_us"]})
    lines += [
        "",
        "| hook (median us per steady step) | "
        + " | ".join(f"{r['requests']} requests" for r in results)
        + " |",
        "|---|" + "---|" * len(results),
    ]
    for h in hooks:
        lines.append(
            f"| {h} | " + " | ".join(f"{r['per_hook_us'].get(h, 0.0):.1f}" for r in results) + " |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--tokens-out", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--port", type=int, default=27100)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = [
        run(n, args.tokens_out, args.prompt_tokens, args.port + 10 * i)
        for i, n in enumerate(args.requests)
    ]
    print(markdown(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
