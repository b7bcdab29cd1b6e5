"""Decode's prefill peers under failure, across real processes: a dead prefill delays only
its own requests, is evicted (its requests then fail at once, with the reason) and is
handshaken again once it is back; a prefill with another layout is remembered, not asked
again for every request.
"""

from __future__ import annotations

import os
import time

import pytest

from kvshare_connector.demo.parts import build, request_block_ids
from kvshare_connector.toolkit.procs import pick_free_port
from kvshare_connector.transfer.decode.sink import KVSink
from kvshare_connector.transfer.device.nixl import NixlTransport
from kvshare_connector.transfer.wire import protocol
from kvshare_connector.transfer.wire.kv_params import remote_prefill_params
from kvshare_connector.transfer.wire.settings import EngineSettings
from kvshare_connector.transfer.wire.side_channel_client import Pipe

from .support.transfer_peer import PeerProcess

TOKENS = 300
HANDSHAKE_S = 4.0  # the bound a dead prefill costs each ask (a loaded CI box is slow)
RETRY_S = 3.0


def source(name: str, model: str = "g4tiny", port: int = 0, requests: int = 6) -> dict:
    spec = {"name": name, "model": model, "layout": "per_layer", "requests": requests}
    return {**spec, "tokens": TOKENS, "kv_mib": 32, "seed": 40, "port": port}


@pytest.fixture(scope="module")
def alive():
    """The prefills that stay up: one healthy, one with another model's layout."""
    sources = [source("healthy"), source("other", model="g4uniform", requests=3)]
    with PeerProcess(sources) as process:
        yield process


@pytest.fixture(scope="module")
def sink():
    stack, topology = build("g4tiny", "per_layer", 16, 2048)  # kept alive by the fixture
    transport = NixlTransport(f"peers-{os.getpid()}", progress_thread=False)  # peer_env
    settings = EngineSettings(
        f"peers-{os.getpid()}", handshake_timeout_s=HANDSHAKE_S, transfer_timeout_s=10.0
    )
    made = KVSink(topology, transport, settings)
    made.peers.retry_s = RETRY_S
    made.test_topology = topology
    yield made
    del stack
    made.close()


def queue(sink: KVSink, request: dict, request_id: str, seed: int) -> None:
    local = request_block_ids(sink.test_topology, TOKENS, seed=seed)
    sink.request(request_id, remote_prefill_params(request["kv_transfer_params"]), local)


def run(sink: KVSink, ids: set[str], timeout_s: float) -> list[tuple[float, str, str | None]]:
    """Poll until every id is done or failed: ``(seconds, id, failure)`` in finish order."""
    start, out, left = time.monotonic(), [], set(ids)
    while left:
        assert time.monotonic() - start < timeout_s, f"{sorted(left)} still pending"
        done, failed = sink.poll()
        for request_id in sorted((done | set(failed)) & left):
            out.append((time.monotonic() - start, request_id, failed.get(request_id)))
            left.discard(request_id)
        time.sleep(0.002)
    return out


def test_dead_prefill_is_evicted_without_delaying_others_and_rejoins(sink, alive):
    port = pick_free_port()
    healthy = alive
    doomed = PeerProcess([source("doomed", port=port)])
    try:
        # Both handshaken and serving. (Both peers ready before either read is queued: a
        # read's bounds run from when it is queued, and a peer can take long to start.)
        first = doomed.request("doomed", 0)
        queue(sink, healthy.request("healthy", 0), "h0", 1)
        queue(sink, first, "d0", 2)
        assert [f for _, _, f in run(sink, {"h0", "d0"}, 30)] == [None, None]

        doomed.kill()  # SIGKILL: its side channel never answers again
        for i in range(1, 5):
            queue(sink, doomed.request("doomed", i), f"d{i}", 10 + i)
        queue(sink, healthy.request("healthy", 1), "h1", 20)
        finished = run(sink, {"d1", "d2", "d3", "d4", "h1"}, 30)

        # The healthy prefill's request is not queued behind the dead one's asks (a dead
        # prefill whose port refuses fails them at once; one that hangs, at the timeout).
        ((h1_s, h1_failure),) = [(s, f) for s, rid, f in finished if rid == "h1"]
        assert h1_failure is None and h1_s < HANDSHAKE_S
        failures = {rid: reason for _, rid, reason in finished if rid != "h1"}
        assert all(failures.values()), failures
        assert any("PeerDown" in r for r in failures.values()), failures
        # Evicted: a new request for it fails at once, saying why, without another wait.
        queue(sink, doomed.request("doomed", 5), "d5", 30)
        ((seconds, _, reason),) = run(sink, {"d5"}, HANDSHAKE_S)
        assert "PeerUnavailable" in reason and "next try" in reason
        assert seconds < HANDSHAKE_S / 2

        # Restarted on the same port (a new engine id, new NIXL agent): it rejoins once
        # the retry time has passed.
        time.sleep(RETRY_S)
        restarted = PeerProcess([source("doomed", port=port)])
        try:
            queue(sink, restarted.request("doomed", 0), "r0", 40)
            assert run(sink, {"r0"}, 30)[0][2] is None
        finally:
            restarted.stop()
    finally:
        doomed.stop()


def test_prefill_with_another_layout_is_remembered_not_asked_again(sink, alive, monkeypatch):
    other = alive
    fetched = []
    fetch = sink.peers._fetch
    monkeypatch.setattr(sink.peers, "_fetch", lambda *a: fetched.append(a) or fetch(*a))
    for i in range(3):
        queue(sink, other.request("other", i), f"o{i}", 50 + i)
        ((_, _, reason),) = run(sink, {f"o{i}"}, 30)
        assert "LayoutMismatch" in reason and "KV cache group count" in reason
    assert len(fetched) == 1


def test_a_steps_claims_to_one_prefill_go_in_one_message(sink, alive, monkeypatch):
    """Requests that reach the CLAIM phase together are claimed in one message, each with
    its own reader token, and all land (one ask per request queued them on two threads)."""
    claims: list[protocol.Claim] = []
    send = Pipe.send

    def counting(pipe, payload, *bound):
        message = protocol.decode(payload)
        if isinstance(message, protocol.Claim):
            claims.append(message)
        return send(pipe, payload, *bound)

    monkeypatch.setattr(Pipe, "send", counting)
    ids = {f"batch-{i}" for i in range(4)}
    for i, request_id in enumerate(sorted(ids)):
        queue(sink, alive.request("healthy", i + 2), request_id, seed=200 + i)
    # the peer is known already (or handshakes first): every read becomes due in one advance
    results = run(sink, ids, timeout_s=30)
    assert [failure for _, _, failure in results] == [None] * len(ids)
    assert len(claims) == 1, [c.request_ids for c in claims]
    claim = claims[0]
    assert len(claim.request_ids) == len(ids) == len(set(claim.tokens.values()))
    assert set(claim.tokens) == set(claim.request_ids) == set(claim.block_ids)


def test_claim_batches_split_by_prefill_and_caps():
    from kvshare_connector.transfer.decode.reads import Read, ReadOrder, claim_batches

    def read(host_port: int, rid: str, blocks: int = 2, readers: int = 1) -> Read:
        params = remote_prefill_params({
            "do_remote_prefill": True, "remote_engine_id": f"p{host_port}",
            "remote_host": "127.0.0.1", "remote_port": host_port,
            "remote_block_ids": [list(range(1, blocks + 1))], "remote_request_id": rid,
        })  # fmt: skip
        return Read(ReadOrder(f"local-{rid}-{host_port}-{readers}", params, [[1]], readers=readers))

    reads = [read(1, "a"), read(2, "a"), read(1, "b"), read(1, "a"), read(1, "c", readers=2)]
    batches = [[r.order.request_id for r in b] for b in claim_batches(reads)]
    assert sorted(batches) == sorted([
        ["local-a-1-1", "local-b-1-1"],  # prefill 1: one message ...
        ["local-a-1-1"],  # ... a remote id named twice goes in the next one
        ["local-a-2-1"],  # prefill 2
        ["local-c-1-2"],  # other TP readers
    ])  # fmt: skip
    many = [read(1, f"r{i}") for i in range(protocol.MAX_IDS_PER_MESSAGE + 1)]
    assert [len(b) for b in claim_batches(many)] == [protocol.MAX_IDS_PER_MESSAGE, 1]
    big = protocol.MAX_BLOCK_IDS_PER_MESSAGE // 2 + 1
    assert [len(b) for b in claim_batches([read(1, "x", big), read(1, "y", big)])] == [1, 1]


def _until_read(sink: KVSink, peer: PeerProcess, name: str, deadline_s: float) -> list[str]:
    """One fresh request of ``peer`` after another until one is read or ``deadline_s``
    passed: every failure's reason, in order, then ``"read"`` if one was."""
    outcomes: list[str] = []
    start, i = time.monotonic(), 0
    while time.monotonic() - start < deadline_s:
        queue(sink, peer.request(name, i), f"{name}-again-{i}", 70 + i)
        ((_, _, reason),) = run(sink, {f"{name}-again-{i}"}, 30)
        outcomes.append("read" if reason is None else reason)
        if reason is None:
            break
        i += 1
        time.sleep(0.5)
    return outcomes


@pytest.mark.parametrize("early", [True, False])
def test_a_prefill_back_on_its_address_is_read_before_its_pause_ends(sink, monkeypatch, early):
    """A failed prefill is handshaken in the background while its requests fail at once;
    back on its address (here a restart, as a mended link), it is read again long before
    its pause (120 s) ends. Control: without background tries, none is read meanwhile."""
    from kvshare_connector.transfer.decode import peers

    monkeypatch.setattr(sink.peers, "retry_s", 120.0)
    if not early:
        monkeypatch.setattr(peers, "EARLY_TRY_S", 1e6)
    port = pick_free_port()
    name = f"back{int(early)}"
    first = PeerProcess([source(name, port=port, requests=2)])
    try:
        queue(sink, first.request(name, 0), f"{name}-0", 60)
        assert run(sink, {f"{name}-0"}, 30)[0][2] is None
        doomed = first.request(name, 1)
        first.kill()
        queue(sink, doomed, f"{name}-1", 61)
        ((_, _, reason),) = run(sink, {f"{name}-1"}, 30)
        assert reason is not None  # the prefill is gone: decode computes it
    finally:
        first.stop()
    back = PeerProcess([source(name, port=port, requests=40)])
    try:
        outcomes = _until_read(sink, back, name, deadline_s=40.0 if early else 6.0)
    finally:
        back.stop()
    failures = [o for o in outcomes if o != "read"]
    assert all("PeerUnavailable" in f for f in failures), failures  # at once, with the reason
    if early:
        assert outcomes[-1] == "read", outcomes
    else:
        assert "read" not in outcomes and failures, outcomes
