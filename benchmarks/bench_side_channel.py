#!/usr/bin/env python3
"""What each side-channel attack costs a real prefill, and what a legitimate decode sees
meanwhile (issue 22's targets: RSS growth <= 64 MiB and log <= 1 MB per single-client
attack of 10 s, legitimate handshake+claim p99 <= 50 ms during it, ``poll()`` <= 1 ms).

One prefill process (``devtools.attacks.TargetProcess``, with a secret); per attack, the
attack runs in a loop for ``--seconds`` while one legitimate client does signed handshakes
and claims; then the target reports its longest ``poll()`` and its refusals. A baseline
row runs the legitimate client alone.

    .venv/bin/python -m benchmarks.bench_side_channel --seconds 10 --out results/cpu/DATE
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvshare_connector.devtools import attacks

MIB = 1 << 20
ATTACKS: dict[str, Callable[[attacks.TargetProcess], Any]] = {
    "none (baseline)": lambda t: time.sleep(0.05),
    "510 MiB headers": lambda t: attacks.attack_oversize(t, 20),
    "1 MiB bodies, 8 connections": lambda t: attacks.attack_big_bodies(t, 2, connections=8),
    "100k-id claims, unsigned": lambda t: attacks.attack_claim_flood(t, 20),
    "256-id releases of unknown ids, signed": lambda t: attacks.attack_release_flood(t, 20),
    "256 KiB release reasons, signed": lambda t: attacks.attack_long_reason(t, 20),
    "unsigned hellos, 4 connections": lambda t: attacks.attack_hello_flood(t, 100, 4),
    "nesting, versions, stolen claims": lambda t: attacks.attack_odd_messages(
        t, sorted(t.requests)[-1]
    ),
}


def run_one(target: attacks.TargetProcess, name: str, seconds: float) -> dict[str, Any]:
    attack = ATTACKS[name]
    stop = threading.Event()
    rounds = 0
    latencies: list[float] = []
    failures: list[str] = []

    def attacker() -> None:
        nonlocal rounds
        while not stop.is_set():
            attack(target)
            rounds += 1

    def decode() -> None:
        while not stop.is_set():
            try:
                latencies.append(attacks.legit_round(target))
            except Exception as exc:  # counted in the table
                failures.append(repr(exc)[:200])
            time.sleep(0.01)

    target.stats()
    log_before = target.log_bytes
    with attacks.Watch(target) as watch:
        threads = [threading.Thread(target=attacker), threading.Thread(target=decode)]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
    stats = target.stats()
    ms = sorted(x * 1e3 for x in latencies)
    return {
        "attack": name,
        "rounds": rounds,
        "rss_growth_mib": round(watch.growth / MIB, 1),
        "log_kib": round((target.log_bytes - log_before) / 1024, 1),
        "legit_asks": len(ms),
        "legit_failed": len(failures),
        "legit_p50_ms": round(statistics.median(ms), 2) if ms else None,
        "legit_p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 2) if ms else None,
        "max_poll_ms": round(stats["max_poll_ms"], 3),
        "max_poll_cpu_ms": round(stats["max_poll_cpu_ms"], 3),
        "refused": stats["transport"],
        "refused_messages": stats["refused_messages"],
        "refused_claims": stats["refused_claims"],
        "early_ids": stats["early"],
        "failures": failures[:3],
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| attack (10 s loop) | rounds | RSS growth MiB | log KiB | legit asks (failed) | "
            "legit p50 / p99 ms | max poll() ms: wall / CPU | refused |")  # fmt: skip
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        refused = ", ".join(f"{k} {v}" for k, v in sorted(r["refused"].items())) or "-"
        if r["refused_messages"] or r["refused_claims"]:
            refused += f"; protocol {r['refused_messages']}, claims {r['refused_claims']}"
        lines.append(
            f"| {r['attack']} | {r['rounds']} | {r['rss_growth_mib']} | {r['log_kib']} | "
            f"{r['legit_asks']} ({r['legit_failed']}) | {r['legit_p50_ms']} / "
            f"{r['legit_p99_ms']} | {r['max_poll_ms']} / {r['max_poll_cpu_ms']} | {refused} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=None, help="write table.md and raw.json")
    parser.add_argument("--only", nargs="*", default=None, help="attack names to run")
    args = parser.parse_args()
    target = attacks.TargetProcess("bench secret")
    try:
        rows = [
            run_one(target, name, args.seconds)
            for name in ATTACKS
            if args.only is None or name in args.only
        ]
    finally:
        target.stop()
    text = table(rows)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "side_channel.md").write_text(text + "\n")
        (args.out / "side_channel.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
