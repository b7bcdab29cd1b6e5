"""Failpoints: each named point exists where it says, is inert when off, and fires as armed
(in this process, and in a real prefill process that dies right after answering a claim)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvshare_connector.common import failpoints
from kvshare_connector.common.failpoints import FailpointError, failpoint
from kvshare_connector.demo.parts import request_block_ids

from .support.transfer_decode import TOKENS, decoder_pool, new_id, with_defaults
from .support.transfer_peer import PeerProcess

PACKAGE = Path(__file__).resolve().parents[1] / "kvshare_connector"


@pytest.fixture(autouse=True)
def _disarmed():
    failpoints.configure(None)
    yield
    failpoints.configure(None)


def test_every_point_sits_in_the_data_path_once():
    code = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "failpoints.py")
    for name in failpoints.POINTS:
        assert len(re.findall(rf'failpoint\("{re.escape(name)}"\)', code)) == 1, name


def test_off_every_point_is_inert():
    assert failpoints._ACTIVE == {}
    for name in failpoints.POINTS:
        failpoint(name)  # nothing happens
    failpoints.configure("sink.read_posted=fail")
    failpoint("source.claim_answered")  # another point: nothing happens either


def test_armed_points_fail_pause_and_count():
    failpoints.configure("sink.read_posted=fail*2;peers.handshake=pause:0.2")
    for _ in range(2):
        with pytest.raises(FailpointError, match="failpoint sink.read_posted fired"):
            failpoint("sink.read_posted")
    failpoint("sink.read_posted")  # the count is spent
    failpoints.configure("source.claim_answered=fail*1@3")  # a live server's warm-up passes
    for _ in range(3):
        failpoint("source.claim_answered")
    with pytest.raises(FailpointError):
        failpoint("source.claim_answered")
    failpoint("source.claim_answered")
    failpoints.configure("sink.read_posted=fail*2;peers.handshake=pause:0.2")
    started = time.monotonic()
    failpoint("peers.handshake")
    assert time.monotonic() - started >= 0.2


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nowhere=fail", "NAME one of"),
        ("sink.read_posted", "expected NAME=ACTION"),
        ("sink.read_posted=explode", "action must be fail, pause:SECONDS or exit"),
        ("sink.read_posted=pause", "action must be fail, pause:SECONDS or exit"),
        ("sink.read_posted=fail:3", "action must be fail, pause:SECONDS or exit"),
        ("sink.read_posted=pause:soon", "not a number"),
        ("sink.read_posted=fail*x", "not a number"),
        ("sink.read_posted=exit@soon", "@ wants the number of hits to let pass"),
    ],
)
def test_a_bad_spec_names_the_problem(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        failpoints.parse(spec)


def test_exit_kills_the_process_from_the_environment():
    code = "from kvshare_connector.common.failpoints import failpoint; failpoint('peers.handshake')"
    env = {"KVSHARE_FAILPOINTS": "peers.handshake=exit", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], env=env, timeout=120)
    assert done.returncode == failpoints.EXIT_CODE


# ---- in the data path, with real processes -------------------------------------------------

SOURCES = with_defaults([
    {"name": "fp", "model": "g4tiny", "layout": "per_layer", "requests": 2, "seed": 950},
    {"name": "fp_packed", "model": "g4tiny", "layout": "per_layer", "requests": 1,
     "seed": 960, "packed_mib": 16},
])  # fmt: skip


@pytest.fixture(scope="module")
def peer():
    with PeerProcess(SOURCES) as process:
        yield process


@pytest.fixture(scope="module")
def decoders(peer):
    yield from decoder_pool()


@pytest.mark.parametrize(
    ("point", "source", "packed_mib"),
    [("sink.read_posted", "fp", 0), ("sink.before_scatter", "fp_packed", 16),
     ("sink.before_report", "fp", 0)],
)  # fmt: skip
def test_a_decode_fault_fails_the_request_and_frees_prefill(peer, decoders, point, source,
                                                           packed_mib):  # fmt: skip
    decoder = decoders("g4tiny", "per_layer", packed_mib=packed_mib)
    index = {"sink.read_posted": 0, "sink.before_report": 1}.get(point, 0)
    request = peer.request(source, index)
    failpoints.configure(f"{point}=fail*1")
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=61)
    result = decoder.read(request, local_ids, new_id(point))
    assert not result.done
    assert result.failure == f"FailpointError: failpoint {point} fired", result.failure
    # The engine polls every step: that is what sends the abort notification on its way.
    deadline = time.monotonic() + 30
    while not [e for e in peer.events(source) if request["request_id"] in e["read"]]:
        assert time.monotonic() < deadline, "prefill never freed the request"
        decoder.sink.poll()
        time.sleep(0.01)
    released = peer.released_event(source, request["request_id"])
    assert request["request_id"] not in released["held"]  # freed at once, not at the lease
    if decoder.sink.packer is not None:
        assert decoder.sink.packer.staging.used == {}  # the staging slot came back


def test_a_prefill_that_dies_after_answering_the_claim_fails_the_read_cleanly(decoders):
    victim = PeerProcess(
        with_defaults([{"name": "dies", "model": "g4tiny", "layout": "per_layer",
                        "requests": 1, "seed": 970}]),
        env={"KVSHARE_FAILPOINTS": "source.claim_answered=exit"},
    )  # fmt: skip
    try:
        decoder = decoders("g4tiny", "per_layer")
        request = victim.request("dies", 0)
        local_ids = request_block_ids(decoder.topology, TOKENS, seed=62)
        result = decoder.read(request, local_ids, new_id("dies"))
        assert not result.done and result.bytes == 0 and decoder.untouched()
        assert "PeerDown" in result.failure or "HandshakeError" in result.failure, (
            result.failure
        )
        assert victim.process.wait(30) == failpoints.EXIT_CODE
        assert result.failure and "dies" not in decoder.sink.in_flight
    finally:
        victim.kill()
