"""Real NIXL transfers between OS processes over UCX on 127.0.0.1, checked byte for byte.

Prefill side: ``transfer_peer.py`` processes (vLLM's real KV memory for Gemma-4 shaped
models, several ``KVSource``s per process, each request filled with its own pattern).
Decode side: this process, one ``KVSink`` per memory layout. Every wait is bounded: a
broken transfer fails a test, it never hangs the suite.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from kvshare_connector.devtools import kvcheck
from kvshare_connector.devtools.demo import build, cpu_packer, read_and_check, request_block_ids
from kvshare_connector.layout.descriptors import request_descriptors, transfer_descriptors
from kvshare_connector.layout.matching import EngineIdentity, pair_owners
from kvshare_connector.transfer import protocol
from kvshare_connector.transfer.side_channel import ask

from .support.transfer_peer import PeerProcess

TOKENS = 300  # g4tiny: 5 blocks in each sliding group (window 128), 19 in the full group
E2B = "gemma4_e2b_shape"
# Decode side KV sizes; the peer's caches are larger, so num_blocks differ too (E2B needs
# 48 MiB for one request of vLLM's max_model_len 2048).
DECODE_KV_MIB = {"g4tiny": 16, "g4uniform": 16, E2B: 48}

PEER_SOURCES = [
    # g4tiny: 10 layers, 4 sharers, 6 KV cache groups (5 sliding head 64, 1 full head 128).
    {"name": "tiny", "model": "g4tiny", "layout": "per_layer", "requests": 9, "seed": 100},
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
    {"name": "e2b_packed", "model": E2B, "layout": "kvcached_contiguous", "requests": 4,
     "seed": 800, "packed_mib": 16},
    {"name": "drain", "model": "g4tiny", "layout": "per_layer", "requests": 1, "seed": 900},
    {"name": "lease", "model": "g4tiny", "layout": "per_layer", "requests": 1, "lease_s": 1.5,
     "kv_mib": 8, "seed": 600},
    # Says which model it runs: decode compares the identity with its own.
    {"name": "ident", "model": "g4tiny", "layout": "per_layer", "requests": 2, "seed": 700,
     "identity": {"model": "google/gemma-4-E2B-it", "model_config_hash": "c0ffee",
                  "dtype": "bfloat16", "cache_dtype": "auto", "block_size": 16,
                  "vllm_version": "0.26.0"}},
]  # fmt: skip
for _spec in PEER_SOURCES:
    _spec.setdefault("tokens", TOKENS)
    _spec.setdefault("kv_mib", 64 if _spec["model"] == E2B else 32)

# The peer that gets killed: E2B-shaped, requests of ~120 MiB so a READ lasts long
# enough to be killed in the middle of it. Filled with 0x5A bytes (patterns cost seconds).
VICTIM_TOKENS = 20_000
VICTIM_SOURCES = [
    {"name": "victim", "model": E2B, "layout": "per_layer", "requests": 3,
     "tokens": VICTIM_TOKENS, "kv_mib": 400, "fill": "bytes"},
]  # fmt: skip

HANDSHAKE_S = 10.0  # real peers (a loaded CI box answers slowly, never this slowly)
TRANSFER_S = 10.0
FAULT_HANDSHAKE_S = 1.0  # sinks that talk to broken side channels


# ---- fixtures -------------------------------------------------------------------------


@dataclass
class Peers:
    main: PeerProcess
    victim: PeerProcess


@pytest.fixture(scope="module")
def peers():
    """Both prefill processes, started at once (each imports vLLM: seconds of CPU)."""
    started: list[PeerProcess] = []
    try:
        started.append(PeerProcess(PEER_SOURCES))
        started.append(PeerProcess(VICTIM_SOURCES))
        yield Peers(*started)
    finally:
        for peer in started:
            peer.stop()


class Decoder:
    """One decode engine's KV memory (vLLM's real objects) and its ``KVSink``."""

    def __init__(
        self,
        model: str,
        layout: str,
        kv_mib: int,
        handshake_s: float,
        name: str,
        identity: EngineIdentity | None = None,
        packed_mib: int = 0,
    ):
        from kvshare_connector.transfer.nixl import NixlTransport
        from kvshare_connector.transfer.sink import KVSink

        self.stack, self.topology = build(model, layout, kv_mib, 2048)
        self.transport = NixlTransport(f"decode-{name}-{os.getpid()}")
        self.sink = KVSink(
            f"decode-{name}",
            self.topology,
            self.transport,
            handshake_s,
            TRANSFER_S,
            identity,
            packer=cpu_packer(self.stack, packed_mib),
        )

    def zero(self) -> None:
        for region in self.topology.regions:
            ctypes.memset(region.addr, 0, region.nbytes)

    def untouched(self) -> bool:
        """Every block of every owner is still zero."""
        return kvcheck.nonzero_blocks_outside(self.stack.kv_caches, self.topology, []) == []

    def read(self, request: dict[str, Any], local_ids, request_id: str, **params: Any):
        """Read through ``read_and_check`` (bounded), with some kv_transfer_params replaced."""
        self.zero()
        return read_and_check(
            self.sink,
            self.stack,
            self.topology,
            dict(request["kv_transfer_params"], **params),
            local_ids,
            seed=request["seed"],
            request_id=request_id,
            timeout_s=HANDSHAKE_S + TRANSFER_S + 5,
        )

    def wait(self, request_id: str, timeout_s: float) -> tuple[bool, str | None, float]:
        """Poll until ``request_id`` is done or failed: (done, failure, seconds)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            done, failed = self.sink.poll()
            if request_id in done or request_id in failed:
                return request_id in done, failed.get(request_id), time.monotonic() - start
            time.sleep(0.002)
        raise AssertionError(f"{request_id} neither finished nor failed in {timeout_s:g} s")

    def close(self) -> None:
        self.sink.close()


@pytest.fixture(scope="module")
def decoders(peers):
    """Decoders by (model, layout), built on first use, closed at the end of the module.

    Depends on ``peers`` so that the peers start importing vLLM while this process does.
    """
    made: dict[tuple[str, ...], Decoder] = {}

    def get(
        model: str,
        layout: str,
        kv_mib: int | None = None,
        handshake_s=HANDSHAKE_S,
        identity: EngineIdentity | None = None,
        packed_mib: int = 0,
    ):
        kv_mib = kv_mib or DECODE_KV_MIB[model]
        key = (model, layout, str(kv_mib), str(handshake_s), repr(identity), str(packed_mib))
        if key not in made:
            made[key] = Decoder(
                model, layout, kv_mib, handshake_s, f"{len(made)}", identity, packed_mib
            )
        return made[key]

    yield get
    for decoder in made.values():
        decoder.close()


def _counter():
    n = iter(range(10**6))
    return lambda prefix: f"{prefix}-{next(n)}"


new_id = _counter()


def scattered(ids: list[int]) -> bool:
    """Not one ascending run of consecutive ids."""
    return ids != list(range(ids[0], ids[0] + len(ids)))


def expected_bytes(topology, ids) -> int:
    return sum(
        len(block_ids) * group.spec.page_bytes * len(group.layer_names)
        for group, block_ids in zip(topology.groups, ids, strict=True)
    )


def assert_landed(decoder: Decoder, result, local_ids) -> None:
    """The read finished and every layer (sharers through their alias) holds prefill's KV."""
    assert result.done, result.failure
    assert result.mismatches == []
    assert result.stray == []
    assert result.bytes == expected_bytes(decoder.topology, local_ids)
    assert 0 < result.descriptors <= result.bytes
    layers = set(decoder.stack.kv_caches)
    assert layers == set(decoder.topology.owners) | set(decoder.topology.sharers)
    for sharer, target in decoder.topology.sharers.items():
        assert decoder.stack.kv_caches[sharer].data_ptr() == (
            decoder.stack.kv_caches[target].data_ptr()
        )


# ---- byte-for-byte reads --------------------------------------------------------------


def test_per_layer_read_every_layer_byte_for_byte(peers, decoders):
    decoder = decoders("g4tiny", "per_layer")
    request = peers.main.request("tiny", 0)
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
    assert peers.main.all_ready.wait(300)
    released = peers.main.released_event("tiny", request["request_id"])
    assert request["request_id"] in released["read"]
    assert request["request_id"] not in released["held"]


def test_negative_controls_fail_the_same_check(peers, decoders):
    decoder = decoders("g4tiny", "per_layer")
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=12)
    layers = set(decoder.stack.kv_caches)

    def bad_layers(mismatches: list[str]) -> set[str]:
        return {m.split(" ")[0] for m in mismatches}

    # 1. The read skipped: nothing there.
    decoder.zero()
    request = peers.main.request("tiny", 1)
    missing = kvcheck.mismatches(
        decoder.stack.kv_caches, decoder.topology, local_ids, seed=request["seed"]
    )
    assert bad_layers(missing) == layers

    # 2. The read pointed at the wrong remote blocks (each group's list reversed): bytes
    # move, into the right local blocks only, and every layer is caught holding the wrong ones.
    reversed_ids = [
        list(reversed(ids)) for ids in request["kv_transfer_params"]["remote_block_ids"]
    ]
    wrong = decoder.read(request, local_ids, new_id("wrong"), remote_block_ids=reversed_ids)
    assert wrong.done, wrong.failure
    assert wrong.stray == []
    assert bad_layers(wrong.mismatches) == layers

    # 3. Another request's blocks (same positions, another prefill pattern).
    other = peers.main.request("tiny", 2)
    swapped = decoder.read(
        request, local_ids, new_id("other"),
        remote_block_ids=other["kv_transfer_params"]["remote_block_ids"],
        remote_request_id=other["request_id"],
    )  # fmt: skip
    assert swapped.done, swapped.failure
    assert bad_layers(swapped.mismatches) == layers

    # 4. The right read, checked at the wrong local blocks: caught; at the right ones: clean.
    request = peers.main.request("tiny", 3)
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
def test_read_between_memory_layouts(peers, decoders, source, index, model, layout):
    decoder = decoders(model, layout)
    info = peers.main.source(source)
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
    assert peers.main.released_event(source, request["request_id"])


def test_packed_read_lands_every_block_in_a_few_descriptors(peers, decoders):
    """Prefill packed each held request into its staging area; a decode with one reads it
    as a few large runs and scatters it; a decode without one reads block by block."""
    info = peers.main.source("e2b_packed")
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
    assert peers.main.released_event("e2b_packed", request["request_id"])

    # The same check fails on a packed read of the wrong blocks (each group's ids reversed).
    request = info["requests"][1]
    wrong_ids = [list(reversed(i)) for i in request["kv_transfer_params"]["remote_block_ids"]]
    wrong = packed.read(request, local_ids, new_id("packed-wrong"), remote_block_ids=wrong_ids)
    assert wrong.done, wrong.failure
    assert wrong.stray == [] and len(wrong.mismatches) > 0

    # Once prefill's claim reply is in, one poll posts the READ, sees it done and scatters:
    # the engine learns of the load in the step the reply arrived, not steps later.
    request = info["requests"][3]
    rid = new_id("one-poll")
    packed.zero()
    packed.sink.request(
        rid, protocol.remote_prefill_params(request["kv_transfer_params"]), local_ids
    )
    packed.sink.advance()  # what start_load_kv does: the claim leaves now
    deadline = time.monotonic() + 30
    while not (packed.sink._reads[rid].claim and packed.sink._reads[rid].claim.done()):
        assert time.monotonic() < deadline, "no claim reply"
        time.sleep(0.01)
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
    peers, decoders, source, model, layout, expected
):
    decoder = decoders(model, layout)
    request = peers.main.request(source, {"tiny": 8, "uniform_cl": 2}[source])  # own request
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=1)
    decoder.zero()
    request_id = new_id("mismatch")
    decoder.sink.request(
        request_id, protocol.remote_prefill_params(request["kv_transfer_params"]), local_ids
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
    released = peers.main.released_event(source, request["request_id"])
    assert request["request_id"] in released["read"]
    assert request["request_id"] not in released["held"]


def test_engine_identity_mismatch_fails_and_names_each_difference(peers, decoders):
    """Same KV layout, another model (or dtype, vLLM, ...): refused before a byte moves."""
    info = peers.main.source("ident")
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


def test_block_count_mismatch_fails_before_a_byte_moves(peers, decoders):
    """Decode holds one block fewer than prefill sent in one group: refused, not silently
    read into the tail."""
    decoder = decoders("g4tiny", "per_layer")
    request = peers.main.request("tiny", 5)
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=43)
    local_ids[5] = local_ids[5][1:]
    result = decoder.read(request, local_ids, new_id("count"))
    assert not result.done
    assert result.failure.startswith(
        "BlockIdsMismatch: group 5: prefill sent 19 block(s), decode"
    ), result.failure
    assert result.bytes == 0 and decoder.untouched()
    released = peers.main.released_event("tiny", request["request_id"])  # decode freed it
    assert request["request_id"] not in released["held"]


# ---- the side channel under garbage ---------------------------------------------------


def _dealer(port: int) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def _reply(sock: zmq.Socket, timeout_s: float = 3.0) -> list[bytes] | None:
    return sock.recv_multipart() if sock.poll(int(timeout_s * 1000)) else None


def test_prefill_side_channel_answers_garbage_with_errors_and_keeps_serving(peers, decoders):
    info = peers.main.source("tiny")
    port = info["requests"][0]["kv_transfer_params"]["remote_port"]
    hello = protocol.encode(protocol.Hello(protocol.PROTOCOL_VERSION, "tester"))
    bad_payloads = {
        b"garbage": "malformed side-channel message",
        b"": "malformed side-channel message",
        np.random.default_rng(0).bytes(64 << 10): "malformed side-channel message",
        hello[:-3]: "malformed side-channel message",  # truncated
        hello[:1]: "malformed side-channel message",
        protocol.encode(protocol.ErrorReply("hi")): (
            "expected hello, claim or release, got ErrorReply"
        ),
        protocol.encode(protocol.Hello(99, "tester")): "protocol version 99 not supported",
        protocol.encode(protocol.Hello(protocol.PROTOCOL_VERSION, "t", "someone-else")): (
            "not 'someone-else'"
        ),
    }
    sock = _dealer(port)
    try:
        for payload, message in bad_payloads.items():
            sock.send_multipart([b"", payload])
            frames = _reply(sock)
            assert frames is not None, f"no answer to {payload[:16]!r}"
            assert frames[0] == b""
            answer = protocol.decode(frames[1])
            assert isinstance(answer, protocol.ErrorReply), answer
            assert message in answer.message, answer.message
        # Messages outside the request envelope are dropped, not answered, not fatal.
        sock.send_multipart([b"no-delimiter"])
        sock.send_multipart([b"", b"a", b"b", b"c"])
        assert _reply(sock, 0.5) is None
        # An authenticated message to a side channel without a secret: refused, clearly
        # (as a refusal, which an authenticating asker reports).
        sock.send_multipart([b"", b"\x00" * 56, hello])
        frames = _reply(sock)
        assert frames is not None and frames[:2] == [b"", b""]
        assert b"has no side_channel_secret" in frames[2]
    finally:
        sock.close()
    # Raw bytes that are not ZMTP at all: the connection is dropped, the server lives on.
    with socket.create_connection(("127.0.0.1", port), timeout=3) as raw:
        raw.sendall(b"\xff" * 64 + b"GET / HTTP/1.1\r\n\r\n")
    time.sleep(0.1)

    # A good handshake still works, and so does a read.
    answer = protocol.decode(ask("127.0.0.1", port, hello, timeout_s=HANDSHAKE_S))
    assert isinstance(answer, protocol.HandshakeReply)
    assert answer.engine_id == info["engine_id"]
    decoder = decoders("g4tiny", "per_layer")
    request = info["requests"][4]
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=14)
    assert_landed(decoder, decoder.read(request, local_ids, new_id("after-garbage")), local_ids)


class FakeSideChannel:
    """A raw ZMQ ROUTER standing where a prefill's side channel should be."""

    def __init__(self, behaviour: str, topology):
        self.behaviour = behaviour
        self.topology = topology
        self.asked = 0
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _answer(self, payload: bytes) -> list[bytes] | None:
        if self.behaviour == "garbage":
            return [b"", b"\x93\xff\x00 definitely not msgpack"]
        if self.behaviour == "wrong_type":
            return [b"", protocol.encode(protocol.Hello(protocol.PROTOCOL_VERSION, "fake"))]
        if self.behaviour == "refuses":
            return [b"", protocol.encode(protocol.ErrorReply("go away"))]
        if self.behaviour == "bad_frames":
            return [b"", b"one", b"two"]
        if self.behaviour == "bad_layout":
            layout = protocol.layout_to_msg(self.topology)
            layout = msgspec.structs.replace(layout, fingerprint="0" * 16)
            reply = protocol.HandshakeReply(
                protocol.PROTOCOL_VERSION, "fake", "fake-agent", b"not metadata", layout
            )
            return [b"", protocol.encode(reply)]
        return None  # silent

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            identity, *rest = self._sock.recv_multipart()
            self.asked += 1
            answer = self._answer(rest[-1])
            if answer is not None:
                self._sock.send_multipart([identity, *answer])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("behaviour", "expected"),
    [
        ("garbage", "answered garbage"),
        ("wrong_type", "answered a Hello"),
        ("refuses", "refused the handshake: go away"),
        ("bad_frames", "malformed frame"),
        ("bad_layout", "unusable layout: layout fingerprint does not match"),
        ("silent", f"no answer from the prefill side channel at 127.0.0.1:{{port}} within "
                   f"{FAULT_HANDSHAKE_S:g} s"),
        ("nobody", "no answer from the prefill side channel"),
    ],
)  # fmt: skip
def test_broken_side_channel_fails_the_request_in_bounded_time(decoders, behaviour, expected):
    decoder = decoders("g4tiny", "per_layer", handshake_s=FAULT_HANDSHAKE_S)
    fake = FakeSideChannel(behaviour, decoder.topology) if behaviour != "nobody" else None
    port = fake.port if fake else _free_port()
    try:
        ids = request_block_ids(decoder.topology, TOKENS, seed=15)
        params = {
            "do_remote_prefill": True,
            "remote_block_ids": ids,
            "remote_engine_id": "fake-prefill",
            "remote_request_id": "fake-req",
            "remote_host": "127.0.0.1",
            "remote_port": port,
        }
        decoder.zero()
        request_id = new_id(behaviour)
        decoder.sink.request(request_id, protocol.remote_prefill_params(params), ids)
        done, failure, seconds = decoder.wait(request_id, FAULT_HANDSHAKE_S + 5)
    finally:
        if fake:
            fake.close()

    assert not done
    assert failure.startswith("HandshakeError: "), failure
    assert expected.format(port=port) in failure, failure
    assert seconds < FAULT_HANDSHAKE_S + 2.0
    if behaviour in ("silent", "nobody"):
        assert seconds >= FAULT_HANDSHAKE_S * 0.9  # it did wait, for the bound and no longer
    else:
        assert fake.asked == 1
    assert request_id not in decoder.sink.in_flight
    assert decoder.untouched()


# ---- a prefill that dies --------------------------------------------------------------


class KillSwitch:
    """Wraps the decode agent's ``transfer`` so a READ can be cut by a SIGKILL of the peer
    while it runs (the NIXL call releases the GIL, so a timer thread gets to fire)."""

    def __init__(self, transport, pid: int):
        self.agent = transport.agent
        self.original = self.agent.transfer
        self.pid = pid
        self.delay_s: float | None = None
        self.calls: list[float] = []
        self.fired: str | None = None
        self.agent.transfer = self._transfer

    def _transfer(self, handle):
        running = threading.Event()
        running.set()
        timer = None
        if self.delay_s is not None:

            def kill() -> None:
                self.fired = "inside transfer()" if running.is_set() else "after transfer()"
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)

            timer = threading.Timer(self.delay_s, kill)
            timer.start()
        start = time.perf_counter()
        try:
            return self.original(handle)
        finally:
            running.clear()
            self.calls.append(time.perf_counter() - start)
            if timer is not None:
                timer.join(timeout=5)

    def restore(self) -> None:
        self.agent.transfer = self.original


def _all_bytes(rows: np.ndarray, value: int) -> bool:
    for addr, length, _ in rows.tolist():
        view = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(addr))
        if not bool((view == value).all()):
            return False
    return True


def test_prefill_killed_mid_transfer_and_after_handshake(peers, decoders):
    victim = peers.victim
    info = victim.source("victim")
    decoder = decoders(E2B, "per_layer", kv_mib=160)
    local_ids = request_block_ids(decoder.topology, VICTIM_TOKENS, seed=16)
    switch = KillSwitch(decoder.transport, victim.process.pid)
    try:
        # A full read first: handshake done, connection up, and how long a READ lasts.
        decoder.zero()
        first = new_id("victim")
        decoder.sink.request(
            first,
            protocol.remote_prefill_params(info["requests"][0]["kv_transfer_params"]),
            local_ids,
        )
        done, failure, _ = decoder.wait(first, HANDSHAKE_S + TRANSFER_S)
        assert done, failure
        assert _all_bytes(request_descriptors(decoder.topology, local_ids), 0x5A)
        assert (
            kvcheck.nonzero_blocks_outside(decoder.stack.kv_caches, decoder.topology, local_ids)
            == []
        )
        read_s = decoder.sink.records[-1].seconds  # posted -> DONE

        # SIGKILL the prefill a tenth into the next READ (from a timer thread: the READ
        # runs inside NIXL's transfer call, which releases the GIL).
        switch.delay_s = read_s / 10
        second = new_id("victim")
        decoder.sink.request(
            second,
            protocol.remote_prefill_params(info["requests"][1]["kv_transfer_params"]),
            local_ids,
        )
        done, failure, seconds = decoder.wait(second, TRANSFER_S + 5)
        switch.delay_s = None
        assert victim.process.wait(timeout=10) == -signal.SIGKILL
        assert not done, (
            f"the READ finished before the kill landed ({read_s:.3f} s last time, "
            f"transfer calls {switch.calls})"
        )
        assert switch.fired  # after the READ was posted, and (not done) before it completed
        assert failure.startswith("TransportError: NIXL READ"), failure
        assert seconds < TRANSFER_S + 2
        assert decoder.sink.in_flight == set()
        print(f"READ {read_s:.3f} s, killed {switch.fired} at {read_s / 10:.3f} s: {failure}")

        # The next request to the dead peer (its handshake long done) fails too, within
        # the side-channel bound.
        third = new_id("victim")
        decoder.sink.request(
            third,
            protocol.remote_prefill_params(info["requests"][2]["kv_transfer_params"]),
            local_ids,
        )
        done, failure, seconds = decoder.wait(third, HANDSHAKE_S + TRANSFER_S + 5)
        # Before reading, decode claims the blocks on the side channel: nobody answers now.
        assert not done and "claiming" in failure and "no answer" in failure, failure
        assert seconds < HANDSHAKE_S + 2
        assert decoder.sink.in_flight == set()
    finally:
        switch.restore()

    # A decode that never handshook with it finds nobody there, within its bound.
    fault = decoders("g4tiny", "per_layer", handshake_s=FAULT_HANDSHAKE_S)
    params = dict(info["requests"][2]["kv_transfer_params"])
    params["remote_block_ids"] = request_block_ids(fault.topology, TOKENS, seed=17)
    late = new_id("victim-late")
    fault.sink.request(late, protocol.remote_prefill_params(params), params["remote_block_ids"])
    done, failure, seconds = fault.wait(late, FAULT_HANDSHAKE_S + 5)
    assert not done and "HandshakeError: no answer" in failure
    assert fault.sink.in_flight == set()


# ---- a decode that never comes --------------------------------------------------------


def test_lease_expires_when_decode_never_reads(peers, decoders):
    info = peers.main.source("lease")
    request = info["requests"][0]
    request_id = request["request_id"]
    event = peers.main.released_event("lease", request_id, timeout_s=info["lease_s"] + 10)
    assert event["expired"] == [request_id]
    assert event["read"] == []
    assert event["held"] == []  # nothing stays pinned
    assert info["lease_s"] <= event["after_s"] < info["lease_s"] + 5

    # A decode that comes after the lease must not read blocks that may be reused by now:
    # its claim is refused and not a byte moves.
    decoder = decoders("g4tiny", "per_layer")
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=31)
    result = decoder.read(request, local_ids, new_id("late"))
    assert not result.done
    assert "no longer holds" in result.failure and request_id in result.failure
    assert result.bytes == 0 and decoder.untouched()


def test_timed_out_read_keeps_its_blocks_until_nixl_lets_go(peers, decoders, monkeypatch):
    """A READ that outlives transfer_timeout_s and that NIXL will not release may still
    write into decode's blocks: the request is failed only once NIXL has let go, so vLLM
    cannot hand its blocks to another request while bytes may land in them. (NIXL cannot
    be made to hang on this machine: its state and release answers are what is faked.)"""
    decoder = decoders("g4tiny", "per_layer", packed_mib=0)
    sink, transport = decoder.sink, decoder.transport
    request = peers.main.request("drain", 0)
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=41)
    rid = new_id("drain")
    monkeypatch.setattr(sink, "transfer_timeout_s", 0.2)
    monkeypatch.setattr(transport, "state", lambda handle: "PROC")  # never finishes
    real_release = type(transport).release
    monkeypatch.setattr(transport, "release", lambda handle: False)  # NIXL refuses
    sink.request(rid, protocol.remote_prefill_params(request["kv_transfer_params"]), local_ids)
    deadline = time.monotonic() + HANDSHAKE_S + 5
    failed: dict[str, str] = {}
    while time.monotonic() < deadline:
        _, failed = sink.poll(spin_s=0.0)
        if rid in failed or (rid not in sink._reads and rid in sink.in_flight):
            break
        time.sleep(0.01)
    assert rid not in failed  # timed out, but not handed back
    assert rid in sink.in_flight  # vLLM keeps waiting for it: its blocks stay allocated
    for _ in range(3):
        assert rid not in sink.poll(spin_s=0.0)[1]

    monkeypatch.setattr(transport, "state", lambda handle: "DONE")  # NIXL is done with it
    monkeypatch.setattr(transport, "release", lambda handle: real_release(transport, handle))
    _, failed = sink.poll(spin_s=0.0)
    assert "did not finish" in failed[rid]
    assert rid not in sink.in_flight


# ---- kv_transfer_params ---------------------------------------------------------------

DELETE = object()
GOOD_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2], [3]],
    "remote_engine_id": "prefill-0",
    "remote_request_id": "req-0",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
    "remote_num_tokens": 20,
}


def test_good_kv_transfer_params_parse():
    parsed = protocol.remote_prefill_params(dict(GOOD_PARAMS, extra_field_of_a_proxy="ignored"))
    assert parsed.remote_block_ids == [[1, 2], [3]]
    assert parsed.remote_port == 5600


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"remote_block_ids": None}, "remote_block_ids"),
        ({"remote_block_ids": [1, 2]}, "$.remote_block_ids[0]"),
        ({"remote_block_ids": [[1, "2"]]}, "$.remote_block_ids[0][1]"),
        ({"remote_block_ids": [[1, -2]]}, "remote_block_ids"),
        ({"remote_port": "5600"}, "$.remote_port"),
        ({"remote_port": 70000}, "remote_port"),
        ({"remote_engine_id": None}, "$.remote_engine_id"),
        ({"do_remote_prefill": "yes"}, "$.do_remote_prefill"),
        ({"tp_size": 0}, "tp_size"),  # TP > 1 is served (issue 16); 0 is not a TP size
        ({"remote_host": DELETE}, "remote_host"),
    ],
)
def test_malformed_kv_transfer_params_name_the_field(change, field):
    params = dict(GOOD_PARAMS)
    for key, value in change.items():
        if value is DELETE:
            del params[key]
        else:
            params[key] = value
    with pytest.raises(protocol.KVTransferParamsError) as caught:
        protocol.remote_prefill_params(params)
    assert field in str(caught.value)


def test_kv_transfer_params_that_are_not_an_object():
    with pytest.raises(protocol.KVTransferParamsError, match="must be an object, got list"):
        protocol.remote_prefill_params([GOOD_PARAMS])


@pytest.mark.parametrize("fault", ["group_count", "out_of_range"])
def test_bad_block_ids_fail_the_request_and_free_prefill(peers, decoders, fault):
    """Block ids that do not fit: the request fails before a byte moves, and decode tells
    prefill to free its blocks (the handshake is done, so it can)."""
    decoder = decoders("g4tiny", "per_layer")
    index = {"group_count": 6, "out_of_range": 7}[fault]
    request = peers.main.request("tiny", index)
    params = dict(request["kv_transfer_params"])
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=18)
    if fault == "group_count":
        local_ids = local_ids[:-1]
        expected = "KVTransferParamsError: remote_block_ids has 6 group(s), this engine has 5"
    else:
        params["remote_block_ids"] = [list(ids) for ids in params["remote_block_ids"]]
        params["remote_block_ids"][5][0] = 10**6
        expected = "DescriptorError: remote block id 1000000 of group 5 is out of range"
    decoder.zero()
    request_id = new_id(fault)
    decoder.sink.request(request_id, protocol.remote_prefill_params(params), local_ids)
    done, failure, _ = decoder.wait(request_id, HANDSHAKE_S + 5)

    assert not done
    assert failure.startswith(expected), failure
    assert decoder.untouched()
    assert decoder.sink.in_flight == set()
    released = peers.main.released_event("tiny", request["request_id"])
    assert request["request_id"] not in released["held"]
