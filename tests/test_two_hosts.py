"""Prefill and decode on two hosts (issue 48 item 1): ``scripts/two_hosts.sh`` makes them
(network namespaces on this machine, each its own UTS/IPC/PID namespace), and the demo's
verified NIXL transfer runs across them with its negative controls. The data crosses the
link: UCX names the peer "inter-node" and its READ "tcp/<the link>", and the link's byte
counter grows by what was read; the control, the same two network namespaces entered with
``nsenter --net`` alone, shows what the check catches: "intra-node", read through CMA.
Skips, saying why, where namespaces cannot be made.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .support.two_hosts import (
    ROOT,
    TwoHosts,
    same_machine_transports,
    two_hosts,
    ucx_env,
    ucx_read_paths,
)

PORT = 5600
KVSHARE = [sys.executable, "-m", "kvshare_connector.toolkit.cli"]


@pytest.fixture(scope="module")
def pair():
    with two_hosts() as made:
        yield made


def _reachable(pair: TwoHosts, timeout_s: float = 1.0) -> str:
    """What decode's host sees dialing an unused port of prefill's host: ``refused`` means
    the link carried the SYN there and back."""
    probe = (
        "import socket, sys\n"
        "try:\n"
        f"    socket.create_connection(('{pair.prefill}', 9), timeout={timeout_s})\n"
        "except ConnectionRefusedError:\n"
        "    print('refused')\n"
        "except OSError as exc:\n"
        "    print(type(exc).__name__)\n"
    )
    return pair.run("decode", [sys.executable, "-c", probe]).strip()


def test_two_hosts_are_two_machines_and_the_link_can_be_cut(pair):
    names = {role: pair.run(role, ["hostname"]).strip() for role in ("prefill", "decode")}
    assert names == {"prefill": f"kvshare-{pair.id}-prefill", "decode": f"kvshare-{pair.id}-decode"}
    assert names["prefill"] != os.uname().nodename
    # Own PID namespace: the command is PID 1 and sees no other process.
    pid, *pids = pair.run("decode", ["sh", "-c", "echo $$; ls /proc | grep '^[0-9]'"]).split()
    assert pid == "1" and all(int(p) < 10 for p in pids), pids  # the shell, ls and grep
    # Own /sys: only this host's devices (UCX lists TCP devices there).
    assert sorted(pair.run("decode", ["ls", "/sys/class/net"]).split()) == [
        pair.veth("decode"),
        "lo",
    ]
    assert _reachable(pair) == "refused"
    pair.cut()
    try:
        assert _reachable(pair) != "refused"  # negative control: nothing crosses a cut link
    finally:
        pair.mend()
    assert _reachable(pair) == "refused"


def test_script_makes_the_pair_with_pyroute2_where_ip_is_missing(tmp_path):
    """A host without iproute2 (the GPU host): the same script through pyroute2."""
    if importlib.util.find_spec("pyroute2") is None:
        pytest.skip("pyroute2 is not installed (pip install -e '.[test]')")
    bin_dir = tmp_path / "bin"  # this PATH, less `ip`
    bin_dir.mkdir()
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        for tool in Path(folder).glob("*") if Path(folder).is_dir() else []:
            link = bin_dir / tool.name
            if tool.name != "ip" and not link.exists() and os.access(tool, os.X_OK):
                link.symlink_to(tool)
    with two_hosts(path=str(bin_dir)) as other:
        assert subprocess.run(["bash", "-c", "command -v ip"], env=other.env).returncode != 0
        assert _reachable(other) == "refused"
        other.cut()
        assert _reachable(other) != "refused"
        other.mend()
        assert _reachable(other) == "refused"
    assert not Path(f"/run/netns/kvshare-{other.id}-prefill").exists()


def _demo(pair: TwoHosts, role: str, *args: str, nsenter_only: bool = False) -> subprocess.Popen:
    argv = [*KVSHARE, "demo", "--role", role, *args]
    if nsenter_only:  # the network namespace alone, as `ip netns exec` enters it (its own
        # /sys, for its devices), with this machine's hostname, IPC and PIDs
        mount_sys = 'mount -t sysfs sysfs /sys && exec "$@"'
        argv = ["nsenter", f"--net=/run/netns/kvshare-{pair.id}-{role}", "unshare", "--mount",
                "sh", "-c", mount_sys, "sh", *argv]  # fmt: skip
    else:
        argv = pair.command(role, argv)
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=ucx_env(), cwd=ROOT)  # fmt: skip


def _finish(process: subprocess.Popen, timeout_s: float = 300) -> tuple[int, str]:
    try:
        out, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        out, _ = process.communicate()
    return process.returncode, out


def _bytes_read(out: str) -> int:
    match = re.search(r"bytes read\s+([\d,]+)", out)
    assert match, out[-3000:]
    return int(match.group(1).replace(",", ""))


def _secret(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text + "\n")
    return str(path)


def test_demo_across_hosts_with_its_negative_controls(pair, tmp_path):
    secret = _secret(tmp_path, "secret", os.urandom(16).hex())
    wrong = _secret(tmp_path, "wrong", os.urandom(16).hex())
    listen = f"{pair.prefill}:{PORT}"
    prefill = _demo(pair, "prefill", "--listen", listen, "--secret-file", secret)
    try:
        # A decode with another secret is refused by prefill's side channel, saying why.
        code, out = _finish(_demo(pair, "decode", "--prefill", listen, "--secret-file", wrong))
        assert code == 1, out[-3000:]
        assert "refused this decode" in out and "(unauthenticated)" in out, out[-3000:]
        assert "Both hosts need the same secret" in out

        before = pair.rx_bytes("decode")
        code, out = _finish(_demo(pair, "decode", "--prefill", listen, "--secret-file", secret))
        received = pair.rx_bytes("decode") - before
        assert code == 0 and "RESULT: PASS" in out, out[-5000:]
        assert re.search(r"layers holding prefill's KV \(owners \+ sharers\)\s+35/35", out)
        assert re.search(r"blocks misplaced\) detected\s+True \(\d+ bad", out)
        assert re.search(r"reordered block list\) refused by prefill\s+True", out)
        assert re.search(r"another secret\) refused by prefill\s+True", out)
        # The bytes crossed the link: UCX took prefill for another machine, READ over TCP
        # on the link, and the link carried at least what was read.
        paths = ucx_read_paths(out)
        assert paths and {scope for scope, _ in paths} == {"inter-node"}, paths
        assert same_machine_transports(paths) == [], paths
        assert {t for _, ts in paths for t in ts} == {f"tcp/{pair.veth('decode')}"}, paths
        read = _bytes_read(out)
        assert received >= read > 0, (received, read)
        print(f"two hosts: read {read:,} B, the link carried {received:,} B to decode; {paths}")
    finally:
        code, out = _finish(prefill, 120)
    assert code == 0 and "RESULT: PASS" in out, out[-5000:]
    assert re.search(r"requests read by decode\s+req-0, req-1", out)
    assert re.search(r"requests still held\s+0", out)


def test_network_namespaces_alone_leave_ucx_on_one_machine(pair, tmp_path):
    """The control of the link check above: the same two network namespaces, without the
    script's own hostname, IPC and PID namespaces, and UCX reads through CMA, past the link."""
    secret = _secret(tmp_path, "secret", os.urandom(16).hex())
    listen = f"{pair.prefill}:{PORT + 10}"
    prefill = _demo(pair, "prefill", "--listen", listen, "--secret-file", secret,
                    nsenter_only=True)  # fmt: skip
    try:
        before = pair.rx_bytes("decode")
        decode = _demo(pair, "decode", "--prefill", listen, "--secret-file", secret,
                       nsenter_only=True)  # fmt: skip
        code, out = _finish(decode)
        received = pair.rx_bytes("decode") - before
    finally:
        _finish(prefill, 120)
    assert code == 0 and "RESULT: PASS" in out, out[-5000:]
    paths = ucx_read_paths(out)
    assert {scope for scope, _ in paths} == {"intra-node"}, paths
    assert same_machine_transports(paths), paths  # e.g. cma/memory
    assert received < _bytes_read(out), received  # the KV did not cross the link
