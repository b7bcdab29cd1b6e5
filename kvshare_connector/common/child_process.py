"""A Python child process that reports by JSON lines, with every wait bounded.

The child writes its reports with ``report``, on a stdout of their own; its logs go to
stderr. Both pipes are drained on threads: a child that logs more than a pipe holds would
otherwise block while the parent waits for a line it will never print.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

_reports: TextIO | None = None
_reports_lock = threading.Lock()


def report(prefix: str, payload: Any) -> None:
    """Write one line for the parent: ``prefix``, then ``payload`` as JSON.

    Reports get a stdout of their own: the first call keeps a copy of fd 1 for them and
    points fd 1 at stderr, where logs (vLLM's handler writes to ``sys.stdout``) and C
    libraries then write. On a shared stdout, ``print`` wrote a report's text and its newline
    in two calls, and a log record from another thread could land between them: the parent
    read ``RELEASED {...}INFO ...``, could not parse it, and lost every later report. Each
    report is written whole, under a lock."""
    global _reports
    line = prefix + json.dumps(payload) + "\n"
    with _reports_lock:
        if _reports is None:
            sys.stdout.flush()
            _reports = os.fdopen(os.dup(1), "w")
            os.dup2(2, 1)
        _reports.write(line)
        _reports.flush()


def report_of(line: str, prefixes: Sequence[str]) -> tuple[str, Any] | None:
    """``(prefix, payload)`` of a report line with one of ``prefixes``; None for any other
    line (a log line written before the first report); ``ValueError`` as ``parse_report``."""
    prefix = next((p for p in prefixes if line.startswith(p)), None)
    return None if prefix is None else (prefix, parse_report(line, prefix))


def parse_report(line: str, prefix: str) -> Any:
    """The payload of a report line that starts with ``prefix``; ``ValueError`` naming the
    line if it does not parse (the reader that calls this goes on reading)."""
    try:
        return json.loads(line[len(prefix) :])
    except json.JSONDecodeError as exc:
        raise ValueError(f"malformed {prefix.strip()} line ({exc}): {line[:200]!r}") from exc


class Child:
    def __init__(self, args: list[str], env: dict[str, str] | None = None, cwd: str | None = None):
        self.process = subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            cwd=cwd,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []  # both streams, as they arrive
        threading.Thread(target=self._drain, args=(self.process.stdout, True), daemon=True).start()
        threading.Thread(target=self._drain, args=(self.process.stderr, False), daemon=True).start()

    def _drain(self, stream: Any, reports: bool) -> None:
        for line in stream:
            self.log.append(line)
            if reports:
                self.lines.put(line)

    def wait_json(self, prefix: str, timeout_s: float) -> dict[str, Any]:
        """The JSON after ``prefix`` on the child's next line that starts with it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.process.poll() is not None and self.lines.empty():
                    break
                continue
            if line.startswith(prefix):
                return parse_report(line, prefix)
        tail = "".join(self.log[-30:])
        code = self.process.poll()
        why = f"exited with code {code} before printing" if code is not None else "did not print"
        raise TimeoutError(
            f"child {why} {prefix!r} (waited up to {timeout_s} s); last output:\n{tail}"
        )

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


def wait_for_port(
    host: str, port: int, timeout_s: float, alive: Callable[[], bool] | None = None
) -> None:
    """Return once ``host:port`` accepts a TCP connection; raise if ``alive()`` turns
    false (the server process died) or ``timeout_s`` passes."""
    import socket

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            if alive is not None and not alive():
                raise RuntimeError(
                    f"the server for {host}:{port} exited before listening"
                ) from None
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"nothing listens on {host}:{port} after {timeout_s:g} s"
                ) from None
            time.sleep(0.2)
