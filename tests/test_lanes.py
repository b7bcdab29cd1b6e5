"""The UCX lane: what the connector sets before NIXL starts, what it keeps of the user's,
how a probe's reading is named, and ``kvshare lane`` between two real processes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from kvshare_connector.transfer.device import lanes
from kvshare_connector.transfer.device.lane_watch import Seen
from kvshare_connector.transfer.device.lanes import GET_ZCOPY, RMA_PPLN, RX_SEG, TLS, TX_SEG
from kvshare_connector.transfer.device.records import LaneReport
from kvshare_connector.transfer.wire.protocol import ProbeRef


@pytest.fixture(autouse=True)
def _forget_applied(monkeypatch):
    """No UCX variable set by an earlier in-process engine of this pytest process (its
    loopback prefill leaves UCX_NET_DEVICES=lo here), restored afterwards."""
    monkeypatch.setattr(lanes, "_APPLIED", {})
    for key in [k for k in os.environ if k.startswith("UCX_")]:
        monkeypatch.delenv(key)


def test_gpu_memory_gets_cuda_ipc_get_zero_copy():
    plan = lanes.plan_lane({"VRAM"}, vmm=False, environ={})
    assert plan.chosen == {GET_ZCOPY: "y"} and plan.kept == {}
    assert "cuda_ipc GET zero-copy" in plan.describe()


def test_vmm_memory_also_gets_the_pipelined_protocol():
    plan = lanes.plan_lane({"VRAM"}, vmm=True, environ={})
    assert plan.chosen == {GET_ZCOPY: "y", RMA_PPLN: "y"}
    assert "VMM" in plan.reasons[RMA_PPLN]


def test_host_memory_and_off_leave_ucx_alone():
    assert lanes.plan_lane({"DRAM"}, vmm=False, environ={}).chosen == {}
    assert lanes.plan_lane({"VRAM"}, vmm=True, environ={}, mode="off").chosen == {}
    assert lanes.plan_lane({"DRAM"}, vmm=False, environ={}).describe() == "UCX defaults"
    with pytest.raises(ValueError, match="ucx_lane must be one of"):
        lanes.plan_lane({"VRAM"}, vmm=False, environ={}, mode="fast")


def test_the_users_own_setting_wins():
    environ = {GET_ZCOPY: "n"}
    plan = lanes.plan_lane({"VRAM"}, vmm=True, environ=environ)
    assert plan.chosen == {RMA_PPLN: "y"} and plan.kept == {GET_ZCOPY: "n"}
    lanes.apply(plan, environ)
    assert environ == {GET_ZCOPY: "n", RMA_PPLN: "y"}
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=n (yours, kept)" in plan.describe()


def test_what_this_process_set_is_not_taken_for_the_users():
    """A second agent in the same process (a test, a kv_both engine rebuilt after sleep)
    plans the same, instead of reading the first one's choice as the user's."""
    environ: dict[str, str] = {}
    lanes.apply(lanes.plan_lane({"VRAM"}, vmm=False, environ=environ), environ)
    again = lanes.plan_lane({"VRAM"}, vmm=False, environ=environ)
    assert again.chosen == {GET_ZCOPY: "y"} and again.kept == {}
    assert lanes.effective(environ) == {GET_ZCOPY: "y"}


NET_DEVICES = "UCX_NET_DEVICES"


def reach(loopback: bool) -> lanes.Reach:
    return (
        lanes.Reach(True, "side channel on 127.0.0.1")
        if loopback
        else (lanes.Reach(False, "side channel on 10.0.0.5"))
    )


def test_a_loopback_side_channel_keeps_ucx_on_loopback():
    """Issue 46 item 11: UCX's network devices follow the side channel's reach."""
    on_lo = reach(True)
    plan = lanes.plan_lane({"DRAM"}, vmm=False, environ={}, reach=on_lo)
    assert plan.chosen == {NET_DEVICES: lanes.loopback_device()}
    assert lanes.loopback_device() == "lo"  # Linux's name; found by its IFF_LOOPBACK flag
    assert plan.describe() == (
        "UCX_NET_DEVICES=lo (side channel on 127.0.0.1: UCX on loopback only)"
    )
    environ: dict[str, str] = {}
    lanes.apply(lanes.plan_lane({"VRAM"}, vmm=False, environ=environ, reach=on_lo), environ)
    assert lanes.effective(environ) == {GET_ZCOPY: "y", NET_DEVICES: "lo"}  # the lane report's


def test_where_ucx_is_not_restricted_the_plan_says_where_it_listens_and_why():
    on_lo, off_lo = reach(True), reach(False)
    beyond = lanes.plan_lane({"DRAM"}, vmm=False, environ={}, reach=off_lo)
    assert NET_DEVICES not in beyond.chosen
    assert beyond.describe().endswith(
        "; UCX listens on every network device (side channel on 10.0.0.5)"
    )
    off = lanes.plan_lane({"VRAM"}, vmm=False, environ={}, mode="off", reach=on_lo)
    assert off.chosen == {} and "every network device (ucx_lane off; side channel on" in (
        off.describe()
    )
    yours = lanes.plan_lane({"DRAM"}, vmm=False, environ={NET_DEVICES: "eth0"}, reach=on_lo)
    assert yours.chosen == {} and yours.describe() == "UCX_NET_DEVICES=eth0 (yours, kept)"
    # Without a reach (``kvshare lane``, the benchmarks), nothing is said or set.
    assert lanes.plan_lane({"DRAM"}, vmm=False, environ={}).describe() == "UCX defaults"


def test_a_later_plan_unsets_what_this_process_set_for_an_earlier_one():
    """A prefill and a decode agent in one process (tests): the decode that may reach any
    host does not inherit the prefill's loopback restriction."""
    on_lo, off_lo = reach(True), reach(False)
    environ: dict[str, str] = {}
    lanes.apply(lanes.plan_lane({"DRAM"}, vmm=False, environ=environ, reach=on_lo), environ)
    assert environ == {NET_DEVICES: "lo"}
    lanes.apply(lanes.plan_lane({"DRAM"}, vmm=False, environ=environ, reach=off_lo), environ)
    remote = {k: v for k, (v, _) in lanes.REMOTE_TCP.items()}
    assert environ == remote
    lanes.apply(lanes.plan_lane({"DRAM"}, vmm=False, environ=environ, reach=on_lo), environ)
    assert environ == {NET_DEVICES: "lo"}  # and back: the remote settings were this process's
    mine = {NET_DEVICES: "ib0"}  # the user's own value is never unset
    lanes.apply(lanes.plan_lane({"DRAM"}, vmm=False, environ=mine, reach=off_lo), mine)
    assert mine == {NET_DEVICES: "ib0", **remote}


@pytest.mark.parametrize(
    ("serves", "connects", "loopback", "why"),
    [
        ("127.0.0.1", (), True, "side channel on 127.0.0.1"),
        ("localhost", (), True, "side channel on localhost"),
        ("::1", (), True, "side channel on ::1"),
        ("192.0.2.2", (), False, "side channel on 192.0.2.2"),
        (None, ("127.0.0.1", "localhost"), True, "every allowed prefill on loopback"),
        (None, None, False, "allowed_prefills unset: decode may reach a prefill on any host"),
        (None, ("127.0.0.1", "10.0.0.5"), False, "allowed_prefills names 10.0.0.5"),
        ("127.0.0.1", ("::1",), True, "side channel on 127.0.0.1 and every allowed prefill"),
        ("127.0.0.1", None, False, "allowed_prefills unset"),  # kv_both, any prefill
    ],
)
def test_the_side_channels_reach(serves, connects, loopback, why):
    got = lanes.side_channel_reach(serves, connects)
    assert got.loopback is loopback and got.why.startswith(why)


TCP = Seen("tcp", "eth1, 10.0.0.2:4000 -> 10.0.0.1:5000", "eth1")
LO = Seen("tcp", "lo, 127.0.0.1:4000 -> 127.0.0.1:5000", "lo", loopback=True)
NOTHING = Seen(None)
TUNED = {TX_SEG: "256k", RX_SEG: "256k"}


def verdict(kinds, gbps, seen, same_host=False, mine=None, theirs=TUNED, rdma=(), speeds=None):
    return lanes.verdict(*kinds, gbps, seen, same_host, mine or {}, theirs, rdma, speeds or {})


def test_a_slow_gpu_read_is_named_with_its_fix():
    slow = verdict(("VRAM", "VRAM"), 0.5, LO, same_host=True)
    assert slow.slow and slow.lane == "tcp" and slow.where.startswith("lo,")
    assert f"{GET_ZCOPY}=y" in slow.fix and "'auto'" in slow.fix
    enabled = verdict(("VRAM", "VRAM"), 0.5, NOTHING, True, {GET_ZCOPY: "y"})
    assert enabled.slow and "UCX_TLS" in enabled.fix and "peer access" in enabled.fix
    assert enabled.lane == "cuda_ipc"  # no socket or RDMA port carried it
    remote = verdict(("VRAM", "VRAM"), 0.5, TCP, False, {GET_ZCOPY: "y"})
    assert remote.slow and "RDMA" in remote.fix and "UCX_NET_DEVICES" in remote.fix


def test_a_lane_is_named_by_what_carried_its_bytes():
    assert verdict(("VRAM", "VRAM"), 900.0, NOTHING, True) == lanes.Verdict(
        "cuda_ipc", False, None, "inside this machine"
    )
    assert verdict(("DRAM", "DRAM"), 0.1, NOTHING).lane == "shm/cma"  # whatever the address
    fast_rdma = verdict(("VRAM", "VRAM"), 40.0, Seen("rdma", "mlx5_0:1"))
    assert fast_rdma == lanes.Verdict("rdma", False, None, "mlx5_0:1")
    assert verdict(("VRAM", "VRAM"), 1.0, Seen("rdma", "mlx5_0:1")).slow  # no GPUDirect
    tcp = verdict(("DRAM", "DRAM"), 1.2, TCP)
    assert tcp == lanes.Verdict("tcp", False, None, TCP.where)  # tcp is the lane there is


def test_a_slow_tcp_lane_names_its_fix():
    """Issue 48 item 2: the fix names UCX_TLS, UCX_NET_DEVICES, or the segments."""
    one_host = verdict(("DRAM", "DRAM"), 1.0, LO, True, {TLS: "tcp"})
    assert one_host.slow and f"{TLS}=tcp leaves them out" in one_host.fix
    containers = verdict(("DRAM", "DRAM"), 1.0, LO, True)
    assert "--ipc=host --pid=host" in containers.fix
    rdma = verdict(("DRAM", "DRAM"), 1.0, TCP, mine={TLS: "tcp"}, rdma=["mlx5_0:1"])
    assert rdma.slow and "mlx5_0:1" in rdma.fix and f"{TLS} (now tcp)" in rdma.fix
    assert "UCX_NET_DEVICES (now unset) naming mlx5_0:1" in rdma.fix
    nic = verdict(("DRAM", "DRAM"), 1.0, TCP, speeds={"eth1": 1000, "eth2": 100000})
    assert nic.slow and "UCX_NET_DEVICES=eth2" in nic.fix and "1000 Mb/s" in nic.fix
    small = verdict(("DRAM", "DRAM"), 0.4, TCP, theirs={})
    assert small.slow and "8 KiB messages" in small.fix and f"{TX_SEG}=256k" in small.fix
    assert verdict(("DRAM", "DRAM"), 0.4, TCP, theirs={TX_SEG: "32k"}).slow
    assert not verdict(("DRAM", "DRAM"), 0.4, TCP, theirs={TX_SEG: "64k"}).slow


def test_remote_side_channels_get_the_tcp_settings():
    """Issue 48 item 2: beyond loopback a READ may be tcp: larger segments, a mutex."""
    plan = lanes.plan_lane({"DRAM"}, vmm=False, environ={}, reach=reach(False))
    assert plan.chosen == {k: v for k, (v, _) in lanes.REMOTE_TCP.items()}
    assert "UCX_TCP_TX_SEG_SIZE=256k (a tcp READ in 256 KiB messages" in plan.describe()
    on_lo = lanes.plan_lane({"DRAM"}, vmm=False, environ={}, reach=reach(True))
    assert TX_SEG not in on_lo.chosen  # one host: no tcp READ to tune
    off = lanes.plan_lane({"DRAM"}, vmm=False, environ={}, mode="off", reach=reach(False))
    assert off.chosen == {}
    # the user's segments win, and ours fit around them (UCX refuses TX > RX)
    big = lanes.plan_lane({"DRAM"}, False, environ={TX_SEG: "1m"}, reach=reach(False))
    assert TX_SEG not in big.chosen and big.chosen[RX_SEG] == "1m"
    small = lanes.plan_lane({"DRAM"}, False, environ={RX_SEG: "64k"}, reach=reach(False))
    assert small.chosen[TX_SEG] == "64k" and RX_SEG not in small.chosen
    assert "UCX_TCP_RX_SEG_SIZE=64k (yours, kept)" in small.describe()


def test_every_ucx_setting_in_force_is_reported(monkeypatch):
    """Not only the lane variables: UCX_TLS, UCX_PROTO_INFO, whatever the user set."""
    environ = {"UCX_TLS": "tcp", "UCX_LOG_LEVEL": "info", "OTHER": "x"}
    plan = lanes.plan_lane({"DRAM"}, False, environ=environ, reach=reach(False))
    described = plan.describe()
    assert "UCX_TLS=tcp (yours, kept)" in described
    assert "UCX_LOG_LEVEL=info (yours, kept)" in described and "OTHER" not in described
    lanes.apply(plan, environ)
    assert lanes.effective(environ) == {**plan.chosen, "UCX_LOG_LEVEL": "info", "UCX_TLS": "tcp"}
    assert lanes.describe_settings({}) == "UCX defaults"


def test_segments_decode_cannot_receive_are_refused():
    """A tcp segment larger than the peer receives crashes UCX (SIGSEGV, seen): refused."""
    assert lanes.memunits("256k", 0) == 256 << 10 and lanes.memunits("1mb", 0) == 1 << 20
    assert lanes.memunits("65536", 0) == 65536 and lanes.memunits("auto", 7) == 7
    assert lanes.segment_problem({}, {}) is None  # UCX's defaults: 8k into 64k
    assert lanes.segment_problem({TX_SEG: "64k"}, {}) is None
    problem = lanes.segment_problem({TX_SEG: "256k"}, {})
    assert problem and "64k, UCX default" in problem and RX_SEG in problem
    assert lanes.segment_problem({TX_SEG: "256k"}, {RX_SEG: "256k"}) is None


def test_local_hosts():
    assert lanes.is_local_host("127.0.0.1") and lanes.is_local_host("::1")
    assert lanes.is_local_host("localhost")
    assert not lanes.is_local_host("192.0.2.7")  # TEST-NET-1: never this machine


def test_slow_lane_is_logged_as_a_warning_with_the_fix(caplog):
    from kvshare_connector.transfer.device.probe import log_lane

    report = LaneReport("prefill-0", "10.0.0.1:5600", 8 << 20, 0.016, 0.52, "tcp", True,
                        "set UCX_X=y", where=TCP.where, ucx={"UCX_TLS": "tcp"},
                        peer_ucx={TX_SEG: "8k"})  # fmt: skip
    ref = ProbeRef(0, 8 << 20, 0, 1, {}, kv_ipc_capable=False)
    with caplog.at_level(logging.INFO, logger="vllm.kvshare"):
        log_lane(report, ref)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    text = record.getMessage()
    assert "SLOW lane" in text and "set UCX_X=y" in text and "0.5 GB/s" in text
    assert f": tcp ({TCP.where})" in text  # the transport and its path, not the address
    assert f"UCX, prefill: {TX_SEG}=8k; decode: UCX_TLS=tcp" in text
    assert "UCX_RMA_PPLN_ENABLE=y" in text  # prefill's KV is VMM memory


def test_kvshare_lane_between_two_processes():
    """The CLI's probe on this (CPU) host: shared memory, every byte checked."""
    from kvshare_connector.toolkit.lane import measure

    result = measure("cpu", "cpu", mib=1)
    assert result["lane"] == "shm/cma" and not result["slow"]
    assert result["nbytes"] == 1 << 20 and result["gbps"] > 0
    assert result["decode_settings"] == "UCX defaults"


def test_kvshare_lane_keeps_forced_settings_where_cuda_ipc_cannot_work(monkeypatch):
    """The GPU lane's settings forced on a host without CUDA: UCX falls back, the READ still
    lands and is checked, and the forced values are reported as the user's."""
    monkeypatch.setenv(GET_ZCOPY, "y")
    monkeypatch.setenv(RMA_PPLN, "y")
    out = subprocess.run(
        [sys.executable, "-m", "kvshare_connector.toolkit.cli", "lane",
         "--prefill-device", "cpu", "--mib", "1", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["lane"] == "shm/cma" and not result["slow"]
    assert f"{GET_ZCOPY}=y (yours, kept)" in result["decode_settings"]
    assert f"{RMA_PPLN}=y (yours, kept)" in result["prefill_settings"]


def test_decode_refuses_a_prefill_whose_segments_it_cannot_receive(monkeypatch):
    """Through the real handshake: a prefill process sending 1 MiB tcp segments (its UCX
    settings come in the handshake) is refused by a decode receiving UCX's 64 KiB before
    any READ, naming the fix. Control: the same decode receiving 1 MiB reads it."""
    from kvshare_connector.demo.parts import build, request_block_ids
    from kvshare_connector.transfer.decode.sink import KVSink
    from kvshare_connector.transfer.device.nixl import NixlTransport
    from kvshare_connector.transfer.wire.kv_params import remote_prefill_params
    from kvshare_connector.transfer.wire.settings import EngineSettings

    from .support.transfer_peer import PeerProcess

    tokens, spec = 300, {"name": "big", "model": "g4tiny", "layout": "per_layer", "requests": 2}
    spec = {**spec, "tokens": tokens, "kv_mib": 32, "seed": 41, "port": 0}
    stack, topology = build("g4tiny", "per_layer", 16, 2048)
    sink = KVSink(topology, NixlTransport(f"seg-{os.getpid()}", progress_thread=False),
                  EngineSettings(f"seg-{os.getpid()}", transfer_timeout_s=30.0))  # fmt: skip
    sink.peers.retry_s = 0.0

    def read(index: int) -> str | None:
        params = remote_prefill_params(peer.request("big", index)["kv_transfer_params"])
        sink.request(f"r{index}", params, request_block_ids(topology, tokens, seed=index))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, failed = sink.poll()
            if f"r{index}" in done or failed:
                return failed.get(f"r{index}")
            time.sleep(0.002)
        raise AssertionError("the read did not finish")

    try:
        with PeerProcess([spec], env={TX_SEG: "1m", RX_SEG: "1m"}) as peer:
            refused = read(0)
            assert refused and "UCX would crash on the first READ" in refused, refused
            assert f"{RX_SEG} here at least {TX_SEG} there" in refused
            monkeypatch.setenv(RX_SEG, "1m")  # what UCX reads at start: this decode's report
            assert read(1) is None
    finally:
        sink.close()
        del stack


def test_kvshare_lane_on_one_host_over_tcp_is_slow_and_names_its_fix(monkeypatch):
    """UCX_TLS=tcp keeps UCX from shared memory: the probe's bytes cross loopback's TCP, the
    lane is tcp on lo, slow, and the fix names UCX_TLS. Control: the two-process test above
    (UCX's defaults: shm/cma, not slow)."""
    from kvshare_connector.toolkit.lane import measure

    monkeypatch.setenv(TLS, "tcp")
    result = measure("cpu", "cpu", mib=1)
    assert result["lane"] == "tcp" and result["where"].startswith("lo, 127.0.0.1:"), result
    assert result["slow"] and f"{TLS}=tcp leaves them out" in result["fix"]
    assert result["prefill_ucx"] == {TLS: "tcp"} == result["decode_ucx"]


def test_kvshare_lane_against_a_prefills_side_channel():
    """``kvshare lane --prefill HOST:PORT`` against a prefill's own side channel (a KVSource
    with its KV and probe, not a lane peer): the engine id learned from its first answer, the
    probe READ and checked. Control: a prefill whose probe holds other bytes fails it."""
    from .support.transfer_peer import PeerProcess

    spec = {"model": "g4tiny", "layout": "per_layer", "requests": 1, "tokens": 300,
            "kv_mib": 16, "seed": 42, "port": 0, "probe_mib": 1}  # fmt: skip
    peers = [{**spec, "name": "honest"}, {**spec, "name": "liar", "probe_lie": True}]
    with PeerProcess(peers) as peer:
        runs = {}
        for name in ("honest", "liar"):
            where = f"127.0.0.1:{peer.source(name)['port']}"
            runs[name] = subprocess.run(
                [sys.executable, "-m", "kvshare_connector.toolkit.cli", "lane", "--device",
                 "cpu", "--prefill", where, "--mib", "1", "--json"],
                capture_output=True, text=True, timeout=300, check=False,
            )  # fmt: skip
    assert runs["honest"].returncode == 0, runs["honest"].stderr[-2000:]
    result = json.loads(runs["honest"].stdout.strip().splitlines()[-1])
    assert result["lane"] == "shm/cma" and result["nbytes"] == 1 << 20
    assert result["peer"] == peer.source("honest")["engine_id"]
    assert runs["liar"].returncode == 1 and "other bytes than prefill's pattern" in (
        runs["liar"].stderr
    )
