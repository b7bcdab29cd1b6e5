"""A NIXL agent that does nothing, in its own process: another engine's agent beside the one
being measured (``lab/benchmarks/bench_claim_latency.py --neighbours``), or the subject of an
idle-CPU measurement (``tests/test_nixl_progress.py``). Its progress thread runs with the
given poll delay, so what it costs the machine is what an idle engine's agent costs.

    python -m lab.tools.idle_agent NAME POLL_MS [--cpu-seconds S]

Prints ``up`` once the agent exists; with ``--cpu-seconds``, then ``cpu <cores>`` (the
process's CPU time over S seconds of wall time). Exits when its stdin closes.
"""

from __future__ import annotations

import argparse
import sys
import time

from kvshare_connector.transfer.device.nixl import NixlTransport


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name")
    p.add_argument("poll_ms", type=float, help="the progress thread's poll delay (0: spins)")
    p.add_argument("--cpu-seconds", type=float, default=None)
    args = p.parse_args(argv)
    agent = NixlTransport(args.name, progress_thread=True, progress_poll_ms=args.poll_ms)
    print("up", flush=True)
    if args.cpu_seconds:
        time.sleep(0.3)  # past the thread's start
        cpu, wall = time.process_time(), time.monotonic()
        time.sleep(args.cpu_seconds)
        print(f"cpu {(time.process_time() - cpu) / (time.monotonic() - wall):.4f}", flush=True)
    sys.stdin.read()
    agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
