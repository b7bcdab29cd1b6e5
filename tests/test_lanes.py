"""The UCX lane: what the connector sets before NIXL starts, what it keeps of the user's,
how a probe's reading is named, and ``kvshare lane`` between two real processes."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from kvshare_connector.transfer import lanes
from kvshare_connector.transfer.lanes import GET_ZCOPY, RMA_PPLN
from kvshare_connector.transfer.protocol import ProbeRef
from kvshare_connector.transfer.records import LaneReport


@pytest.fixture(autouse=True)
def _forget_applied(monkeypatch):
    """No lane variable set by an earlier in-process engine of this pytest process (its
    loopback prefill leaves UCX_NET_DEVICES=lo here), restored afterwards."""
    monkeypatch.setattr(lanes, "_APPLIED", {})
    for key in (GET_ZCOPY, RMA_PPLN, "UCX_NET_DEVICES"):
        monkeypatch.setenv(key, "")  # remembers the value to restore, or that there was none
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
    assert beyond.chosen == {}
    assert beyond.describe() == (
        "UCX defaults; UCX listens on every network device (side channel on 10.0.0.5)"
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
    assert environ == {}
    mine = {NET_DEVICES: "ib0"}  # the user's own value is never unset
    lanes.apply(lanes.plan_lane({"DRAM"}, vmm=False, environ=mine, reach=off_lo), mine)
    assert mine == {NET_DEVICES: "ib0"}


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


def test_a_slow_gpu_read_is_named_with_its_fix():
    slow = lanes.verdict("VRAM", "VRAM", 0.5, same_host=True, environ={})
    assert slow.slow and slow.lane == "software emulation (tcp)"
    assert f"{GET_ZCOPY}=y" in slow.fix and "'auto'" in slow.fix
    enabled = lanes.verdict("VRAM", "VRAM", 0.5, same_host=True, environ={GET_ZCOPY: "y"})
    assert enabled.slow and "UCX_TLS" in enabled.fix and "peer access" in enabled.fix
    assert enabled.lane == "slow with cuda_ipc GET enabled"  # not named tcp: not known
    remote = lanes.verdict("VRAM", "VRAM", 0.5, same_host=False, environ={GET_ZCOPY: "y"})
    assert remote.slow and "RDMA" in remote.fix


def test_a_fast_read_is_named_by_where_the_peer_is():
    assert lanes.verdict("VRAM", "VRAM", 900.0, True, {}) == lanes.Verdict(
        "cuda_ipc zero-copy", False
    )
    assert lanes.verdict("VRAM", "VRAM", 40.0, False, {}).lane == "GPU RDMA"
    assert lanes.verdict("DRAM", "DRAM", 0.1, True, {}) == lanes.Verdict("host memory", False)


def test_local_hosts():
    assert lanes.is_local_host("127.0.0.1") and lanes.is_local_host("::1")
    assert lanes.is_local_host("localhost")
    assert not lanes.is_local_host("192.0.2.7")  # TEST-NET-1: never this machine


def test_slow_lane_is_logged_as_a_warning_with_the_fix(caplog):
    from kvshare_connector.transfer.probe import log_lane

    report = LaneReport("prefill-0", "127.0.0.1:5600", 8 << 20, 0.016, 0.52,
                        "software emulation (tcp)", True, "set UCX_X=y")  # fmt: skip
    ref = ProbeRef(0, 8 << 20, 0, 1, {}, kv_ipc_capable=False)
    with caplog.at_level(logging.INFO, logger="vllm.kvshare"):
        log_lane(report, ref)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    text = record.getMessage()
    assert "SLOW lane" in text and "set UCX_X=y" in text and "0.5 GB/s" in text
    assert "UCX_RMA_PPLN_ENABLE=y" in text  # prefill's KV is VMM memory


def test_kvshare_lane_between_two_processes():
    """The CLI's probe on this (CPU) host: host memory, every byte checked."""
    from kvshare_connector.toolkit.lane import measure

    result = measure("cpu", "cpu", mib=1)
    assert result["lane"] == "host memory" and not result["slow"]
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
    assert result["lane"] == "host memory" and not result["slow"]
    assert f"{GET_ZCOPY}=y (yours, kept)" in result["decode_settings"]
    assert f"{RMA_PPLN}=y (yours, kept)" in result["prefill_settings"]
