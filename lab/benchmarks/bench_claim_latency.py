#!/usr/bin/env python3
"""What one claim costs between two busy engines: decode's step boundary at which it leaves
to the step boundary at which decode sees prefill's answer (issue 21: order -> claimed was
48-55 ms p50 in GPU serving, for a READ of 0.1-0.2 ms).

Both engine threads run Python without pause, as eager engines do: a prefill process
(``lab.tools.attacks.TargetProcess``, a real ``KVSource`` holding requests, its engine thread
holding the GIL and polling every ``--prefill-busy-ms``) and, here, a decode engine thread
stepping every ``--step-ms``. Side by side, per round in rotated order:

* decode asks on a helper thread (a connection per claim, as before) or over the ``Pipe``
  its engine thread drives at step boundaries;
* prefill answers on its side channel's loop (the helper-thread answers of before were
  measured slower and removed: results/cpu/2026-12-03);
* prefill's thread switch interval is Python's 5 ms or the nixl backend's 1 ms
  (``switch_interval_ms``);
* decode looks for the answer at step boundaries only, or also from inside the step every
  ``layer_nudge_ms`` (vLLM's per-layer hook, ``NixlWorker.nudge``);
* ``--neighbours`` other engines' NIXL agents on the same cores, their progress threads
  spinning (NIXL's Python API: poll delay 0) or sleeping on UCX's events
  (``nixl_progress_poll_ms``, 1 ms): on the GPU host 9 engines spun 9 of 16 cores.

    .venv/bin/python -m lab.benchmarks.bench_claim_latency --rounds 3 --out results/cpu/DATE
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvshare_connector.transfer.wire import protocol
from kvshare_connector.transfer.wire.side_channel_client import Pipe, ask_retrying
from lab.tools import attacks

SECRET = "bench secret"


def _claim(target: attacks.TargetProcess) -> bytes:
    rid = sorted(target.requests)[0]
    message = protocol.Claim(
        protocol.PROTOCOL_VERSION, "bench-decode", [rid], 30.0, token="bench-reader",
        block_ids={rid: [protocol.pack_ids(ids) for ids in target.requests[rid]]},
    )  # fmt: skip
    return protocol.encode(message)


def measure(
    target: attacks.TargetProcess, via_pipe: bool, claims: int, step_s: float, nudge_s: float
) -> list[float]:
    """Milliseconds from the step boundary a claim leaves at to the moment decode's engine
    thread sees its answer, for ``claims`` claims one after the other, on an engine thread
    that runs Python for ``step_s`` per step and looks at step boundaries, and every
    ``nudge_s`` inside the step too (0: not)."""
    payload = _claim(target)
    pool = ThreadPoolExecutor(1)
    pipe = Pipe("127.0.0.1", target.port, target.engine_id, 5.0, target.secret)

    def send() -> Future[bytes]:
        if via_pipe:
            return pipe.send(payload)
        return pool.submit(
            ask_retrying, "127.0.0.1", target.port, payload, 5.0, target.secret,
            target.engine_id,
        )  # fmt: skip

    out = []
    try:
        for _ in range(claims):
            started = time.perf_counter()
            future = send()
            while not future.done():
                step_end = time.perf_counter() + step_s
                while not future.done() and time.perf_counter() < step_end:  # the forward
                    attacks._hold_gil(min(nudge_s or step_s, step_end - time.perf_counter()))
                    if nudge_s:
                        pipe.pump()  # a layer's hook
                pipe.pump()  # the step boundary (``KVSink.advance``)
            reply = protocol.decode(future.result())
            assert isinstance(reply, protocol.ClaimReply) and reply.held, reply
            out.append((time.perf_counter() - started) * 1e3)
    finally:
        pipe.close()
        pool.shutdown()
    return out


def _stats(ms: list[float]) -> dict[str, float]:
    ms = sorted(ms)
    return {
        "p50": round(statistics.median(ms), 2),
        "p90": round(ms[int(0.9 * (len(ms) - 1))], 2),
        "p99": round(ms[int(0.99 * (len(ms) - 1))], 2),
    }


VARIANTS: dict[str, tuple[bool, float, float, float | None]] = {
    # name -> (decode via the pipe, prefill's switch interval ms, decode's nudges inside
    # the step every ms (0: none), the neighbour agents' progress poll ms (None: no
    # neighbours; 0: they spin))
    "decode asks on a helper thread": (False, 5.0, 0.0, None),
    "decode pipe": (True, 5.0, 0.0, None),
    "decode pipe, 1 ms switch": (True, 1.0, 0.0, None),
    "the same, nudged every 2 ms inside the step": (True, 1.0, 2.0, None),
    "beside neighbour agents spinning (poll 0)": (True, 1.0, 2.0, 0.0),
    "beside neighbour agents sleeping (poll 1 ms)": (True, 1.0, 2.0, 1.0),
}


@contextmanager
def neighbours(count: int, poll_ms: float | None) -> Iterator[None]:
    """``count`` idle NIXL agents, each in its own process, as other engines' agents are."""
    procs = []
    if poll_ms is not None:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        for i in range(count):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "lab.tools.idle_agent", f"neighbour-{i}",
                 str(poll_ms)], env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True,
            ))  # fmt: skip
        for proc in procs:  # NIXL logs to stdout too
            if not any(line.strip() == "up" for line in proc.stdout):
                raise RuntimeError("a neighbour agent did not start")
    try:
        yield
    finally:
        for proc in procs:
            proc.stdin.close()
            proc.wait(timeout=30)


def run(args: argparse.Namespace) -> dict[str, Any]:
    targets = {
        switch: attacks.TargetProcess(SECRET, 2, switch_interval_ms=switch)
        # idle but while measured: one busy prefill at a time on the machine's cores
        for _, switch, _, _ in VARIANTS.values()
    }
    names = list(VARIANTS)
    samples: dict[str, list[list[float]]] = {name: [] for name in names}
    try:
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # rotated
                via_pipe, switch, nudge, poll = VARIANTS[name]
                target = targets[switch]
                with neighbours(args.neighbours, poll):
                    target.busy(args.prefill_busy_ms)
                    try:
                        ms = measure(target, via_pipe, args.claims, args.step_ms / 1e3,
                                     nudge / 1e3)  # fmt: skip
                    finally:
                        target.busy(0)
                samples[name].append(ms)
    finally:
        for target in targets.values():
            target.stop()
    rows = []
    for name in names:
        per_round = [_stats(ms)["p50"] for ms in samples[name]]
        rows.append({"variant": name, **_stats([x for ms in samples[name] for x in ms]),
                     "round_p50s": per_round})  # fmt: skip
    return {"settings": vars(args) | {"out": str(args.out)}, "rows": rows, "raw": samples}


def table(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        f"claims: {s['claims']} per variant and round, {s['rounds']} rounds (rotated); decode "
        f"steps of {s['step_ms']} ms, prefill engine thread busy, polling every "
        f"{s['prefill_busy_ms']} ms; {s.get('neighbours', 0)} neighbour agent(s) where named",
        "",
        "| variant | p50 ms | p90 ms | p99 ms | p50 per round |",
        "|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        rounds = ", ".join(f"{x:g}" for x in r["round_p50s"])
        lines.append(f"| {r['variant']} | {r['p50']} | {r['p90']} | {r['p99']} | {rounds} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=5.0, help="decode's step")
    parser.add_argument("--prefill-busy-ms", type=float, default=20.0)
    parser.add_argument(
        "--neighbours", type=int, default=1, help="idle NIXL agents beside the last two variants"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="write claim_latency.md and claim_latency.json there"
    )
    args = parser.parse_args(argv)
    result = run(args)
    text = table(result)
    out(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "claim_latency.md").write_text(text + "\n")
        (args.out / "claim_latency.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
