"""What a lying prefill's reply costs decode's engine thread (issue 46 item 6).

A raw server reads the claim, answers with a valid reply header announcing ``--announce``
bytes and then streams bytes for as long as the connection is open. Decode's
``side_channel_client.Pipe`` is pumped as the engine thread pumps it (once per step, here
every ms); per case: the longest ``pump()``, the pumps until the request settled, what the
pipe read, and decode's RSS growth. Before the bounds (ff795fd) a reply announcing 64 MiB
followed by endless bytes held the engine thread in one pump for 79-1,229 ms and grew decode
by 71-1,141 MiB.

    python -m lab.benchmarks.bench_reply_flood [--rounds 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import statistics
import struct
import threading
import time
from pathlib import Path

from kvshare_connector.transfer.wire import side_channel_client
from kvshare_connector.transfer.wire.side_channel import HEADER_BYTES, SideChannelError
from kvshare_connector.transfer.wire.side_channel_client import Pipe


class Flood:
    """Reads one request, then sends a reply header announcing ``length`` bytes and
    streams bytes until the client closes (or ``limit`` bytes went out)."""

    def __init__(self, length: int, limit: int = 2 << 30):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.length, self.limit = length, limit
        self.sent = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def header(self) -> bytes:
        """A reply frame's header (magic, version, kind, reserved, length), as decode's
        own request frames name magic and version."""
        probe = side_channel_client.encode_request(b"", "x@h:1")[0][:HEADER_BYTES]
        return struct.pack(">4sBBHI", probe[:4], probe[4], 2, 0, self.length)

    def _run(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.recv(1 << 16)
            chunk = b"\x5a" * (1 << 20)
            try:
                conn.sendall(self.header())
                while self.sent < self.limit:
                    conn.sendall(chunk)
                    self.sent += len(chunk)
            except OSError:
                return  # the client closed

    def close(self) -> None:
        self.listener.close()
        self.thread.join(timeout=10)


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def one_case(announce: int, bound: int, pumps: int = 5000) -> dict[str, float]:
    """Pump a pipe whose peer floods: the longest pump, pumps to settle, RSS growth."""
    server = Flood(announce)
    pipe = Pipe("127.0.0.1", server.port, "prefill", 30.0)
    before = rss_mib()
    future = pipe.send(b"claim", max_reply=bound)
    longest, count, peak = 0.0, 0, before
    while count < pumps and not future.done():
        start = time.perf_counter()
        pipe.pump()
        longest = max(longest, time.perf_counter() - start)
        count += 1
        peak = max(peak, rss_mib())
        time.sleep(0.001)
    for _ in range(20):  # the steps after: what the peer goes on sending is not read
        start = time.perf_counter()
        pipe.pump()
        longest = max(longest, time.perf_counter() - start)
        time.sleep(0.001)
    error = ""
    if future.done():
        try:
            future.result()
        except SideChannelError as exc:
            error = str(exc)[:80]
    pipe.close()
    server.close()
    return {
        "max_pump_ms": longest * 1e3,
        "pumps": count,
        "settled": future.done(),
        "peer_sent_mib": server.sent / 2**20,
        "rss_growth_mib": peak - before,
        "error": error,
    }


CASES = {  # name: (announced bytes, the claim's bound)
    "64 MiB announced, 64 KiB bound (a 2k claim's is ~100 KiB)": (64 << 20, 64 << 10),
    "64 MiB announced, 64 MiB bound (the pipe's own cap)": (64 << 20, 64 << 20),
    "1 MiB announced (within its bound), then endless": (1 << 20, 4 << 20),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rows = []
    for name, (announce, bound) in CASES.items():
        results = [one_case(announce, bound) for _ in range(args.rounds)]
        pumps = [r["max_pump_ms"] for r in results]
        rss = [r["rss_growth_mib"] for r in results]
        rows.append({"case": name, "rounds": results})
        print(
            f"| {name} | {statistics.median(pumps):.2f} ({min(pumps):.2f}-{max(pumps):.2f}) "
            f"| {max(r['pumps'] for r in results)} | {max(rss):.1f} "
            f"| {max(r['peer_sent_mib'] for r in results):.0f} | {results[0]['error']} |"
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"peak RSS of this process: {peak} MiB")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "reply_flood.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
