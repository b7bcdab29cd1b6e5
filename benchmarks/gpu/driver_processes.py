"""What the GPU drivers do with the engine processes they start and the files they leave.

Every engine runs in its own session; a driver that is stopped (``timeout`` sends SIGTERM)
or crashes must not leave engines holding GPU memory into the next command on the host, and
a rerun into the same ``--out`` must not read an earlier run's outputs as its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

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


def fresh_work_dir(work: Path) -> Path:
    """``work`` without any earlier run's outputs (the model directory is kept)."""
    work.mkdir(parents=True, exist_ok=True)
    for name in RUN_OUTPUTS:
        (work / name).unlink(missing_ok=True)
    return work


_STARTED: set[subprocess.Popen] = set()


def started(proc: subprocess.Popen) -> subprocess.Popen:
    """Record ``proc`` (started in its own session) to be stopped with the driver."""
    _STARTED.add(proc)
    return proc


def stop_started_processes() -> None:
    for proc in list(_STARTED):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _STARTED.discard(proc)


def stop_with_the_driver() -> None:
    """On SIGTERM (what `timeout` sends) stop every started process, then exit."""

    def exit_on_signal(signum: int, _frame: object) -> None:
        stop_started_processes()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, exit_on_signal)


def wait(proc: subprocess.Popen, timeout_s: float) -> int:
    """Its exit code; -9 once its group is killed at ``timeout_s``."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        return -9


def triton_cache_entries() -> int:
    """Kernels in Triton's on-disk cache: what an engine adds there, it compiled (loads from
    the cache add nothing), the one-time cost a first batch can carry on a fresh host."""
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return sum(1 for _ in root.iterdir()) if root.is_dir() else 0
