"""The lane between two hosts (issue 48 item 2): ``kvshare lane --serve`` on a prefill host,
``kvshare lane --prefill`` on a decode host, each its own network, UTS, IPC and PID namespace
(``scripts/two_hosts.sh``; skipped where they cannot be made).

Across them the probe READ goes over tcp, and the probe says so, with the link it took and
every UCX setting in force on each side; the decode host's link counter (the kernel's)
confirms the bytes crossed it. A prefill at UCX's default segments is the slow lane, named
with its fix. The control: the same two network namespaces with UCX's same-machine shortcut
allowed (shared UTS/IPC/PID) make the probe name shm/cma, so the tcp check can fail.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshare_connector.transfer.device.lanes import MT_MUTEX, REMOTE_TCP, RX_SEG, TX_SEG

from .support.two_hosts import TwoHosts, same_machine_transports, two_hosts, ucx_read_paths

ROOT = Path(__file__).resolve().parents[1]
IDS = range(60, 100)  # this module's namespace IDs (other suites and benchmarks use others)
PORT = 5700
LANE = [sys.executable, "-m", "kvshare_connector.toolkit.cli", "lane", "--device", "cpu"]


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    with two_hosts(ids=IDS) as pair:
        yield pair


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lane") / "secret"
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


def on_host(pair: TwoHosts, role: str, argv: list[str], shortcut: bool = False) -> list[str]:
    """``argv`` on ``role``'s host; ``shortcut``: in its network namespace only (and a /sys
    of its own, where UCX finds its devices), sharing UTS/IPC/PID with the other host."""
    if shortcut:
        mount = 'mount -t sysfs sysfs /sys && exec "$@"'
        return ["nsenter", f"--net=/run/netns/kvshare-{pair.id}-{role}", "unshare", "--mount",
                "sh", "-c", mount, "sh", *argv]  # fmt: skip
    return pair.command(role, argv)


def clean_env(pair: TwoHosts, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The hosts' environment without UCX or lane settings (an in-process engine of this
    pytest process may have set some), with ``extra``."""
    kept = {k: v for k, v in pair.env.items() if not k.startswith(("UCX_", "KVSHARE_UCX"))}
    return {**kept, **(extra or {})}


@contextlib.contextmanager
def lane_peer(pair: TwoHosts, secret: Path, env: dict[str, str] | None = None,
              extra: list[str] = (), shortcut: bool = False) -> Iterator[str]:  # fmt: skip
    """``kvshare lane --serve`` on the prefill host, until the block ends."""
    address = f"{pair.prefill}:{PORT}"
    argv = [*LANE, "--serve", address, "--secret-file", str(secret), *extra]
    process = subprocess.Popen(
        on_host(pair, "prefill", argv, shortcut), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=clean_env(pair, env), cwd=ROOT,
    )  # fmt: skip
    serving, tail = threading.Event(), deque(maxlen=40)

    def read() -> None:  # drained to the end: a full pipe would stall the peer
        assert process.stdout is not None
        for line in process.stdout:
            tail.append(line)
            if "serving the lane probe" in line:
                serving.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not serving.wait(180):
            pytest.fail(f"the lane peer did not serve (exit {process.poll()}): {''.join(tail)}")
        yield address
    finally:
        process.kill()  # unshare --kill-child: the peer goes with it
        process.wait(30)


def probe(pair: TwoHosts, address: str, secret: Path, env: dict[str, str] | None = None,
          extra: list[str] = (), shortcut: bool = False) -> tuple[int, dict]:  # fmt: skip
    """``kvshare lane --prefill`` on the decode host: its exit status and JSON report, and
    how many bytes the decode host's link received meanwhile."""
    argv = [*LANE, "--prefill", address, "--secret-file", str(secret), "--json", *extra]
    veth = f"/sys/class/net/{pair.veth('decode')}/statistics/rx_bytes"
    script = f'before=$(cat {veth}); "$@"; rc=$?; echo "RX $(( $(cat {veth}) - before ))"; exit $rc'
    out = subprocess.run(
        on_host(pair, "decode", ["sh", "-c", script, "sh", *argv], shortcut),
        capture_output=True, text=True, timeout=300, env=clean_env(pair, env), cwd=ROOT,
        check=False,
    )  # fmt: skip
    lines = out.stdout.strip().splitlines()
    rx = [int(line.split()[1]) for line in lines if line.startswith("RX ")]
    reports = [json.loads(line) for line in lines if line.startswith("{")]
    assert reports and rx, f"no report (exit {out.returncode}): {out.stderr[-3000:]}"
    return out.returncode, {**reports[-1], "link_rx": rx[-1], "log": out.stderr}


def test_the_lane_across_two_hosts_is_tcp_with_both_sides_settings(hosts, secret_file):
    """The probe names tcp on the link between the hosts, with its GB/s, and every UCX
    setting of each side: ucx_lane auto's for a remote lane, and each side's own."""
    says = {"UCX_PROTO_INFO": "y", "UCX_LOG_LEVEL": "info"}  # UCX prints its own choice
    with lane_peer(hosts, secret_file, env={"UCX_TCP_MAX_CONN_RETRIES": "30"}) as address:
        code, report = probe(hosts, address, secret_file, env=says)
    assert code == 0 and report["lane"] == "tcp" and not report["slow"], report
    decode_veth = hosts.veth("decode")
    assert report["where"].startswith(f"{decode_veth}, {hosts.decode}:"), report["where"]
    assert f"-> {hosts.prefill}:" in report["where"] and report["gbps"] > 0
    assert report["link_rx"] >= 4 * report["nbytes"]  # wire-up READ and 3 timed: they crossed
    assert ucx_read_paths(report["log"]) == [("inter-node", [f"tcp/{decode_veth}"])]
    tuned = {k: v for k, (v, _) in REMOTE_TCP.items()}
    assert report["prefill_ucx"] == {**tuned, "UCX_TCP_MAX_CONN_RETRIES": "30"}
    assert report["decode_ucx"] == {**tuned, **says}
    assert "UCX_PROTO_INFO=y (yours, kept)" in report["decode_settings"]
    assert f"{MT_MUTEX}=y" in report["prefill_settings"]


def test_a_prefill_at_ucx_defaults_is_the_slow_lane_with_its_fix(hosts, secret_file):
    """ucx_lane off on prefill: 8 KiB segments, what ff795fd ran at 0.3-0.4x plain TCP."""
    with lane_peer(hosts, secret_file, extra=["--ucx-lane", "off"]) as address:
        code, report = probe(hosts, address, secret_file)
    assert code == 1 and report["lane"] == "tcp" and report["slow"], report
    assert "8 KiB messages" in report["fix"] and f"{TX_SEG}=256k" in report["fix"]
    assert report["prefill_settings"] == "UCX defaults"


def test_segments_decode_cannot_receive_are_refused_before_any_read(hosts, secret_file):
    """A prefill sending 1 MiB segments to a decode receiving 64 KiB crashed it (SIGSEGV):
    refused, naming the fix. Control: decode receiving 1 MiB reads."""
    big = {TX_SEG: "1m", RX_SEG: "1m"}
    with lane_peer(hosts, secret_file, env=big) as address:
        argv = [*LANE, "--prefill", address, "--secret-file", str(secret_file), "--ucx-lane",
                "off"]  # fmt: skip
        refused = subprocess.run(
            on_host(hosts, "decode", argv), capture_output=True, text=True, timeout=300,
            env=clean_env(hosts), cwd=ROOT, check=False,
        )  # fmt: skip
        code, report = probe(hosts, address, secret_file, env=big)
    assert refused.returncode == 1, refused.stderr[-2000:]
    assert "UCX would crash on the first READ" in refused.stderr and RX_SEG in refused.stderr
    assert code == 0 and report["lane"] == "tcp"


def test_control_same_machine_shortcut_is_named_shm_cma(hosts, secret_file):
    """The same addresses with UCX's shortcut allowed: the bytes never touch the link and
    the probe says so; the tcp check above is not a foregone conclusion."""
    says = {"UCX_PROTO_INFO": "y", "UCX_LOG_LEVEL": "info"}
    with lane_peer(hosts, secret_file, shortcut=True) as address:
        code, report = probe(hosts, address, secret_file, env=says, shortcut=True)
    assert code == 0 and report["lane"] == "shm/cma", report
    assert report["link_rx"] < report["nbytes"]  # the READs did not cross the link
    assert same_machine_transports(ucx_read_paths(report["log"])) == ["cma/memory"]
