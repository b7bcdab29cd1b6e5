"""NIXL's progress thread sleeps on UCX's events instead of spinning (``nixl._start_agent``).

NIXL's Python API starts it with a poll delay of 0: it spins a core per agent, idle or not.
With ``progress_poll_ms`` > 0 it sleeps until UCX has work. Real agents in separate
processes: an idle agent's CPU time with and without the delay, and a READ from a target
whose own threads never call NIXL, over UCX's tcp transport (whose GET is emulated with
messages the target must answer): the sleeping thread serves it, and with no thread the
READ stalls (the control).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvshare_connector.backends.options import ConnectorOptions
from kvshare_connector.transfer.device.nixl import NixlTransport

ROOT = Path(__file__).resolve().parents[1]
NBYTES = 4 << 20

# Registers a pattern, prints where it is, then only sleeps until its stdin closes.
TARGET = r"""
import json, sys
import numpy as np
from kvshare_connector.layout.topology import Region
from kvshare_connector.transfer.device.nixl import NixlTransport
transport = NixlTransport("target", progress_thread=sys.argv[1] == "on", progress_poll_ms=1)
data = (np.arange(int(sys.argv[2]), dtype=np.uint32) * 2654435761 >> 7).astype(np.uint8)
transport.register([Region(data.ctypes.data, data.nbytes, -1)])
hello = {"meta": transport.metadata().hex(), "addr": data.ctypes.data}
print("TARGET", json.dumps(hello), flush=True)
sys.stdin.read()
"""


def _child(code: str, *argv: str, env: dict[str, str] | None = None, **kw: Any) -> Any:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.Popen([sys.executable, "-c", code, *argv], env=environ, text=True,
                            stdout=subprocess.PIPE, **kw)  # fmt: skip


def _idle_cores(poll_ms: float) -> float:
    """An idle agent's CPU use, in cores (``lab/tools/idle_agent.py``)."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "lab.tools.idle_agent", "idle", str(poll_ms),
            "--cpu-seconds", "1.5"]  # fmt: skip
    out, _ = subprocess.Popen(argv, env=environ, text=True, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE).communicate(timeout=120)  # fmt: skip
    (line,) = [x for x in out.splitlines() if x.startswith("cpu ")]  # NIXL logs to stdout too
    return float(line.split()[1])


def test_idle_progress_thread_sleeps_and_the_busy_poll_control_spins():
    sleeping = _idle_cores(1.0)  # the connector's default
    spinning = _idle_cores(0.0)  # NIXL's Python API as it ships
    assert sleeping < 0.25, f"an idle agent used {sleeping:.2f} cores"
    assert spinning > 0.5 and spinning > 4 * sleeping, (sleeping, spinning)


def _read_from_idle_target(monkeypatch: Any, target_thread: str, wait_s: float) -> tuple[str, bool]:
    """READ the idle target's pattern over tcp: the transfer's last state, and whether the
    bytes landed exactly."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")  # read by UCX when each agent starts
    target = _child(TARGET, target_thread, str(NBYTES), env={"UCX_TLS": "tcp,self"},
                    stdin=subprocess.PIPE)  # fmt: skip
    transport = None
    try:
        line = next(x for x in target.stdout if x.startswith("TARGET "))  # NIXL logs too
        hello = json.loads(line.removeprefix("TARGET "))
        transport = NixlTransport("reader", progress_thread=False)  # only the target's can
        local = np.zeros(NBYTES, dtype=np.uint8)
        from kvshare_connector.layout.topology import Region

        transport.register([Region(local.ctypes.data, NBYTES, -1)])
        peer = transport.add_peer(bytes.fromhex(hello["meta"]))
        rows = np.array([[local.ctypes.data, NBYTES, 0]], dtype=np.uint64)
        remote = np.array([[hello["addr"], NBYTES, 0]], dtype=np.uint64)
        handle = transport.read(peer, rows, "DRAM", remote, "DRAM", b"done")
        deadline = time.monotonic() + wait_s
        state = transport.state(handle)
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.01)
            state = transport.state(handle)
        expected = (np.arange(NBYTES, dtype=np.uint32) * 2654435761 >> 7).astype(np.uint8)
        landed = bool(np.array_equal(local, expected))
        if state != "PROC":
            transport.release(handle)
        return state, landed
    finally:
        target.stdin.close()
        target.kill()
        target.wait(timeout=30)
        if transport is not None:
            transport.close()


def test_sleeping_thread_serves_reads_of_a_target_that_never_calls_nixl(monkeypatch):
    state, landed = _read_from_idle_target(monkeypatch, "on", wait_s=60)
    assert state == "DONE" and landed


def test_control_without_the_thread_the_read_from_an_idle_target_stalls(monkeypatch):
    state, landed = _read_from_idle_target(monkeypatch, "off", wait_s=5)
    assert state == "PROC" and not landed


def test_progress_poll_modes_and_the_options_that_set_them():
    """The option and its variable are parsed once (``ConnectorOptions``; bad values:
    tests/test_options.py) and handed to the agent whole."""
    progress = ConnectorOptions.parse(None, environ={"KVSHARE_NIXL_PROGRESS_POLL_MS": "0"})
    assert progress.nixl_progress == {"progress_thread": True, "progress_poll_ms": 0.0}
    assert NixlTransport("poll-default", progress_thread=False).progress_poll_ms == 1.0
    modes = [NixlTransport(f"mode-{ms}", progress_thread=True, progress_poll_ms=ms).progress_mode
             for ms in (0, 0.3, 2)]  # fmt: skip
    assert modes == ["spins a core (poll 0)", "sleeps on UCX's events, 1 ms at most",
                     "sleeps on UCX's events, 2 ms at most"]  # fmt: skip
