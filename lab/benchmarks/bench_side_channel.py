#!/usr/bin/env python3
"""What each side-channel attack costs a real prefill, and what a legitimate decode sees
meanwhile (issue 22's and 46's targets: RSS growth <= 64 MiB and log <= 1 MB per 10 s of
any attack, legitimate handshake+claim p99 <= 50 ms and none failed, i.e. no eviction of
prefill, during it; ``poll()`` <= 1 ms; a replay never accepted).

One prefill process (``lab.tools.attacks.TargetProcess``, with a secret unless
``--no-secret``); per attack, the attack runs for ``--seconds`` (the replay row until its
2^18 + 4,096 signed requests are sent) while one legitimate client on 127.0.0.1 does
signed handshakes and claims; then the target reports its longest ``poll()``, its
refusals and evictions. A baseline row runs the legitimate client alone.

    .venv/bin/python -m lab.benchmarks.bench_side_channel --seconds 10 --out results/cpu/DATE
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lab.tools import attacks

MIB = 1 << 20
Attack = Callable[[attacks.TargetProcess, threading.Event], Any]


def repeat(attack: Callable[[attacks.TargetProcess], Any]) -> Attack:
    """``attack`` run again and again until the row ends; what its rounds saw."""

    def run(target: attacks.TargetProcess, stop: threading.Event) -> dict[str, int]:
        seen: collections.Counter[str] = collections.Counter()
        while not stop.is_set():
            out = attack(target)
            if isinstance(out, list):  # the codes of its requests, their texts shortened
                seen.update(str(x).split(" (")[0][:40] for x in out)
            seen["rounds"] += 1
        return dict(seen)

    return run


def held(sources: list[str], per_source: int) -> Attack:
    """Connections held open (opened again whenever the server ends or refuses one) all
    row long, by a process of their own (a tight loop of reconnects here would hold this
    process's GIL, which the measured client needs)."""

    def run(target: attacks.TargetProcess, stop: threading.Event) -> dict[str, int]:
        holder = attacks.HeldElsewhere(target.port, sources, per_source)
        stop.wait()
        return holder.close()

    return run


def replay(target: attacks.TargetProcess, stop: threading.Event) -> dict[str, Any]:
    """Runs until its requests are all sent, however long the row was meant to be."""
    if target.secret is None:
        return {"skipped": "no secret: nothing is signed"}
    seen = attacks.attack_replay(target)
    return {k: seen[k] for k in ("first", "replay", "signed", "seconds")}


ATTACKS: dict[str, Attack] = {
    "none (baseline)": repeat(lambda t: time.sleep(0.05)),
    "510 MiB headers": repeat(lambda t: attacks.attack_oversize(t, 20)),
    "1 MiB bodies, 8 connections": repeat(lambda t: attacks.attack_big_bodies(t, 2, 8)),
    "100k-id claims, unsigned": repeat(lambda t: attacks.attack_claim_flood(t, 20)),
    "256-id releases of unknown ids, signed": repeat(lambda t: attacks.attack_release_flood(t, 20)),
    "256 KiB release reasons, signed": repeat(lambda t: attacks.attack_long_reason(t, 20)),
    "unsigned hellos, 4 connections": repeat(lambda t: attacks.attack_hello_flood(t, 100, 4)),
    "nesting, versions, stolen claims": repeat(
        lambda t: attacks.attack_odd_messages(t, sorted(t.requests)[-1])
    ),
    # issue 46
    "8 connections held from decode's address": held([attacks.DECODE], 8),
    "136 connections held from 17 addresses": held([f"127.0.0.{i}" for i in range(2, 19)], 8),
    "1,000-deep nesting, signed": repeat(
        lambda t: attacks.attack_deep_nesting(t, 20, source="127.0.5.1")
    ),
    "resets at the refusal (ENOTCONN)": repeat(
        lambda t: attacks.reset_after_reply(t.port, 20, source="127.0.7.1")
    ),
    "replay after 2^18 + 4,096 signed": replay,
    "2^17 foreign-id claims of a held request, signed": repeat(
        lambda t: attacks.attack_heavy_claims(t, 20, source="127.0.9.1")
    ),
}


def run_one(target: attacks.TargetProcess, name: str, seconds: float) -> dict[str, Any]:
    attack = ATTACKS[name]
    stop, done = threading.Event(), threading.Event()  # the attack's end, then the decode's
    seen: dict[str, Any] = {}
    latencies: list[float] = []
    failures: list[str] = []

    def attacker() -> None:
        seen.update(attack(target, stop))

    def decode() -> None:
        while not done.is_set():
            try:
                latencies.append(attacks.legit_round(target))
            except Exception as exc:  # counted in the table: decode would evict prefill
                failures.append(repr(exc)[:200])
            time.sleep(0.01)

    target.stats()
    log_before, tracebacks_before = target.log_bytes, target.tracebacks
    started = time.monotonic()
    with attacks.Watch(target) as watch:
        threads = [threading.Thread(target=attacker), threading.Thread(target=decode)]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        threads[0].join()
        done.set()
        threads[1].join()
    elapsed = time.monotonic() - started
    stats = target.stats()
    ms = sorted(x * 1e3 for x in latencies)
    return {
        "attack": name,
        "seconds": round(elapsed, 1),
        "attack_saw": seen,
        "rss_growth_mib": round(watch.growth / MIB, 1),
        "log_kib_per_10s": round((target.log_bytes - log_before) / 1024 * 10 / elapsed, 1),
        "tracebacks": target.tracebacks - tracebacks_before,
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
    head = (
        "| attack | s | RSS growth MiB | log KiB / 10 s (tracebacks) | legit rounds (failed) "
        "| legit p50 / p99 ms | max poll() ms: wall / CPU | refused, evicted | attack saw |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        refused = ", ".join(f"{k} {v}" for k, v in sorted(r["refused"].items())) or "-"
        if r["refused_messages"] or r["refused_claims"]:
            refused += f"; protocol {r['refused_messages']}, claims {r['refused_claims']}"
        saw = ", ".join(f"{k} {v}" for k, v in r["attack_saw"].items())
        lines.append(
            f"| {r['attack']} | {r['seconds']} | {r['rss_growth_mib']} | "
            f"{r['log_kib_per_10s']} ({r['tracebacks']}) | {r['legit_asks']} "
            f"({r['legit_failed']}) | {r['legit_p50_ms']} / {r['legit_p99_ms']} | "
            f"{r['max_poll_ms']} / {r['max_poll_cpu_ms']} | {refused} | {saw} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=None, help="write table.md and raw.json")
    parser.add_argument("--only", nargs="*", default=None, help="attack names to run")
    parser.add_argument("--no-secret", action="store_true", help="a target without a secret")
    args = parser.parse_args()
    unknown = set(args.only or ()) - set(ATTACKS)
    if unknown:
        parser.error(f"no attack named {sorted(unknown)}; there are {sorted(ATTACKS)}")
    target = attacks.TargetProcess(None if args.no_secret else "bench secret")
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
