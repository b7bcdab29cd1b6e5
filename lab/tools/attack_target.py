"""A real prefill to aim side-channel attacks at (``lab.tools.attacks`` has the attacks).

``TargetProcess`` starts a prefill process (``python -m lab.tools.attack_target``:
vLLM's real KV memory for a small Gemma-4 shape on the CPU, a real NIXL agent and
``KVSource``, requests held) and reads its RSS, its log (size, tracebacks) and its own
counters (``stats()``: refusals, the longest ``poll()``, unknown-id state).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvshare_connector.common.child_process import parse_report, report
from kvshare_connector.transfer.wire import side_channel

READY = "KVSHARE_TARGET_READY "
STATS = "KVSHARE_TARGET_STATS "
TOKENS = 200


def _serve(args: argparse.Namespace) -> int:
    """The prefill process: hold ``--requests`` requests, poll, answer ``stats`` on stdin."""
    from kvshare_connector.backends.options import ConnectorOptions
    from kvshare_connector.demo.parts import build, requests_block_ids
    from kvshare_connector.transfer.device.nixl import NixlTransport
    from kvshare_connector.transfer.prefill.source import KVSource
    from kvshare_connector.transfer.wire.settings import EngineSettings

    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)  # as the nixl backend does
    _stack, topology = build("g4tiny", "per_layer", 16, 2048)
    engine_id = f"target-{os.getpid()}"
    secret = args.secret.encode() if args.secret else None
    settings = EngineSettings(engine_id, lease_s=3600.0, secret=secret)
    progress = ConnectorOptions.parse(None).nixl_progress  # the environment's settings
    source = KVSource(topology, NixlTransport(engine_id, **progress), settings)
    held = requests_block_ids(topology, TOKENS, args.requests, 7)
    for index, ids in enumerate(held):
        source.hold(f"req-{index}", block_ids=ids)
    report(READY, {"engine_id": engine_id, "port": source.port,
                   "requests": {f"req-{i}": ids for i, ids in enumerate(held)}})  # fmt: skip
    asked = threading.Event()
    closed = threading.Event()
    busy_s = [args.busy_ms / 1e3]

    def watch_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "stats":
                asked.set()
            elif line.startswith("busy "):
                busy_s[0] = float(line.split()[1]) / 1e3
        closed.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    worst = worst_cpu = 0.0  # wall (waits for the GIL included) and this thread's own CPU
    while not closed.is_set():
        started, cpu = time.perf_counter(), time.thread_time()
        source.poll()
        worst = max(worst, time.perf_counter() - started)
        worst_cpu = max(worst_cpu, time.thread_time() - cpu)
        if asked.is_set():
            asked.clear()
            by_reason = source.server.refused  # since the last stats: taken just below
            refused = source.take_refused()
            with source._lock:
                early, held_now = len(source._early), len(source._held)
            report(STATS, {"max_poll_ms": worst * 1e3,
                           "max_poll_cpu_ms": worst_cpu * 1e3, **refused,
                           "early": early, "held": held_now,
                           "transport": by_reason})  # fmt: skip
            worst = worst_cpu = 0.0
        if busy_s[0]:
            _hold_gil(busy_s[0])
        else:
            time.sleep(0.005)
    source.close()
    return 0


def _hold_gil(seconds: float) -> None:
    """Run Python for ``seconds`` without a pause, as an engine thread does between its
    steps' waits (an eager forward launches every kernel from Python)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(200))


class TargetProcess:
    """A running prefill target; every wait on it is bounded. ``busy_ms``: its engine
    thread holds the GIL as a busy engine does, polling every ``busy_ms``;
    ``switch_interval_ms``: Python's thread switch interval there (0: Python's)."""

    def __init__(
        self,
        secret: str | None,
        requests: int = 8,
        busy_ms: float = 0.0,
        switch_interval_ms: float = 0.0,
    ):
        argv = [sys.executable, "-m", __name__, "--requests", str(requests)]
        argv += ["--busy-ms", str(busy_ms), "--switch-interval-ms", str(switch_interval_ms)]
        env = dict(os.environ, PYTHONUNBUFFERED="1", KVSHARE_NIXL_PROGRESS_THREAD="0")
        if secret:
            argv += ["--secret", secret]
        self.secret = secret.encode() if secret else None
        self._changed = threading.Condition()
        for attempt in (1, 2):
            self._spawn(argv, env)
            try:
                ready = self._next(READY, 300)
                break
            except TimeoutError as exc:
                # A CPU vLLM stack can die at start (once in CI: exit 1 before READY, e.g. a
                # port taken between being picked and bound): start it once more, and say so.
                if attempt == 2 or self.process.poll() is None:
                    raise
                print(f"attack target: started again after: {exc}", file=sys.stderr)
        self.engine_id: str = ready["engine_id"]
        self.port: int = ready["port"]
        self.requests: dict[str, list[list[int]]] = ready["requests"]

    def _spawn(self, argv: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env,
        )  # fmt: skip
        self.log_bytes = 0  # all it logged (stdout and stderr)
        self.tracebacks = 0  # of which lines that start a traceback
        self._tail: collections.deque[str] = collections.deque(maxlen=8)  # said why it ended
        self._lines: list[str] = []
        threading.Thread(target=self._read, args=(self.process.stdout, True), daemon=True).start()
        threading.Thread(target=self._read, args=(self.process.stderr, False), daemon=True).start()

    def _read(self, stream: Any, stdout: bool) -> None:
        """Report lines are kept; everything else is log."""
        for line in stream:
            with self._changed:
                if stdout and line.startswith((READY, STATS)):
                    self._lines.append(line)
                else:
                    self.log_bytes += len(line.encode())
                    self.tracebacks += "Traceback (most recent call last)" in line
                    self._tail.append(line.rstrip()[:300])
                self._changed.notify_all()

    def _next(self, prefix: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                for i, line in enumerate(self._lines):
                    if line.startswith(prefix):
                        del self._lines[: i + 1]
                        return parse_report(line, prefix)
                left = deadline - time.monotonic()
                if left <= 0 or self.process.poll() is not None:
                    code = self.process.poll()
                    raise TimeoutError(
                        f"target: no {prefix.strip()} line (exit {code}); its last lines: "
                        + " | ".join(self._tail)
                    )
                self._changed.wait(min(left, 0.1))

    @property
    def where(self) -> str:
        return side_channel.destination(self.engine_id, "127.0.0.1", self.port)

    def stats(self) -> dict[str, Any]:
        """Its refusals since the last call (``transport``: by reason, at the framing and
        authentication; ``refused_messages``: those and the protocol's; ``refused_claims``),
        the longest poll() meanwhile, and its unknown-id and held-request counts now."""
        assert self.process.stdin is not None
        self.process.stdin.write("stats\n")
        self.process.stdin.flush()
        return self._next(STATS, 30)

    def busy(self, ms: float) -> None:
        """From now on its engine thread holds the GIL, polling every ``ms`` (0: idle)."""
        assert self.process.stdin is not None
        self.process.stdin.write(f"busy {ms}\n")
        self.process.stdin.flush()

    def rss(self) -> int:
        """Resident bytes of the target process now."""
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@dataclass
class Watch:
    """Samples a process's RSS every 20 ms while an attack runs: the peak over the start."""

    target: TargetProcess
    start: int = 0
    peak: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Watch:
        self.start = self.peak = self.target.rss()

        def sample() -> None:
            while not self._stop.wait(0.02):
                self.peak = max(self.peak, self.target.rss())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.target.rss())

    @property
    def growth(self) -> int:
        return self.peak - self.start


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a prefill side channel to attack")
    parser.add_argument("--secret", default=None)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--busy-ms", type=float, default=0.0)
    parser.add_argument("--switch-interval-ms", type=float, default=0.0)
    sys.exit(_serve(parser.parse_args()))
