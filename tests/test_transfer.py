"""Real NIXL transfers between OS processes over UCX on 127.0.0.1, checked byte for byte.

Prefill side: a ``transfer_peer.py`` process (vLLM's real KV memory for Gemma-4 shaped
models, several ``KVSource``s in it, each request filled with its own pattern). Decode
side: this process, one ``KVSink`` per memory layout (``support/transfer_decode.py``).
What goes wrong (garbage, dead peers, leases, bad params) is ``test_transfer_faults.py``.
"""

from __future__ import annotations

import time

import pytest

from kvshare_connector.demo import kvcheck
from kvshare_connector.demo.parts import request_block_ids
from kvshare_connector.layout.descriptors import transfer_descriptors
from kvshare_connector.layout.matching import EngineIdentity, pair_owners
from kvshare_connector.transfer.device.records import PHASES
from kvshare_connector.transfer.wire import kv_params

from .support.transfer_decode import (
    E2B,
    HANDSHAKE_S,
    TOKENS,
    assert_landed,
    decoder_pool,
    new_id,
    scattered,
    with_defaults,
)
from .support.transfer_peer import PeerProcess

PEER_SOURCES = with_defaults([
    # g4tiny: 10 layers, 4 sharers, 6 KV cache groups (5 sliding head 64, 1 full head 128).
    {"name": "tiny", "model": "g4tiny", "layout": "per_layer", "requests": 10, "seed": 100},
    # g4uniform: one group of 6 full-attention owners: vLLM's cross-layer blocks tensor.
    {"name": "uniform_cl", "model": "g4uniform", "layout": "cross_layer", "requests": 3,
     "seed": 200},
    {"name": "uniform_pl", "model": "g4uniform", "layout": "per_layer", "requests": 1,
     "seed": 300},
    # E2B: 3 owners per group, so kvcached's contiguous layout interleaves them per block.
    {"name": "e2b_kvc", "model": E2B, "layout": "kvcached_contiguous", "requests": 2,
     "seed": 400},
    {"name": "e2b_pl", "model": E2B, "layout": "per_layer", "requests": 1, "seed": 500},
    # Packs each held request into a staging area: read as a few large runs.
    {"name": "e2b_packed", "model": E2B, "layout": "kvcached_contiguous", "requests": 6,
     "seed": 800, "packed_mib": 40},
    # Says which model it runs: decode compares the identity with its own.
    {"name": "ident", "model": "g4tiny", "layout": "per_layer", "requests": 2, "seed": 700,
     "identity": {"model": "google/gemma-4-E2B-it", "model_config_hash": "c0ffee",
                  "dtype": "bfloat16", "cache_dtype": "auto", "block_size": 16,
                  "vllm_version": "0.26.0"}},
    # Lane probes: a 1 MiB pattern decode READs and checks after the handshake; the liar's
    # buffer holds another pattern than its handshake names.
    {"name": "probed", "model": "g4tiny", "layout": "per_layer", "requests": 1, "seed": 900,
     "probe_mib": 1},
    {"name": "probe_liar", "model": "g4tiny", "layout": "per_layer", "requests": 1,
     "seed": 910, "probe_mib": 1, "probe_lie": True},
    {"name": "probed_slow", "model": "g4tiny", "layout": "per_layer", "requests": 1,
     "seed": 920, "probe_mib": 1},
])  # fmt: skip


@pytest.fixture(scope="module")
def peer():
    with PeerProcess(PEER_SOURCES) as process:
        yield process


@pytest.fixture(scope="module")
def decoders(peer):
    """Depends on ``peer`` so that the peer starts importing vLLM while this process does."""
    yield from decoder_pool()


# ---- byte-for-byte reads --------------------------------------------------------------


def test_per_layer_read_every_layer_byte_for_byte(peer, decoders):
    decoder = decoders("g4tiny", "per_layer")
    request = peer.request("tiny", 0)
    remote_ids = request["kv_transfer_params"]["remote_block_ids"]
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=11)
    assert len(decoder.topology.groups) == 6 and len(decoder.topology.sharers) == 4
    kinds = {(g.spec.kind, g.spec.head_size) for g in decoder.topology.groups}
    assert kinds == {("sliding", 64), ("full", 128)}
    for local, remote in zip(local_ids, remote_ids, strict=True):
        assert len(local) == len(remote) >= 2
        assert local != remote and scattered(local) and scattered(remote)

    result = decoder.read(request, local_ids, new_id("per-layer"))

    assert_landed(decoder, result, local_ids)
    assert len(decoder.stack.kv_caches) == 10
    # Prefill freed the blocks on decode's notification: nothing stays held for it. (The
    # peer polls once it has built all its sources: on a slow box that can take a while.)
    assert peer.all_ready.wait(300)
    released = peer.released_event("tiny", request["request_id"])
    assert request["request_id"] in released["read"]
    assert request["request_id"] not in released["held"]


def test_read_with_nixl_progress_thread_on(peer, decoders):
    """The transfer tests' agents run without NIXL's progress thread
    (``transfer_peer.peer_env``); the product's default has it on, and a read through it
    lands too."""
    decoder = decoders("g4tiny", "per_layer", progress_thread=True)
    assert decoder.transport.progress_thread
    assert not decoders("g4tiny", "per_layer").transport.progress_thread
    request = peer.request("tiny", 6)
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=19)
    assert_landed(decoder, decoder.read(request, local_ids, new_id("thread-on")), local_ids)
    released = peer.released_event("tiny", request["request_id"])
    assert request["request_id"] in released["read"]


def test_the_reads_of_one_step_are_all_posted_before_any_is_watched(peer, decoders):
    """Three requests claimed in one message: the advance that gets the answer posts all
    three READs, then watches them together (watched one by one, each READ waited for the
    landing of the one before it). Every layer of each lands byte for byte."""
    decoder = decoders("g4tiny", "per_layer")
    decoder.zero()
    reads = {}
    taken: set[int] = set()  # the three reads land in blocks of their own
    seeds = iter(range(40, 1000))
    for i, index in enumerate((7, 8, 9)):  # requests no other test reads
        request = peer.request("tiny", index)
        local_ids = request_block_ids(decoder.topology, TOKENS, seed=next(seeds))
        while taken & {b for ids in local_ids for b in ids}:
            local_ids = request_block_ids(decoder.topology, TOKENS, seed=next(seeds))
        taken |= {b for ids in local_ids for b in ids}
        rid = new_id(f"batch{i}")
        decoder.sink.request(rid, kv_params.remote_prefill_params(
            request["kv_transfer_params"]), local_ids)  # fmt: skip
        reads[rid] = (request, local_ids)
    done: set[str] = set()
    deadline = time.monotonic() + HANDSHAKE_S + 30
    while done != set(reads) and time.monotonic() < deadline:
        finished, failed = decoder.sink.poll(spin_s=1.0)  # a long watch: all three land in it
        assert not set(failed) & set(reads), failed  # (another test's leftovers: not ours)
        done |= finished & set(reads)
        time.sleep(0.001)
    assert done == set(reads)
    records = {r.request_id: r for r in decoder.sink.records if r.request_id in reads}
    posted = [r.timeline["posted"] + reads_created(decoder, r) for r in records.values()]
    arrived = [r.timeline["arrived"] + reads_created(decoder, r) for r in records.values()]
    assert max(posted) <= min(arrived), (posted, arrived)
    for record in records.values():  # every phase a load passes, in order
        marks = [(p, record.timeline[p]) for p in PHASES if p in record.timeline]
        assert {"posted", "arrived", "launched", "landed"} <= {p for p, _ in marks}, marks
        assert [t for _, t in marks] == sorted(t for _, t in marks), marks
        assert record.landing_host == {}  # unpacked, unverified: nothing to launch
    for rid, (request, local_ids) in reads.items():
        assert kvcheck.mismatches(decoder.stack.kv_caches, decoder.topology, local_ids,
                                  seed=request["seed"]) == [], rid  # fmt: skip


def reads_created(decoder, record) -> float:
    """When the read of ``record`` was created (its timeline counts from there)."""
    return decoder.sink._created[record.request_id]


def test_negative_controls_fail_the_same_check(peer, decoders):
    decoder = decoders("g4tiny", "per_layer")
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=12)
    layers = set(decoder.stack.kv_caches)

    def bad_layers(mismatches: list[str]) -> set[str]:
        return {m.split(" ")[0] for m in mismatches}

    # 1. The read skipped: nothing there.
    decoder.zero()
    request = peer.request("tiny", 1)
    missing = kvcheck.mismatches(
        decoder.stack.kv_caches, decoder.topology, local_ids, seed=request["seed"]
    )
    assert bad_layers(missing) == layers

    # 2. The read pointed at the wrong remote blocks (each group's list reversed): prefill
    # refuses the claim, naming the order, and nothing moves. Read into decode's blocks in
    # the reversed order instead: bytes move, into the request's blocks only, and every
    # layer is caught holding the wrong ones at its positions.
    reversed_ids = [
        list(reversed(ids)) for ids in request["kv_transfer_params"]["remote_block_ids"]
    ]
    refused = decoder.read(request, local_ids, new_id("wrong"), remote_block_ids=reversed_ids)
    assert not refused.done and "in their order" in refused.failure, refused.failure
    assert decoder.untouched()
    reversed_local = [list(reversed(ids)) for ids in local_ids]
    wrong = decoder.read(request, reversed_local, new_id("wrong"), check_ids=local_ids)
    assert wrong.done, wrong.failure
    assert wrong.stray == []
    assert bad_layers(wrong.mismatches) == layers

    # 3. Another request's blocks (same positions, another prefill pattern).
    other = peer.request("tiny", 2)
    swapped = decoder.read(
        request, local_ids, new_id("other"),
        remote_block_ids=other["kv_transfer_params"]["remote_block_ids"],
        remote_request_id=other["request_id"],
    )  # fmt: skip
    assert swapped.done, swapped.failure
    assert bad_layers(swapped.mismatches) == layers

    # 4. The right read, checked at the wrong local blocks: caught; at the right ones: clean.
    request = peer.request("tiny", 3)
    good = decoder.read(request, local_ids, new_id("good"))
    assert_landed(decoder, good, local_ids)
    rolled = [ids[1:] + ids[:1] for ids in local_ids]
    caught = kvcheck.mismatches(
        decoder.stack.kv_caches, decoder.topology, rolled, seed=request["seed"]
    )
    assert bad_layers(caught) == layers


LAYOUT_CASES = [
    # (peer source, request index, decode model, decode layout)
    ("uniform_cl", 0, "g4uniform", "cross_layer"),
    ("uniform_cl", 1, "g4uniform", "per_layer"),
    ("uniform_pl", 0, "g4uniform", "cross_layer"),
    ("e2b_kvc", 0, E2B, "kvcached_contiguous"),
    ("e2b_kvc", 1, E2B, "per_layer"),
    ("e2b_pl", 0, E2B, "kvcached_contiguous"),
]


@pytest.mark.parametrize(
    ("source", "index", "model", "layout"),
    LAYOUT_CASES,
    ids=[f"{s}->{layout}" for s, _, _, layout in LAYOUT_CASES],
)
def test_read_between_memory_layouts(peer, decoders, source, index, model, layout):
    decoder = decoders(model, layout)
    info = peer.source(source)
    request = info["requests"][index]
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=13 + index)
    for local, remote in zip(
        local_ids, request["kv_transfer_params"]["remote_block_ids"], strict=True
    ):
        assert local != remote and scattered(local)

    result = decoder.read(request, local_ids, new_id(f"{source}-{layout}"))

    assert_landed(decoder, result, local_ids)
    assert decoder.topology.layout == layout
    assert info["layout"] == next(s["layout"] for s in PEER_SOURCES if s["name"] == source)
    assert peer.released_event(source, request["request_id"])


def test_a_packed_read_is_reported_only_once_its_scatter_is_done(peer, decoders, monkeypatch):
    """The engine thread never waits for the scatter: while the device says it runs, the
    read stays in LAND with its staging slot held, and polls return at once. (The device's
    word is a CUDA event; a CPU box has none, so a stand-in answers "running" 6 times.)"""
    from kvshare_connector.transfer.decode.reads import Phase
    from kvshare_connector.transfer.device.packing import Copy

    packed = decoders(E2B, "per_layer", packed_mib=16)
    queries: list[bool] = []

    class Running:
        def query(self) -> bool:
            queries.append(len(queries) >= 6)
            return queries[-1]

        def synchronize(self) -> None:
            raise AssertionError("the engine thread waited for the scatter")

    scatter, poll, seen = packed.sink.packer.scatter, packed.sink.poll, []

    plans = []

    def scatter_running(*args, **kwargs):
        plans.append(kwargs.get("plan"))  # planned while the READ was in flight
        scatter(*args, **kwargs)
        return Copy(Running())

    def watched_poll(spin_s=0.0):
        out = poll(spin_s=0.0)
        seen.extend((r.phase, dict(packed.sink.packer.staging.used)) for r in
                    packed.sink._reads.values())  # fmt: skip
        return out

    monkeypatch.setattr(packed.sink.packer, "scatter", scatter_running)
    monkeypatch.setattr(packed.sink, "poll", watched_poll)
    request = peer.source("e2b_packed")["requests"][5]
    local_ids = request_block_ids(packed.topology, TOKENS, seed=33)
    result = packed.read(request, local_ids, new_id("landing"))
    assert_landed(packed, result, local_ids)
    assert result.packed and queries[-1] is True and len(queries) >= 7
    assert len(plans) == 1 and plans[0] is not None and plans[0].rows, plans
    landing = [used for phase, used in seen if phase is Phase.LAND]
    assert len(landing) >= 2 and all(landing)  # polled while it ran: the slot stayed taken
    assert packed.sink.packer.staging.used == {}  # and came back once it was done


def test_packed_read_lands_every_block_in_a_few_descriptors(peer, decoders):
    """Prefill packed each held request into its staging area; a decode with one reads it
    as a few large runs and scatters it; a decode without one reads block by block."""
    info = peer.source("e2b_packed")
    packed = decoders(E2B, "per_layer", packed_mib=16)
    request = info["requests"][0]
    local_ids = request_block_ids(packed.topology, TOKENS, seed=31)
    result = packed.read(request, local_ids, new_id("packed"))
    assert_landed(packed, result, local_ids)
    record = next(r for r in packed.sink.records if r.bytes == result.bytes and r.packed)
    direct_rows = len(
        transfer_descriptors(
            pair_owners(packed.topology, packed.topology),
            local_ids,
            request["kv_transfer_params"]["remote_block_ids"],
            packed.topology.num_blocks,
            info["num_blocks"],
        )[0]
    )
    assert record.descriptors * 10 <= direct_rows  # prefill's runs, not one per block
    assert packed.sink.packer.staging.used == {}  # the slot came back after the scatter
    assert peer.released_event("e2b_packed", request["request_id"])

    # The same check fails on a packed read scattered into the wrong positions (decode's
    # ids reversed; a reversed remote list is refused by prefill's claim check).
    request = info["requests"][1]
    reversed_local = [list(reversed(ids)) for ids in local_ids]
    wrong = packed.read(request, reversed_local, new_id("packed-wrong"), check_ids=local_ids)
    assert wrong.done, wrong.failure
    assert wrong.stray == [] and len(wrong.mismatches) > 0

    # Once prefill's claim reply is in, one poll posts the READ, sees it done and scatters:
    # the engine learns of the load in the step the reply arrived, not steps later.
    request = info["requests"][3]
    rid = new_id("one-poll")
    packed.zero()
    packed.sink.request(
        rid, kv_params.remote_prefill_params(request["kv_transfer_params"]), local_ids
    )
    packed.sink.advance()  # what start_load_kv does: the claim leaves now
    deadline = time.monotonic() + 30
    while not (packed.sink._reads[rid].claim and packed.sink._reads[rid].claim.done()):
        assert time.monotonic() < deadline, "no claim reply"
        time.sleep(0.01)
        packed.sink.peers.pump()  # reads the reply off the socket, as the next step does
    done, failed = packed.sink.poll(spin_s=10.0)
    assert rid in done, failed
    assert (
        kvcheck.mismatches(packed.stack.kv_caches, packed.topology, local_ids, seed=request["seed"])
        == []
    )

    # A decode without a staging area reads the packed prefill block by block.
    direct = decoders(E2B, "kvcached_contiguous")
    request = info["requests"][2]
    local_ids = request_block_ids(direct.topology, TOKENS, seed=33)
    result = direct.read(request, local_ids, new_id("unpacked"))
    assert_landed(direct, result, local_ids)
    assert not next(r for r in direct.sink.records if r.bytes == result.bytes).packed


@pytest.mark.parametrize(
    ("model", "layout", "regions", "owners_per_block"),
    [
        ("g4uniform", "per_layer", 6, 1),
        ("g4uniform", "cross_layer", 1, 6),  # all 6 owners inside one block
        (E2B, "per_layer", 3, 1),
        (E2B, "kvcached_contiguous", 1, 3),  # the 3 owners of a group interleaved per block
    ],
)
def test_the_layouts_really_differ(decoders, model, layout, regions, owners_per_block):
    """The layouts read between above are not the same memory under other names."""
    from kvshare_connector.vllm import compat

    topology = decoders(model, layout).topology
    if not compat.HAS_KV_CACHE_LAYOUT:  # vLLM 0.33 puts a KV group's layers in one buffer
        assert len(topology.regions) == regions
    for owner in topology.owners.values():
        assert owner.geometry.block_stride == owners_per_block * owner.spec.page_bytes


# ---- a layout the decode side cannot take ---------------------------------------------


@pytest.mark.parametrize(
    ("source", "model", "layout", "expected"),
    [
        (
            "tiny",
            "g4uniform",
            "per_layer",
            ["KV cache group count: local 1, remote 6", "group 0 kind: local full, remote sliding"],
        ),
        (
            "uniform_cl",
            "g4tiny",
            "per_layer",
            [
                "KV cache group count: local 6, remote 1",
                "group 0 block_size: local 32, remote 16",
                "layer model.layers.9.self_attn.attn: local shares the KV of "
                "model.layers.4.self_attn.attn, remote shares the KV of model.layers.5",
                "block content order differs",
            ],
        ),
    ],
)
def test_layout_mismatch_fails_and_says_what_differs(
    peer, decoders, source, model, layout, expected
):
    decoder = decoders(model, layout)
    request = peer.request(source, {"tiny": 4, "uniform_cl": 2}[source])  # own request
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=1)
    decoder.zero()
    request_id = new_id("mismatch")
    decoder.sink.request(
        request_id, kv_params.remote_prefill_params(request["kv_transfer_params"]), local_ids
    )
    done, failure, _ = decoder.wait(request_id, HANDSHAKE_S + 5)

    assert not done
    assert failure.startswith("LayoutMismatch: KV layouts do not match")
    for line in expected:
        assert line in failure, failure
    assert decoder.untouched()  # not a byte moved
    assert request_id not in decoder.sink.in_flight
    # Decode is no NIXL peer of prefill, so it says so on the side channel: prefill frees
    # the blocks now, not when the lease (300 s here) ends.
    released = peer.released_event(source, request["request_id"])
    assert request["request_id"] in released["read"]
    assert request["request_id"] not in released["held"]


def test_engine_identity_mismatch_fails_and_names_each_difference(peer, decoders):
    """Same KV layout, another model (or dtype, vLLM, ...): refused before a byte moves."""
    info = peer.source("ident")
    same = EngineIdentity(**next(s for s in PEER_SOURCES if s["name"] == "ident")["identity"])
    other = EngineIdentity("google/gemma-4-E4B-it", "beef", "float16", "fp8", 16, same.vllm_version)
    decoder = decoders("g4tiny", "per_layer", identity=other)
    request = info["requests"][0]
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=41)
    result = decoder.read(request, local_ids, new_id("identity"))
    assert not result.done and result.failure.startswith("LayoutMismatch"), result.failure
    for line in (
        "model: local google/gemma-4-E4B-it, remote google/gemma-4-E2B-it",
        "model_config_hash: local beef, remote c0ffee",
        "dtype: local float16, remote bfloat16",
        "cache_dtype: local fp8, remote auto",
    ):
        assert line in result.failure, result.failure
    assert "block_size" not in result.failure and "vllm_version" not in result.failure
    assert result.bytes == 0 and decoder.untouched()

    # The same identity reads.
    match = decoders("g4tiny", "per_layer", identity=same)
    request = info["requests"][1]
    local_ids = request_block_ids(match.topology, TOKENS, seed=42)
    assert_landed(match, match.read(request, local_ids, new_id("identity-ok")), local_ids)


def test_block_count_mismatch_fails_before_a_byte_moves(peer, decoders):
    """Decode holds one block fewer than prefill sent in one group: refused, not silently
    read into the tail."""
    decoder = decoders("g4tiny", "per_layer")
    request = peer.request("tiny", 5)
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=43)
    local_ids[5] = local_ids[5][1:]
    result = decoder.read(request, local_ids, new_id("count"))
    assert not result.done
    assert result.failure.startswith(
        "BlockIdsMismatch: group 5: prefill sent 19 block(s), decode"
    ), result.failure
    assert result.bytes == 0 and decoder.untouched()
    released = peer.released_event("tiny", request["request_id"])  # decode freed it
    assert request["request_id"] not in released["held"]


# ---- the lane probe --------------------------------------------------------------------


def test_lane_probe_measures_and_verifies_before_the_first_read(peer, decoders):
    """A new prefill's lane is READ, checked byte for byte and measured before any KV moves;
    the read that waited for it lands, and the lane is reported once."""
    decoder = decoders("g4tiny", "per_layer", probe_mib=1)
    request = peer.request("probed", 0)
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=51)
    assert_landed(decoder, decoder.read(request, local_ids, new_id("probed")), local_ids)
    (lane,) = decoder.sink.take_lanes()
    assert lane.peer == peer.source("probed")["engine_id"]
    assert lane.lane == "shm/cma" and not lane.slow and lane.fix is None  # one host, CMA
    assert lane.nbytes == 1 << 20 and lane.gbps > 0 and lane.seconds > 0
    assert lane.reads == 3  # a fast lane: no READ again
    assert decoder.sink.take_lanes() == []


def test_a_slow_reading_is_read_again_before_the_lane_is_called_slow(peer, decoders, monkeypatch):
    """A busy GPU slows a probe READ over cuda_ipc to a few GB/s (2026-12-03d): a slow
    reading is read again, spaced out, for ``PATIENCE_S`` before the verdict, and the speed
    is the fastest READ's. Host memory never reads slow, so the verdict is made to call
    every speed slow here; the probe test above is the control (3 READs, at once)."""
    from kvshare_connector.transfer.device import probe
    from kvshare_connector.transfer.device.lanes import Verdict

    monkeypatch.setattr(probe, "PATIENCE_S", 0.6)
    monkeypatch.setattr(probe, "RETRY_GAP_S", 0.1)
    speeds: list[float] = []

    def always_slow(local_kind, remote_kind, gbps, *_):
        speeds.append(gbps)
        return Verdict("slow with cuda_ipc GET enabled", True, "check UCX_TLS")

    monkeypatch.setattr(probe, "verdict", always_slow)
    decoder = decoders("g4tiny", "per_layer", probe_mib=1)
    request = peer.request("probed_slow", 0)
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=53)
    assert_landed(decoder, decoder.read(request, local_ids, new_id("slow")), local_ids)
    (lane,) = decoder.sink.take_lanes()
    assert lane.slow and lane.lane == "slow with cuda_ipc GET enabled"
    assert lane.reads > probe.TIMED_READS and lane.spread_s >= 0.6
    assert lane.reads == len(speeds) + probe.TIMED_READS - 1  # a verdict per timed READ
    assert lane.gbps == pytest.approx(max(speeds))  # the fastest READ's speed
    assert speeds == sorted(speeds)  # the fastest so far, each time


def test_lane_probe_with_wrong_bytes_fails_before_any_kv_moves(peer, decoders):
    """Negative control of the probe's check: a prefill whose probe holds other bytes than
    it names fails the read (and is evicted) before a byte of KV moves."""
    decoder = decoders("g4tiny", "per_layer", probe_mib=1)
    request = peer.request("probe_liar", 0)
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=52)
    result = decoder.read(request, local_ids, new_id("liar"))
    assert not result.done
    assert result.failure.startswith("ProbeError: the lane probe READ from"), result.failure
    assert "other bytes than prefill's pattern" in result.failure
    assert result.bytes == 0 and decoder.untouched()
    assert decoder.sink.take_lanes() == []
