"""``verify_kv`` across real NIXL processes: decode's blocks are checked against prefill's
digests before a load counts as done, and every way they can differ fails the load.

Prefill: a ``transfer_peer.py`` process whose sources digest what they hold (some of them
then overwrite a held block: the KV changed after prefill computed it). Decode: this
process, a ``KVSink`` with a digester. The negative controls read the same bytes without
verification, to show that the transfer alone does not notice.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import time

import msgspec
import numpy as np
import pytest

from kvshare_connector.demo import kvcheck
from kvshare_connector.demo.parts import (
    build,
    cpu_digester,
    cpu_packer,
    read_and_check,
    request_block_ids,
)
from kvshare_connector.layout import verification
from kvshare_connector.layout.verification import compare, remote_ids_of
from kvshare_connector.transfer.decode import claims as claims_module
from kvshare_connector.transfer.decode.sink import KVSink
from kvshare_connector.transfer.device.nixl import NixlTransport
from kvshare_connector.transfer.wire import protocol
from kvshare_connector.transfer.wire.settings import EngineSettings

from .support.transfer_peer import PeerProcess, overwrite_first_block

TOKENS = 300
E2B = "gemma4_e2b_shape"
SOURCES = [
    {"name": "tiny", "model": "g4tiny", "layout": "per_layer", "requests": 4, "seed": 10,
     "verify": True, "corrupt": [2, 3]},
    {"name": "packed", "model": E2B, "layout": "kvcached_contiguous", "requests": 5,
     "seed": 20, "verify": True, "corrupt": [1], "packed_mib": 32, "kv_mib": 64},
    {"name": "plain", "model": "g4tiny", "layout": "per_layer", "requests": 1, "seed": 30},
    # tamper cases: request 2i read with verify_kv, 2i+1 without (the negative control)
    {"name": "tamper", "model": "g4tiny", "layout": "per_layer", "requests": 10, "seed": 40,
     "verify": True},
    {"name": "tamper_packed", "model": E2B, "layout": "kvcached_contiguous", "requests": 2,
     "seed": 60, "verify": True, "packed_mib": 16, "kv_mib": 64},
    {"name": "reorder", "model": "g4tiny", "layout": "per_layer", "requests": 6, "seed": 80,
     "verify": True},
]  # fmt: skip
for _spec in SOURCES:
    _spec.setdefault("tokens", TOKENS)
    _spec.setdefault("kv_mib", 32)
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def peer():
    with PeerProcess(SOURCES) as process:
        yield process


class Decode:
    def __init__(self, model: str, layout: str, kv_mib: int, verify: bool, packed_mib: int = 0):
        self.stack, self.topology = build(model, layout, kv_mib, 2048)
        name = f"verify-{model}-{layout}-{verify}-{os.getpid()}"
        self.sink = KVSink(
            self.topology,
            NixlTransport(name, progress_thread=False),  # see transfer_peer.peer_env
            EngineSettings(name, handshake_timeout_s=10.0, transfer_timeout_s=10.0),
            packer=cpu_packer(self.stack, packed_mib),
            digester=cpu_digester(self.stack) if verify else None,
        )

    def read(self, request: dict, seed_offset: int, request_id: str):
        for region in self.topology.regions:
            ctypes.memset(region.addr, 0, region.nbytes)
        local_ids = request_block_ids(self.topology, TOKENS, seed=seed_offset)
        result = read_and_check(
            self.sink,
            self.stack,
            self.topology,
            request["kv_transfer_params"],
            local_ids,
            seed=request["seed"],
            request_id=request_id,
            timeout_s=TIMEOUT_S,
        )
        return result, local_ids


@pytest.fixture(scope="module")
def decodes(peer):
    made: dict[tuple, Decode] = {}

    def get(model: str, layout: str, verify: bool, packed_mib: int = 0, kv_mib: int = 16):
        key = (model, layout, verify, packed_mib)
        if key not in made:
            made[key] = Decode(model, layout, kv_mib, verify, packed_mib)
        return made[key]

    yield get
    for decode in made.values():
        decode.sink.close()


def layer_blocks(topology, local_ids) -> int:
    return sum(len(local_ids[o.group]) for o in topology.owners.values())


def record_of(sink: KVSink, request_id: str):
    return next(r for r in sink.records if r.request_id == request_id)


def test_verified_read_matches_prefill_and_counts_every_layer_block(peer, decodes):
    decode = decodes("g4tiny", "per_layer", verify=True)
    failures = decode.sink.counters["verify_failures"]  # other tests share this sink
    result, local_ids = decode.read(peer.request("tiny", 0), 1, "v-direct")

    assert result.done, result.failure
    assert result.mismatches == [] and result.stray == []
    assert record_of(decode.sink, "v-direct").verified == layer_blocks(decode.topology, local_ids)
    assert decode.sink.counters["verify_failures"] == failures


def test_verified_packed_read_between_layouts(peer, decodes):
    decode = decodes(E2B, "per_layer", verify=True, packed_mib=16, kv_mib=48)
    result, local_ids = decode.read(peer.request("packed", 0), 2, "v-packed")

    assert result.done, result.failure
    assert result.packed
    assert result.mismatches == []
    record = record_of(decode.sink, "v-packed")
    assert record.verified == layer_blocks(decode.topology, local_ids)
    # The landing's host parts are in the record (the read log), inside arrived -> launched;
    # the digest plan (made while the claim was out) and the scatter's (while the READ was)
    # are parts of their own, before it.
    parts = dict(record.landing_host)
    assert parts.pop("digest_plan") > 0 and parts.pop("scatter_plan") > 0, record.landing_host
    # Their index uploads are parts of them (on the CPU: the digests' indices stay the
    # array, the scatter's become a tensor over it).
    for plan in ("digest", "scatter"):
        upload = parts.pop(f"{plan}_upload")
        assert 0 <= upload <= record.landing_host[f"{plan}_plan"], record.landing_host
    assert set(parts) == {"release", "scatter", "digests"}, record.landing_host
    launch = record.timeline["launched"] - record.timeline["arrived"]
    assert 0 < sum(parts.values()) <= launch + 1e-3, (record.landing_host, launch)


def spy_scatter_plans(decode, monkeypatch, ahead_size_off: int = 0):
    """The scatter plans ``Lander`` made while a claim was out, and the plans the scatters
    used; ``ahead_size_off`` makes the plan ahead expect another packed size."""
    lander = decode.sink.lander
    packer = lander.packer
    made, used = {}, []
    real_ahead, real_scatter = lander.plan_ahead, packer.scatter

    def plan_ahead(read, prefill):
        real_ahead(read, prefill)
        if read.packed_ahead is not None and ahead_size_off:
            read.packed_ahead = dataclasses.replace(
                read.packed_ahead, prefill_nbytes=read.packed_ahead.prefill_nbytes + ahead_size_off
            )
        if read.scatter_plan is not None:
            made[id(read.scatter_plan)] = (read.phase, read.scatter_plan)

    def scatter(*args, **kwargs):
        used.append(kwargs.get("plan"))
        return real_scatter(*args, **kwargs)

    monkeypatch.setattr(lander, "plan_ahead", plan_ahead)
    monkeypatch.setattr(packer, "scatter", scatter)
    return made, used


def test_packed_read_scatters_with_the_plan_made_while_its_claim_was_out(
    peer, decodes, monkeypatch
):
    """The packed READ and its scatter are planned before the claim's answer (the plan in
    slot-relative offsets), and the scatter only launches it."""
    decode = decodes(E2B, "per_layer", verify=True, packed_mib=16, kv_mib=48)
    made, used = spy_scatter_plans(decode, monkeypatch)
    result, _ = decode.read(peer.request("packed", 2), 6, "v-packed-ahead")

    assert result.done and result.packed, result.failure
    assert result.mismatches == []
    assert [phase.name for phase, _ in made.values()] == ["CLAIM"]
    assert len(used) == 1 and used[0] is next(iter(made.values()))[1]


def test_packed_read_planned_for_another_size_is_planned_again_at_the_post(
    peer, decodes, monkeypatch
):
    """Control for the test above: a plan ahead that expects another packed size than
    prefill's grant says is not used; the post plans the packed READ and its scatter."""
    decode = decodes(E2B, "per_layer", verify=True, packed_mib=16, kv_mib=48)
    made, used = spy_scatter_plans(decode, monkeypatch, ahead_size_off=4096)
    result, _ = decode.read(peer.request("packed", 3), 7, "v-packed-replanned")

    assert result.done and result.packed, result.failure
    assert result.mismatches == []
    assert len(made) == 1 and len(used) == 1
    assert used[0] is not None and used[0] is not next(iter(made.values()))[1]


class DigestsStillRunning:
    """The digests' CUDA event (no CUDA driver here): not done until ``hold_s`` after it
    was first queried; each query notes how many staging slots had been freed by then."""

    def __init__(self, hold_s: float, freed: list):
        self.hold_s, self.freed, self.seen = hold_s, freed, []
        self.first: float | None = None

    def query(self) -> bool:
        self.seen.append(len(self.freed))
        self.first = self.first or time.monotonic()
        return time.monotonic() - self.first >= self.hold_s

    def synchronize(self) -> None:
        pass


def test_a_packed_read_lands_and_frees_its_slot_while_its_digests_still_run(
    peer, decodes, monkeypatch
):
    """The bytes are in place once the scatter is done: the read is marked landed and its
    staging slot serves the next read then, not after decode's digests (which read the
    blocks); the load is still reported only once the digests match."""
    decode = decodes(E2B, "per_layer", verify=True, packed_mib=16, kv_mib=48)
    lander = decode.sink.lander
    staging = lander.packer.staging
    freed, events = [], []
    real_release, real_launch = staging.release, lander.digester.launch

    def release(offset):
        freed.append(offset)
        return real_release(offset)

    def launch(plan, after=None, after_compute=True):
        pending = real_launch(plan, after=after, after_compute=after_compute)
        events.append(DigestsStillRunning(0.05, freed))
        pending._event = events[-1]
        return pending

    monkeypatch.setattr(staging, "release", release)
    monkeypatch.setattr(lander.digester, "launch", launch)
    result, local_ids = decode.read(peer.request("packed", 4), 8, "v-packed-lands-first")

    assert result.done and result.packed, result.failure
    assert result.mismatches == []
    (event,) = events
    assert len(event.seen) > 1 and event.seen[0] == 1, event.seen  # freed before the 1st look
    record = record_of(decode.sink, "v-packed-lands-first")
    assert record.verified == layer_blocks(decode.topology, local_ids)
    timeline = record.timeline
    assert timeline["landed"] + 0.05 <= timeline["verified"], timeline
    # The record's READ seconds end with the bytes in place, not with the digests: they
    # start inside the post, after the claim (a loaded CI box spent 15 ms between the
    # start and the `posted` mark, so the bound is the claim, not the mark), and end at
    # `landed`, 50 ms before `verified` here.
    assert record.seconds <= timeline["landed"] - timeline["claimed"] + 1e-4, record


def compare_one_by_one(topology, local_ids, remote_ids, local, remote_block_ids, remote,
                       limit=5):  # fmt: skip
    """The reference: ``compare`` as it was, a Python loop over every layer-block."""
    compared, found = 0, []
    for name in sorted(topology.owners):
        group = topology.owners[name].group
        mine, theirs = local.get(name), remote.get(name)
        if theirs is None:
            found.append(f"layer {name} (group {group}): prefill sent no digests")
            continue
        where = {int(b): i for i, b in enumerate(remote_ids_of(remote_block_ids, group))}
        for j, (lb, rb) in enumerate(zip(local_ids[group], remote_ids[group], strict=True)):
            compared += 1
            i = where.get(int(rb))
            if i is None or i >= len(theirs):
                found.append(f"layer {name} group {group} block {lb}: prefill did not digest {rb}")
            elif mine is None or int(mine[j]) != int(theirs[i]):
                found.append(
                    f"layer {name} group {group}: decode block {lb} differs from prefill block {rb}"
                )
            if len(found) >= limit:
                return compared, found
    return compared, found


def test_compare_answers_as_the_one_by_one_reference(peer, decodes):
    """The vectorised ``compare`` gives the reference's count and messages, in order, over
    random pairings with changed, undigested and repeated blocks, layers without digests
    on either side, and limits that cut inside a layer or at a layer's start."""
    topology = decodes(E2B, "per_layer", verify=True, packed_mib=16, kv_mib=48).topology
    groups = 1 + max(o.group for o in topology.owners.values())
    rng = np.random.default_rng(7)
    cases = 0
    for trial in range(60):
        held, local_ids, remote_ids = [], [], []
        for _ in range(groups):
            ids = rng.choice(np.arange(1, 400), size=int(rng.integers(0, 40)), replace=False)
            held.append([0, *ids.tolist()] if trial % 3 == 0 else ids.tolist())  # null blocks
            pairs = rng.permutation(ids)[: int(rng.integers(0, len(ids) + 1))].tolist()
            if trial % 4 == 1 and ids.size:
                pairs += [int(ids[0]), 999]  # asked twice, and one prefill never held
            remote_ids.append(pairs)
            local_ids.append(rng.integers(1, 500, size=len(pairs)).tolist())
        local, remote = {}, {}
        for name, owner in topology.owners.items():
            digested = remote_ids_of(held, owner.group)
            theirs = rng.integers(0, 2**63, size=len(digested), dtype=np.int64).view(np.uint64)
            where = {b: i for i, b in enumerate(digested)}
            pairs = remote_ids[owner.group]
            mine = np.array([theirs[where[b]] if b in where else 5 for b in pairs], np.uint64)
            if len(mine) and rng.random() < 0.3:
                mine[rng.integers(0, len(mine))] ^= np.uint64(1)  # one changed word
            if rng.random() < 0.1:
                theirs = theirs[: len(theirs) // 2]  # prefill digested only some
            if rng.random() > 0.05:
                remote[name] = theirs
            if rng.random() > 0.05:
                local[name] = mine
        for limit in (1, 3, 5, 10_000):
            args = (topology, local_ids, remote_ids, local, held, remote, limit)
            assert compare(*args) == compare_one_by_one(*args), (trial, limit)
            cases += bool(compare_one_by_one(*args)[1])
    assert cases > 40  # most cases found something to name


def test_kv_changed_after_prefill_digested_it_fails_the_load(peer, decodes):
    """Negative control first: without verification the same kind of read "succeeds" on
    bytes that are not prefill's; with it, the load fails and names the block."""
    unverified = decodes("g4tiny", "per_layer", verify=False)
    control, _ = unverified.read(peer.request("tiny", 3), 3, "control-corrupt")
    assert control.done  # the transfer alone does not notice...
    assert control.mismatches  # ...that decode now holds other bytes

    decode = decodes("g4tiny", "per_layer", verify=True)
    before = decode.sink.counters["verify_failures"]
    result, _ = decode.read(peer.request("tiny", 2), 4, "v-corrupt")

    assert not result.done
    assert "VerificationError" in result.failure
    first = sorted(decode.topology.owners)[0]
    assert f"layer {first} group" in result.failure
    assert "differs from prefill block" in result.failure
    assert decode.sink.counters["verify_failures"] == before + 1
    # prefill is told to free the request (an abort), not left holding it for the lease
    request_id = peer.request("tiny", 2)["kv_transfer_params"]["remote_request_id"]
    assert peer.released_event("tiny", request_id)["read"] == [request_id]


def test_packed_read_of_changed_kv_fails(peer, decodes):
    decode = decodes(E2B, "per_layer", verify=True, packed_mib=16, kv_mib=48)
    result, _ = decode.read(peer.request("packed", 1), 5, "v-packed-corrupt")
    assert not result.done
    assert "VerificationError" in result.failure


def test_decode_side_corruption_after_the_read_is_caught(peer, decodes, monkeypatch):
    """The digest is taken from decode's blocks, not from what the wire carried: a scatter
    into the wrong place or a block overwritten before vLLM runs fails too."""
    decode = decodes("g4tiny", "per_layer", verify=True)
    land = decode.sink.lander.land

    def overwritten_then_digested(read):  # after the READ, before decode digests
        overwrite_first_block(decode.topology, read.local_read)
        land(read)

    monkeypatch.setattr(decode.sink.lander, "land", overwritten_then_digested)
    result, _ = decode.read(peer.request("tiny", 1), 6, "v-decode-corrupt")
    assert not result.done
    assert "differs from prefill block" in result.failure


def test_prefill_without_verify_kv_fails_a_verifying_decode_and_is_freed(peer, decodes):
    decode = decodes("g4tiny", "per_layer", verify=True)
    request = peer.request("plain", 0)
    result, _ = decode.read(request, 7, "v-no-digests")

    assert not result.done
    assert "sent no KV digests" in result.failure
    assert "verify_kv must be on for prefill too" in result.failure
    assert kvcheck.nonzero_blocks_outside(decode.stack.kv_caches, decode.topology, []) == []
    request_id = request["kv_transfer_params"]["remote_request_id"]
    # Decode told prefill to free the blocks (a NIXL notification). Without NIXL's progress
    # thread it leaves while decode progresses, which its engine does every step: poll.
    deadline = time.monotonic() + 10
    while not any(request_id in e["read"] for e in peer.released):
        assert time.monotonic() < deadline, "prefill never freed the request"
        decode.sink.poll(spin_s=0.0)
        time.sleep(0.01)
    assert peer.released_event("plain", request_id)["read"] == [request_id]


def test_digest_reference_matches_the_kernel_and_sees_one_word():
    """The torch kernel equals the host reference, and changing any single 64-bit word of
    a block (or swapping two words) changes its digest."""
    stack, topology = build("g4tiny", "per_layer", 8, 2048)
    ids = request_block_ids(topology, TOKENS, seed=9)
    kvcheck.fill(stack.kv_caches, topology, ids, seed=9)
    digests = cpu_digester(stack).start(topology, ids).result()
    runs = verification.layer_runs(topology, ids)[0]
    segments = runs.block_bytes // runs.segment_len
    block = b"".join(ctypes.string_at(int(a), runs.segment_len) for a in runs.addr[:segments])
    assert verification.digest_bytes(block) == int(digests[runs.name][0])
    words = bytearray(block)
    words[8:16] = bytes(b ^ 0x01 for b in words[8:16])
    assert verification.digest_bytes(bytes(words)) != verification.digest_bytes(block)
    swapped = block[8:16] + block[:8] + block[16:]
    if swapped != block:
        assert verification.digest_bytes(swapped) != verification.digest_bytes(block)


@pytest.mark.parametrize("chunk_bytes", [None, 1])
@pytest.mark.parametrize(
    ("model", "layout"), [("g4tiny", "per_layer"), (E2B, "kvcached_contiguous"), (E2B, "per_layer")]
)
def test_every_layer_block_digest_equals_the_reference(model, layout, chunk_bytes, monkeypatch):
    """Layers of one block shape are digested together, in one gather through the window
    over every storage: each layer's digests must still be its own blocks', in order (the
    host reference, block by block), also gathered a block at a time (``chunk_bytes`` 1:
    every chunk boundary). The control: a plan of other blocks gives other digests."""
    if chunk_bytes is not None:
        monkeypatch.setattr("kvshare_connector.transfer.device.digests.CHUNK_BYTES", chunk_bytes)
    stack, topology = build(model, layout, 64, 2048)
    ids = request_block_ids(topology, 600, seed=4)
    kvcheck.fill(stack.kv_caches, topology, ids, seed=4)
    digester = cpu_digester(stack)
    plan = digester.plan(topology, ids)
    digests = digester.launch(plan).result()
    checked = 0
    for runs in verification.layer_runs(topology, ids):
        segments = runs.block_bytes // runs.segment_len
        want = [
            verification.digest_bytes(b"".join(
                ctypes.string_at(int(a), runs.segment_len) for a in runs.addr[i : i + segments]
            ))
            for i in range(0, runs.addr.size, segments)
        ]  # fmt: skip
        assert [int(d) for d in digests[runs.name]] == want, runs.name
        checked += len(want)
    assert checked == sum(len(ids[o.group]) for o in topology.owners.values())
    assert len(plan.groups) < len(topology.owners), plan.groups  # fewer gathers than layers
    other = [list(reversed(group)) for group in ids]
    moved = digester.start(topology, other).result()
    assert any((moved[n] != digests[n]).any() for n in digests if digests[n].size > 1)
    # A plan's own output goes to its first launch; launched again, it gets new memory: the
    # first launch's digests, read only after the second ran on other bytes, stay its own.
    twice = digester.plan(topology, ids)
    first = digester.launch(twice)
    assert twice.out is None and twice.host is None
    kvcheck.fill(stack.kv_caches, topology, ids, seed=5)
    second = digester.launch(twice).result()
    assert all((first.result()[n] == digests[n]).all() for n in digests)
    assert any((second[n] != digests[n]).any() for n in digests if digests[n].size)
    assert all((digester.launch(digester.plan(topology, ids)).result()[n] == second[n]).all()
               for n in second)  # fmt: skip


def test_verify_kv_is_on_by_default_strict_and_the_lmcache_backend_refuses_it():
    from kvshare_connector.backends import create_backend
    from kvshare_connector.backends.options import ConnectorOptions

    def parse(extra, environ=None):
        return ConnectorOptions.parse(extra, environ=environ or {})

    assert parse({}).verifies and parse({"verify_kv": True}).verifies
    assert parse({"verify_kv": True}).verify_kv is True
    assert parse({"verify_kv": "false"}).verify_kv is False
    assert not parse({"verify_kv": "false"}).verifies
    assert not parse({}, {"KVSHARE_VERIFY_KV": "off"}).verifies
    assert parse({"verify_kv": True}, {"KVSHARE_VERIFY_KV": "off"}).verifies  # config wins
    with pytest.raises(ValueError, match="must be true or false"):
        parse({"verify_kv": "maybe"})
    lmcache = {"backend": "lmcache", "lmcache": {"remote_url": "lm://127.0.0.1:1"}}
    with pytest.raises(ValueError, match="verify_kv is a feature of the nixl backend"):
        create_backend(parse({**lmcache, "verify_kv": True}))
    create_backend(parse(lmcache))  # by default it is off there, not an error


def _first_segments(topology, local_ids, count: int = 2) -> list[tuple[int, int]]:
    """(address, bytes) of the first segment of the first ``count`` blocks of the request
    in its first owner layer: what the tamper cases move around."""
    owner = topology.owners[sorted(topology.owners)[0]]
    g = owner.geometry
    blocks = [b for b in local_ids[owner.group] if b][:count]
    return [(g.base + b * g.block_stride + g.segment_offsets[0], g.segment_len) for b in blocks]


def _swap(topology, local_ids) -> None:  # reordered: two blocks trade places
    (a, n), (b, _) = _first_segments(topology, local_ids)
    first, second = ctypes.string_at(a, n), ctypes.string_at(b, n)
    ctypes.memmove(a, second, n)
    ctypes.memmove(b, first, n)


def _tear(topology, local_ids) -> None:  # torn: the second half of a block never came
    (a, n), _ = _first_segments(topology, local_ids)
    ctypes.memset(a + n // 2, 0, n - n // 2)


def _stale(topology, local_ids) -> None:  # stale: a block still holds other KV
    (a, n), (b, _) = _first_segments(topology, local_ids)
    ctypes.memmove(a, ctypes.string_at(b, n), n)


@pytest.mark.parametrize("index", [0, 1, 2], ids=["reordered", "torn", "stale"])
def test_reordered_torn_and_stale_blocks_fail_the_load(peer, decodes, monkeypatch, index):
    """Decode's blocks after the READ, changed the way a faulty transfer would leave them:
    the control (no verify_kv) reports the load done on wrong KV; verify_kv fails it."""
    tamper = (_swap, _tear, _stale)[index]
    outcomes = {}
    for verify in (False, True):
        decode = decodes("g4tiny", "per_layer", verify=verify)
        land = decode.sink.lander.land

        def tampered_then_landed(read, land=land, decode=decode):
            tamper(decode.topology, read.local_read)
            land(read)

        monkeypatch.setattr(decode.sink.lander, "land", tampered_then_landed)
        request = peer.request("tamper", 2 * index + (0 if verify else 1))
        outcomes[verify], _ = decode.read(request, 20 + index, f"tamper-{index}-{verify}")
        monkeypatch.undo()
    control, verified = outcomes[False], outcomes[True]
    assert control.done and control.mismatches  # wrong KV, and nothing noticed
    assert not verified.done and "differs from prefill block" in verified.failure


def test_a_read_of_another_requests_blocks_fails_the_load(peer, decodes, monkeypatch):
    """The claim names the request's own blocks (and is granted), but the READ takes
    another request's: what a descriptor bug or a mixed-up block table would do."""
    outcomes = {}
    for verify in (False, True):
        decode = decodes("g4tiny", "per_layer", verify=verify)
        other = peer.request("tamper", 6 if verify else 7)["kv_transfer_params"]
        plan = decode.sink._plan

        def wrong_plan(order, peer_, plan=plan, other=other):
            params = msgspec.structs.replace(
                order.params, remote_block_ids=other["remote_block_ids"]
            )
            right = plan(order, peer_)
            return dataclasses.replace(
                plan(dataclasses.replace(order, params=params), peer_),
                remote_ids=right.remote_ids,
            )

        monkeypatch.setattr(decode.sink, "_plan", wrong_plan)
        request = peer.request("tamper", 8 if verify else 9)
        outcomes[verify], _ = decode.read(request, 30, f"wrong-request-{verify}")
        monkeypatch.undo()
    assert outcomes[False].done and outcomes[False].mismatches
    assert not outcomes[True].done and "differs from prefill block" in outcomes[True].failure


def test_a_scatter_into_the_wrong_blocks_fails_the_load(peer, decodes, monkeypatch):
    """A packed read lands whole in staging, then the scatter writes each run one run
    off: decode's digests of its blocks (not of the staging bytes) catch it."""
    outcomes = {}
    for verify in (False, True):
        decode = decodes(E2B, "per_layer", verify=verify, packed_mib=16, kv_mib=48)
        scatter = decode.sink.packer.scatter

        def shifted(addr, length, staged, slot=0, plan=None, stream=None, after=None,
                    scatter=scatter):  # fmt: skip
            # its own plan, of the shifted runs (the one made while the claim was out is not used)
            return scatter(np.roll(addr, 1), np.roll(length, 1), staged, slot=slot)

        monkeypatch.setattr(decode.sink.packer, "scatter", shifted)
        request = peer.request("tamper_packed", 0 if verify else 1)
        outcomes[verify], _ = decode.read(request, 40, f"wrong-scatter-{verify}")
        monkeypatch.undo()
    assert outcomes[False].done and outcomes[False].packed and outcomes[False].mismatches
    assert not outcomes[True].done and "differs from prefill block" in outcomes[True].failure


def _reversed_ids(request: dict) -> list[list[int]]:
    return [list(reversed(ids)) for ids in request["kv_transfer_params"]["remote_block_ids"]]


def test_a_reordered_block_list_is_refused_by_prefill_and_nothing_moves(peer, decodes):
    """What a proxy that sorts or reverses lists sends: the request's own blocks in another
    order. Prefill refuses the claim, naming the order; the right order then loads."""
    decode = decodes("g4tiny", "per_layer", verify=True)
    request = peer.request("reorder", 0)
    params = dict(request["kv_transfer_params"], remote_block_ids=_reversed_ids(request))
    refused, _ = decode.read(dict(request, kv_transfer_params=params), 40, "reorder-refused")
    assert not refused.done and "in their order" in refused.failure, refused.failure
    assert "prefill" in refused.failure and "refused the claim" in refused.failure
    right, local_ids = decode.read(request, 40, "reorder-right")
    assert right.done and not right.mismatches, right.failure
    assert record_of(decode.sink, "reorder-right").verified == layer_blocks(
        decode.topology, local_ids
    )


@pytest.mark.parametrize("prefill_told", ["its order", "the reordered list"])
def test_a_reordered_read_past_prefills_check_fails_by_position(
    peer, decodes, monkeypatch, prefill_told
):
    """Prefill's check bypassed (a prefill that does not check, or a claim that names its
    blocks in order while decode reads another): decode compares digests by position in
    the request, so each block read from another position fails; the control (no
    verify_kv) loads the misplaced KV. Told the reordered list, prefill would refuse: here
    its digests' order is what decode checks first ("the reordered list": prefill's digest
    list rewritten to the reordered order, as a lying prefill would)."""
    outcomes = {}
    for index, verify in enumerate((False, True)):
        decode = decodes("g4tiny", "per_layer", verify=verify)
        request = peer.request("reorder", 1 + index + (2 if prefill_told != "its order" else 0))
        original = request["kv_transfer_params"]["remote_block_ids"]
        claim = decode.sink.claims._claim

        def in_order(orders, verify_, claim=claim, original=original):
            sent = claim(orders, verify_)
            sent.block_ids = {
                rid: [protocol.pack_ids(ids) for ids in original] for rid in sent.block_ids
            }
            return sent

        monkeypatch.setattr(decode.sink.claims, "_claim", in_order)
        if prefill_told != "its order":  # digests listed as decode was told

            def relabelled(p, digests, check=claims_module._check_digested):
                if digests is not None:
                    digests.block_ids = [
                        protocol.pack_ids([b for b in ids if b]) for ids in p.remote_block_ids
                    ]
                check(p, digests)

            monkeypatch.setattr(claims_module, "_check_digested", relabelled)
        params = dict(request["kv_transfer_params"], remote_block_ids=_reversed_ids(request))
        wrong = dict(request, kv_transfer_params=params)
        outcomes[verify], _ = decode.read(wrong, 41, f"reorder-bypass-{prefill_told}-{verify}")
        monkeypatch.undo()
    assert outcomes[False].done and outcomes[False].mismatches  # misplaced KV, unnoticed
    failure = outcomes[True].failure or ""
    assert not outcomes[True].done
    if prefill_told == "its order":
        assert "in another order, than kv_transfer_params name" in failure, failure
    else:
        assert "differs from prefill block" in failure, failure
