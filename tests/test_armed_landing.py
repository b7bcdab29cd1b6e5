"""Armed landing (``transfer.gates``): decode queues a packed read's scatter behind a gate
right after the READ's post, and opens it once NIXL says the bytes are there.

Real NIXL READs between OS processes (``support/transfer_peer.py``), real KV memory. A
gate holds a CUDA stream on a host word, which needs the CUDA driver: here a stand-in
keeps each armed scatter and runs it when its gate opens, which is what the driver's
stream does (``tests/gpu/test_gpu_gates.py`` checks the real one). What is checked on the
CPU is the part that is ours: every armed gate is opened exactly once, after the READ is
done, on success and on failure; a failed read's copy ends before its slot and blocks go
back; and with every gate held, reads land unarmed.
"""

from __future__ import annotations

import time

import pytest

from kvshare_connector.common import failpoints
from kvshare_connector.devtools.demo import request_block_ids
from kvshare_connector.transfer.gates import Gate, Gates
from kvshare_connector.transfer.reads import Phase

from .support.transfer_decode import E2B, TOKENS, assert_landed, decoder_pool, new_id, with_defaults
from .support.transfer_peer import PeerProcess

SOURCES = with_defaults([
    {"name": "armed", "model": E2B, "layout": "kvcached_contiguous", "requests": 5,
     "seed": 830, "packed_mib": 40},
])  # fmt: skip


@pytest.fixture(scope="module")
def peer():
    with PeerProcess(SOURCES) as process:
        yield process


@pytest.fixture(scope="module")
def decoders(peer):
    yield from decoder_pool()


class QueuedGates(Gates):
    """``Gates`` (the real bookkeeping and keeper) over a stand-in for CUDA streams: what is
    queued on a held stream runs when its gate opens, at once on a stream let go."""

    def __init__(self, sink, streams: int = 2, hold_s: float = 60.0, wait_early: bool = False):
        self.sink = sink
        self.queued: dict[int, list | None] = {i: None for i in range(streams)}
        self.log: list[tuple[str, int, str | None]] = []  # (what, gate, phase of its read)
        self.wait_early = wait_early  # arm returns once the keeper has opened the gate
        super().__init__([("stream", i) for i in range(streams)], hold_s)

    def _phase(self, index: int, arming: bool = False) -> str | None:
        for read in list(self.sink._reads.values()):
            t = read.transfer
            if t is None:
                continue
            if (t.gate is None) if arming else (t.gate is not None and t.gate._index == index):
                return read.phase.name
        return None

    def _hold(self, index: int, value: int) -> None:
        self.queued[index] = []
        self.log.append(("armed", index, self._phase(index, arming=True)))

    def _release(self, index: int, value: int) -> None:
        self.log.append(("opened", index, self._phase(index)))
        work, self.queued[index] = self.queued[index] or [], None
        for job in work:
            job()

    def arm(self) -> Gate | None:
        gate = super().arm()
        if gate is None:
            self.log.append(("full", -1, None))
        elif self.wait_early:
            deadline = time.monotonic() + 10
            while not gate.opened:
                assert time.monotonic() < deadline, "the keeper never opened the gate"
                time.sleep(0.001)
        return gate


@pytest.fixture
def gated(monkeypatch):
    """``gated(decoder, **how)``: ``QueuedGates`` on its packer, closed after the test."""
    made: list[QueuedGates] = []

    def make(decoder, **how) -> QueuedGates:
        made.append(hold(decoder, monkeypatch, **how))
        return made[-1]

    yield make
    for gates in made:
        gates.close()


def hold(decoder, monkeypatch, **how) -> QueuedGates:
    """Gates on ``decoder``'s packer; its scatter, given a gate's stream, waits on it."""
    from kvshare_connector.transfer.packing import Copy

    packer = decoder.sink.packer
    gates = QueuedGates(decoder.sink, **how)
    scatter = packer.scatter

    def scatter_on(*args, stream=None, **kwargs):
        if stream is None:
            return scatter(*args, **kwargs)
        queue = gates.queued[stream[1]]
        if queue is None:  # let go already: runs now
            scatter(*args, **kwargs)
        else:
            queue.append(lambda: scatter(*args, **kwargs))
        return Copy(None)  # done once the queued work ran, which opening the gate does

    monkeypatch.setattr(packer, "gates", gates)
    monkeypatch.setattr(packer, "scatter", scatter_on)
    return gates


def test_an_armed_scatter_is_opened_once_the_read_is_done(peer, decoders, gated):
    decoder = decoders(E2B, "per_layer", packed_mib=16)
    gates = gated(decoder)
    request = peer.request("armed", 0)
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=71)
    rid = new_id("armed")
    result = decoder.read(request, local_ids, rid)
    assert_landed(decoder, result, local_ids)  # every byte where it belongs, verified
    assert result.packed
    # Armed while its READ was in flight, opened when NIXL said done (the read in READ
    # then: ``land`` runs before the phase moves on), once.
    assert gates.log == [("armed", 0, Phase.READ.name), ("opened", 0, Phase.READ.name)]
    assert gates.armed == 0 and decoder.sink.packer.staging.used == {}
    record = next(r for r in decoder.sink.records if r.request_id == rid)
    assert "armed" in record.landing_host and "open" in record.landing_host
    assert "scatter" not in record.landing_host  # nothing left to launch at the landing


def test_with_every_gate_held_a_read_lands_unarmed(peer, decoders, gated):
    decoder = decoders(E2B, "per_layer", packed_mib=16)
    gates = gated(decoder, streams=0)
    request = peer.request("armed", 1)
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=72)
    rid = new_id("unarmed")
    result = decoder.read(request, local_ids, rid)
    assert_landed(decoder, result, local_ids)
    assert result.packed and gates.log == [("full", -1, None)]
    record = next(r for r in decoder.sink.records if r.request_id == rid)
    assert "scatter" in record.landing_host and "armed" not in record.landing_host


def test_a_read_that_fails_after_arming_opens_its_gate_and_the_next_one_lands(
    peer, decoders, gated
):
    """A failure between the post and the READ seen done (the ``sink.read_posted``
    failpoint, right after arming) opens the gate and lets the queued scatter end before
    the slot and blocks are given back; the engine goes on, and the next read is armed."""
    decoder = decoders(E2B, "per_layer", packed_mib=16)
    gates = gated(decoder)
    request = peer.request("armed", 2)
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=73)
    failpoints.configure("sink.read_posted=fail*1")
    try:
        result = decoder.read(request, local_ids, new_id("armed-fails"))
    finally:
        failpoints.configure("")
    assert not result.done
    assert result.failure == "FailpointError: failpoint sink.read_posted fired", result.failure
    assert [what for what, _, _ in gates.log] == ["armed", "opened"]
    assert gates.armed == 0
    assert decoder.sink.packer.staging.used == {} or decoder.sink._stuck  # back, or NIXL's
    again = peer.request("armed", 3)
    result = decoder.read(again, local_ids, new_id("armed-after"))
    assert_landed(decoder, result, local_ids)
    assert [what for what, _, _ in gates.log] == ["armed", "opened", "armed", "opened"]


def test_a_gate_held_past_its_bound_is_opened_by_the_keeper_and_landed_again(peer, decoders, gated):
    """A held stream holds every device-wide synchronize too, so no gate outlives its
    bound: the keeper thread opens it (``early``), its copy may then run before the bytes
    are there, and the landing copies again once NIXL says done, after that copy."""
    decoder = decoders(E2B, "per_layer", packed_mib=16)
    gates = gated(decoder, hold_s=0.0, wait_early=True)
    request = peer.request("armed", 4)
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=74)
    rid = new_id("early")
    result = decoder.read(request, local_ids, rid)
    assert_landed(decoder, result, local_ids)
    assert [what for what, _, _ in gates.log] == ["armed", "opened"]
    record = next(r for r in decoder.sink.records if r.request_id == rid)
    assert {"armed", "open", "rescatter"} <= set(record.landing_host)
    assert gates.armed == 0 and decoder.sink.packer.staging.used == {}
