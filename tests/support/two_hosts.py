"""Two hosts on this machine for tests: ``scripts/two_hosts.sh`` as a context manager.

``two_hosts()`` makes a pair (prefill 10.77.N.1, decode 10.77.N.2, each its own network,
UTS, IPC and PID namespace), yields a ``TwoHosts`` and always takes it down. N comes from
this suite's range (10-49; other sessions use other IDs), starting at one picked from the
pid so parallel runs start apart, and is held by an ``flock`` for the pair's life, so two
runs never share a pair (a lock dies with its process: a crashed run's pair is made anew).
Where namespaces cannot be made (not root, no unshare/nsenter, neither ``ip`` nor pyroute2,
no CAP_SYS_ADMIN) the test skips, saying why (the script's own words).

``ucx_read_paths`` reads UCX's protocol tables (``UCX_PROTO_INFO=y``): which transports a
READ (``ucp_get``) took to a peer, and whether UCX took the peer for the same machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "two_hosts.sh"
IDS = range(10, 50)  # this suite's namespace IDs
LOCKS = Path("/run/lock") if Path("/run/lock").is_dir() else Path(tempfile.gettempdir())
ROLES = ("prefill", "decode")
# UCX transports that never leave the machine
SAME_MACHINE = ("cma", "posix", "sysv", "xpmem", "knem", "cuda_ipc", "self")


@dataclass
class TwoHosts:
    id: int
    addresses: dict[str, str]  # role -> its address
    env: dict[str, str] = field(default_factory=dict)  # the script's environment

    @property
    def prefill(self) -> str:
        return self.addresses["prefill"]

    @property
    def decode(self) -> str:
        return self.addresses["decode"]

    def veth(self, role: str) -> str:
        return f"kvs{self.id}{role[0]}"

    def command(self, role: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``role``'s host (its process tree ends with it)."""
        assert role in ROLES, role
        return ["bash", str(SCRIPT), "run", str(self.id), role, *argv]

    def run(self, role: str, argv: Sequence[str], timeout_s: float = 60.0) -> str:
        """Run ``argv`` on ``role``'s host; its stdout (``CalledProcessError`` on failure)."""
        done = subprocess.run(
            self.command(role, argv), capture_output=True, text=True, timeout=timeout_s,
            env=self.env, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise subprocess.CalledProcessError(
                done.returncode, done.args, done.stdout, done.stderr
            )
        return done.stdout

    def script(self, *args: str) -> None:
        subprocess.run(
            ["bash", str(SCRIPT), *args, str(self.id)], check=True, env=self.env, timeout=60,
            capture_output=True,
        )  # fmt: skip

    def cut(self) -> None:
        """The link down (prefill's end: both ends lose carrier)."""
        self.script("cut")

    def mend(self) -> None:
        self.script("mend")

    def cap_tcp_buffers(self, max_bytes: int) -> None:
        """Both hosts' TCP socket buffers at most ``max_bytes`` each way (per namespace):
        a READ larger than what the sockets hold cannot finish on its bytes in flight."""
        for role in ROLES:
            for name in ("tcp_rmem", "tcp_wmem"):
                limits = f"4096 {min(65536, max_bytes)} {max_bytes}"
                self.run(role, ["sh", "-c", f"echo '{limits}' > /proc/sys/net/ipv4/{name}"])

    def rx_bytes(self, role: str) -> int:
        """Bytes ``role``'s end of the link received so far (the kernel's counter)."""
        path = f"/sys/class/net/{self.veth(role)}/statistics/rx_bytes"
        return int(self.run(role, ["cat", path]).strip())


def script_env(path: str | None = None) -> dict[str, str]:
    """The script's environment: this interpreter for its pyroute2 fallback (and ``path``
    as PATH, if given)."""
    return {**os.environ, "PYTHON": sys.executable, **({"PATH": path} if path else {})}


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"no {' or '.join(missing)} command (util-linux)"
    return None


@contextlib.contextmanager
def _claimed_id(ids: range = IDS) -> Iterator[int]:
    """An ID of ``ids`` no other run holds, held (``flock``) until the block ends."""
    start = os.getpid() % len(ids)
    for offset in range(len(ids)):
        pair_id = ids[(start + offset) % len(ids)]
        with open(LOCKS / f"kvshare-two-hosts-{pair_id}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            yield pair_id
            return
    raise RuntimeError(f"every namespace ID {ids.start}-{ids.stop - 1} is held by another run")


@contextlib.contextmanager
def two_hosts(path: str | None = None, ids: range = IDS) -> Iterator[TwoHosts]:
    """A pair of hosts, taken down on the way out; skips the test where none can be made.
    ``path``: the PATH the script runs with (a PATH without ``ip``: pyroute2 makes them);
    ``ids``: the namespace IDs this caller may use (suites running at once use others)."""
    why = _unavailable()
    if why is not None:
        pytest.skip(f"two hosts: {why}")
    env = script_env(path)
    with _claimed_id(ids) as pair_id:
        up = subprocess.run(
            ["bash", str(SCRIPT), "up", str(pair_id)], capture_output=True, text=True,
            env=env, timeout=60, check=False,
        )  # fmt: skip
        try:
            if up.returncode == 2:
                pytest.skip(f"two hosts: {up.stderr.strip() or 'scripts/two_hosts.sh up failed'}")
            assert up.returncode == 0, f"two_hosts.sh up {pair_id}: {up.stderr}"
            words = up.stdout.split()  # "prefill ADDR decode ADDR"
            yield TwoHosts(pair_id, dict(zip(words[::2], words[1::2], strict=True)), env)
        finally:
            subprocess.run(
                ["bash", str(SCRIPT), "down", str(pair_id)], env=env, timeout=60, check=False,
                capture_output=True,
            )  # fmt: skip


# ---- what UCX says -----------------------------------------------------------------------

_CONFIG = re.compile(r"\|\s*\S+\s+(self|intra-node|inter-node)\s+cfg#\d+\s*\|")
_READ = re.compile(r"\|\s*remote memory read by ucp_get")
_ROW = re.compile(r"\|\s*[0-9.]+(?:inf)?\s*\|[^|]*\|([^|]+)\|")
_TRANSPORT = re.compile(r"\b[a-z][a-z0-9_]*/[\w.:-]+")


def ucx_read_paths(log: str) -> list[tuple[str, list[str]]]:
    """``(scope, transports)`` of each READ protocol table UCX printed (``UCX_PROTO_INFO=y``),
    peers other than the process itself: scope ``inter-node`` or ``intra-node``, transports
    as UCX names them (``tcp/kvs10d``, ``cma/memory``)."""
    paths: list[tuple[str, list[str]]] = []
    scope: str | None = None
    in_read = False
    for line in log.splitlines():
        config = _CONFIG.search(line)
        if config:
            scope, in_read = config.group(1), False
            continue
        if _READ.search(line):
            in_read = scope not in (None, "self")
            if in_read:
                paths.append((str(scope), []))
            continue
        row = _ROW.search(line) if in_read else None
        if row:
            for transport in _TRANSPORT.findall(row.group(1)):
                if transport not in paths[-1][1]:
                    paths[-1][1].append(transport)
    return paths


def same_machine_transports(paths: list[tuple[str, list[str]]]) -> list[str]:
    """The transports of ``paths`` that only work within one machine."""
    return sorted({t for _, ts in paths for t in ts if t.split("/")[0] in SAME_MACHINE})


def ucx_env(extra: dict[str, Any] | None = None) -> dict[str, str]:
    """UCX printing its protocol choices (INFO level: the transports each peer gets)."""
    env = {**os.environ, "UCX_PROTO_INFO": "y", "UCX_LOG_LEVEL": "info"}
    return {**env, **{k: str(v) for k, v in (extra or {}).items()}}
