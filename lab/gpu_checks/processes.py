"""What the GPU drivers do with the engine processes they start and the files they leave.

Every engine runs in its own session (kvcached names its IPC segments after it; killpg ends
it with its children); a driver that is stopped (``timeout`` sends SIGTERM) or crashes must
not leave engines holding GPU memory into the next command on the host, and a rerun into
the same ``--out`` must not read an earlier run's outputs as its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What an engine of a cell or a baseline leaves in its work directory. A rerun into the same
# --out must not find them: a stale ``stop`` ends the new prefill engine as soon as it is up
# (and the decode engine's memory profiling then fails, the GPU's free memory having grown),
# a stale ``prefill.json`` hands decode old transfer parameters, a stale result reads as
# this run's.
RUN_OUTPUTS = (
    "stop",
    "prefill.json",
    "prefill.result.json",
    "decode.result.json",
    "baseline.result.json",
    "reads.jsonl",
    "cell.json",
    "baseline.json",
)


def fresh_work_dir(work: Path, also: Iterable[str] = ()) -> Path:
    """``work`` without any earlier run's outputs (``RUN_OUTPUTS`` and ``also``, names or
    glob patterns; the model directory is kept)."""
    work.mkdir(parents=True, exist_ok=True)
    for name in RUN_OUTPUTS:
        (work / name).unlink(missing_ok=True)
    for pattern in also:
        for path in work.glob(pattern):
            path.unlink(missing_ok=True)
    return work


_STARTED: set[subprocess.Popen] = set()


def started(proc: subprocess.Popen) -> subprocess.Popen:
    """Record ``proc`` (started in its own session) to be stopped with the driver."""
    _STARTED.add(proc)
    return proc


def start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """A child in its own session, from the repository root (the package and the drivers
    importable), its output in ``log``; stopped with the driver."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    full = {**os.environ, **env, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=full, cwd=ROOT, start_new_session=True
        )
    return started(proc)


def module_cmd(module: str, *args: str) -> list[str]:
    """``python -m module args``: how a driver starts one of its engines."""
    return [sys.executable, "-m", module, *args]


def stop(proc: subprocess.Popen, timeout_s: float = 0) -> int:
    """Its exit code, waiting up to ``timeout_s``; its group killed (-9) past that."""
    try:
        return proc.wait(timeout=max(timeout_s, 0.01))
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return -9


def stop_started_processes() -> None:
    """Kill every child still running: no engine outlives the driver on the GPUs."""
    for proc in list(_STARTED):
        if proc.poll() is None:
            stop(proc)
        _STARTED.discard(proc)


def stop_with_the_driver() -> None:
    """On SIGTERM (what `timeout` sends) stop every started process, then exit."""

    def exit_on_signal(signum: int, _frame: object) -> None:
        stop_started_processes()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, exit_on_signal)


def wait_for_decode(
    prefill: subprocess.Popen, decode: subprocess.Popen, timeout_s: float
) -> None:
    """Until decode exits, ``timeout_s`` passes, or prefill dies (decode would wait in vain)."""
    deadline = time.monotonic() + timeout_s
    while decode.poll() is None and time.monotonic() < deadline:
        if prefill.poll() not in (None, 0):
            return
        time.sleep(0.5)


def start_lmcache_server(port: int, log: Path) -> subprocess.Popen:
    """An ``lm://`` server between two engines, listening before they start (an engine that
    starts before it would miss it)."""
    from kvshare_connector.common.child_process import wait_for_port

    cmd = [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"]
    server = start(cmd, log, {})
    try:
        wait_for_port("127.0.0.1", port, 60, alive=lambda: server.poll() is None)
    except (RuntimeError, TimeoutError):
        stop(server)
        raise
    return server


def triton_cache_entries() -> int:
    """Kernels in Triton's on-disk cache: what an engine adds there, it compiled (loads from
    the cache add nothing), the one-time cost a first batch can carry on a fresh host."""
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return sum(1 for _ in root.iterdir()) if root.is_dir() else 0
