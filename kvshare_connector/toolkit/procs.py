"""Child processes for the PD launcher: own process groups, log files, bounded readiness.

Each server runs in its own session (process group) so that Ctrl-C in the terminal reaches
only the launcher, which then stops every group in order (SIGTERM, a grace period, SIGKILL).
Groups matter because ``vllm serve`` forks engine-core workers that must not outlive it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A server did not come up; the message carries the tail of its log."""


def pick_free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port below the kernel's ephemeral range. Racy by nature, fine for tests
    and local runs; the port lies outside the range the kernel hands to client sockets and
    to ``bind(0)``, so nothing in the child (vLLM's distributed store, NIXL's listener, a
    connection) takes it between this pick and the bind (seen in CI: the side channel's
    port taken before the prefill child listened)."""
    return free_port_run(1, host)


@contextlib.contextmanager
def signals_interrupt(*signals: int) -> Iterator[None]:
    """Inside the block, each of ``signals`` raises KeyboardInterrupt; the caller's handlers
    come back afterwards (tests run these entry points in-process). Name SIGINT explicitly
    where Ctrl-C must stop the block: a process started in the background by a
    non-interactive shell (``cmd &``, CI runners) inherits SIGINT ignored, and Python then
    installs no KeyboardInterrupt for it."""

    def to_interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, to_interrupt) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port_run(count: int, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """The first of ``count`` consecutive unused TCP ports, below the kernel's ephemeral
    range. The launcher and the benchmarks number ports up from a base; a base from
    ``pick_free_port`` lies in the ephemeral range, where the ports after it are what the
    kernel hands out next to client sockets and other picks (seen: a fake server that could
    not bind its port in CI). Racy by nature, like ``pick_free_port``."""
    top = _ephemeral_low() - count
    bottom = 10000 if top > 11000 else 1024  # a host whose ephemeral range starts low
    for _ in range(attempts):
        base = random.randrange(bottom, max(top, bottom + 1))
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    sock.bind((host, port))
            except OSError:
                continue
            return base
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


class ManagedProcess:
    """One server process in its own process group, logging to a file."""

    def __init__(
        self, name: str, argv: Sequence[str], env: Mapping[str, str], log_path: Path
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = dict(env)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(
                    self.argv,
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            except OSError as exc:  # e.g. the program is not there
                raise LaunchError(f"cannot start {self.name} ({self.argv[0]}): {exc}") from exc
        logger.info("started %s (pid %d), log %s", self.name, self.proc.pid, self.log_path)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        """Signal the whole group; the group may outlive its leader (orphaned workers)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def group_alive(self) -> bool:
        if self.proc is None:
            return False
        self.proc.poll()  # reap the leader so a zombie does not count as alive
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def stop_processes(procs: Sequence[ManagedProcess], grace: float) -> None:
    """SIGTERM every group, wait up to ``grace`` seconds, then SIGKILL what is left.

    A second Ctrl-C during the wait skips straight to SIGKILL.
    """
    live = [p for p in procs if p.group_alive()]
    for p in live:
        logger.info("stopping %s (pid %s)", p.name, p.pid)
        p.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    try:
        while live and time.monotonic() < deadline:
            live = [p for p in live if p.group_alive()]
            time.sleep(0.1)
    except KeyboardInterrupt:
        logger.warning("interrupted again: killing")
    for p in live:
        if p.group_alive():
            logger.warning("%s did not stop within %.0fs: SIGKILL", p.name, grace)
            p.signal_group(signal.SIGKILL)
    for p in procs:
        if p.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(timeout=5)


def wait_healthy(
    url: str, proc: ManagedProcess | None, timeout: float, interval: float = 0.5
) -> None:
    """Poll ``url`` until it answers 200; fail fast if ``proc`` exits, fail at ``timeout``."""
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    with httpx.Client(timeout=min(5.0, max(interval, 1.0))) as client:
        while True:
            if proc is not None and not proc.alive():
                code = proc.proc.returncode if proc.proc else None
                raise LaunchError(
                    f"{proc.name} exited with code {code} before it was ready; "
                    f"log {proc.log_path}:\n{proc.log_tail()}"
                )
            try:
                resp = client.get(url)
                if resp.status_code == 200:
                    return
                last = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}"
            if time.monotonic() > deadline:
                where = f"; log {proc.log_path}:\n{proc.log_tail()}" if proc else ""
                raise LaunchError(f"{url} not healthy after {timeout:.0f}s ({last}){where}")
            time.sleep(interval)
