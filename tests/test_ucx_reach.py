"""UCX listens no further than the side channel reaches (issue 46, item 11).

Creating a NIXL agent opens UCX's TCP listeners on every network interface; with the side
channel on 127.0.0.1 that put KV memory's transport on the host's other interface too
(192.0.2.2 on the machine where it was found). A real prefill (``support/lane_peer.py``,
``NixlWorker`` per TP rank) runs in its own process, so the listening sockets read from
/proc are its own; decode is this process, and READs from it over NIXL with the same
restriction. The control turns ``ucx_lane`` off: UCX then listens beyond loopback.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
import time
from pathlib import Path

import pytest

from kvshare_connector.backends.base import WorkerContext
from kvshare_connector.backends.nixl import NixlWorker, RecvRequest
from kvshare_connector.backends.options import ConnectorOptions
from kvshare_connector.common.child_process import Child
from kvshare_connector.transfer.device import lanes
from kvshare_connector.transfer.wire import kv_params

from .support.lane_peer import bound_sockets

TOKENS = 200
_SIOCGIFADDR = 0x8915


def addresses_beyond_loopback() -> dict[str, str]:
    """This host's IPv4 interface addresses that are not loopback (name -> address)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(
                    s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode())
                )
            except OSError:  # no IPv4 address
                continue
            address = socket.inet_ntoa(packed[20:24])
            if not ipaddress.ip_address(address).is_loopback:
                found[name] = address
    return found


@pytest.fixture
def clean_ucx_env(monkeypatch):
    """No UCX_NET_DEVICES of anyone's (an in-process test's prefill may have set it in
    this process) and no memory of what this process set: the plan alone decides."""
    for key in ("UCX_NET_DEVICES", lanes.LANE_ENV):
        monkeypatch.setenv(key, "")  # remembers the value to restore, or that there was none
        monkeypatch.delenv(key)
    monkeypatch.setattr(lanes, "_APPLIED", {})


def opened_by_the_connector(
    ready: dict,
) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """The prefill process's bound sockets now, less those it had before the connector
    started (side channels and UCX's listeners remain)."""
    return [(a, p) for a, p in bound_sockets(ready["pid"]) if f"{a}:{p}" not in ready["before"]]


def start_prefill(tp: int, ucx_lane: str) -> tuple[Child, dict]:
    child = Child(["-m", "tests.support.lane_peer", "--tp", str(tp), "--ucx-lane", ucx_lane],
                  cwd=str(Path(__file__).resolve().parents[1]))  # fmt: skip
    try:
        return child, child.wait_json("READY ", timeout_s=240)
    except BaseException:
        child.kill()
        raise


def decode_worker(allowed: list[str]) -> tuple[NixlWorker, object, object, str]:
    from kvshare_connector.demo.cpu_stack import build_cpu_stack, topology_of

    stack = build_cpu_stack("gemma4_e2b_kv4", "per_layer", kv_bytes=128 << 20,
                            max_model_len=1024, kv_heads=4)  # fmt: skip
    topology = topology_of(stack)
    options = ConnectorOptions.parse({
        "allowed_prefills": allowed, "handshake_timeout_s": 30, "transfer_timeout_s": 30,
        "staging_mib": 16,
    }, environ={})  # fmt: skip
    context = WorkerContext(engine_id="decode-lane", role="kv_consumer", host="127.0.0.1",
                            port=0, model_name="m", options=options, model_kv_heads=4)  # fmt: skip
    worker = NixlWorker(context)
    return worker, stack, topology, worker.start(topology, stack.kv_caches)


def test_ucx_listens_on_loopback_only_and_a_tp_prefill_is_read_through_it(clean_ucx_env):
    """A TP2 prefill with its side channels on 127.0.0.1: every socket UCX listens on is
    loopback, and decode (allowed_prefills ``127.0.0.1:base``, so loopback-only too)
    READs both ranks' head slices from it, byte for byte."""
    from kvshare_connector.demo.parts import requests_block_ids
    from kvshare_connector.transfer.decode.shards import rank_shard
    from lab.tools.headcheck import head_mismatches

    child, ready = start_prefill(tp=2, ucx_lane="auto")
    decode = None
    try:
        params = kv_params.remote_prefill_params(ready["kv_transfer_params"])
        base = params.remote_port
        sockets = opened_by_the_connector(ready)
        ucx = [(a, p) for a, p in sockets if p not in (base, base + 1)]  # not a side channel
        assert ucx, f"no UCX listener found among {sockets}"
        beyond = [f"{a}:{p}" for a, p in sockets if not a.is_loopback]
        assert beyond == [], f"prefill listens beyond loopback: {beyond}"
        for line in ready["lines"]:
            assert "UCX_NET_DEVICES=lo (side channel on 127.0.0.1: UCX on loopback only)" in line

        decode, stack, topology, line = decode_worker([f"127.0.0.1:{base}"])
        assert "UCX_NET_DEVICES=lo (every allowed prefill on loopback" in line
        local = requests_block_ids(topology, TOKENS, 1, 9)[0]
        assert decode.start_loads([RecvRequest("d-req", local, params, TOKENS, 0)]) == {}
        loaded, deadline = set(), time.monotonic() + 120
        while not loaded and time.monotonic() < deadline:
            progress = decode.poll()
            assert progress.failed == {}
            loaded |= progress.loaded
            time.sleep(0.002)
        assert loaded == {"d-req"}
        shard = rank_shard(topology, 1, 0, 4)
        compared, problems = head_mismatches(stack.kv_caches, topology, shard, local, 1)
        assert compared > 0 and problems == []
    finally:
        if decode is not None:
            decode.close()
        child.kill()


def test_control_without_the_restriction_ucx_listens_beyond_loopback(clean_ucx_env):
    """``ucx_lane: off`` leaves UCX's defaults: its listener is on the host's other
    interfaces too, and the start line says so."""
    beyond_here = addresses_beyond_loopback()
    if not beyond_here:
        pytest.skip("this host has no IPv4 interface beyond loopback for UCX to listen on")
    child, ready = start_prefill(tp=1, ucx_lane="off")
    try:
        sockets = opened_by_the_connector(ready)
        beyond = {str(a) for a, _ in sockets if not a.is_loopback}
        assert beyond & {*beyond_here.values(), "0.0.0.0", "::"}, (beyond_here, sockets)
        (line,) = ready["lines"]
        assert (
            "UCX defaults; UCX listens on every network device (ucx_lane off; side channel "
            "on 127.0.0.1)"
        ) in line
    finally:
        child.kill()
