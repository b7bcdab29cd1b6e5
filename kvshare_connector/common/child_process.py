"""A Python child process that reports by JSON lines, with every wait bounded.

Its stdout is drained on a thread: a child that logs more than a pipe holds would
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
from collections.abc import Callable
from typing import Any


class Child:
    def __init__(self, args: list[str], env: dict[str, str] | None = None, cwd: str | None = None):
        self.process = subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            cwd=cwd,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.log.append(line)
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
                return json.loads(line[len(prefix) :])
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
