"""Fail-closed checks of a transfer (issue 13, item 4): block counts, null blocks, the
prompt's identity, one reader per request, claims within the request's blocks, the engine
identity. In-process: a ``KVSource`` on a stand-in transport (claims are side-channel
business, no NIXL), vLLM's real Scheduler for the prompt check."""

from __future__ import annotations

import re
import time
from typing import Any

import msgspec
import pytest

from kvshare_connector.layout.matching import EngineIdentity, config_digest, differences
from kvshare_connector.layout.topology import (
    BlockGeometry,
    Dim,
    GroupSpec,
    KVTopology,
    LayerSpec,
    OwnerLayer,
    Region,
)
from kvshare_connector.toolkit.procs import pick_free_port
from kvshare_connector.transfer.decode.sink import align_block_ids
from kvshare_connector.transfer.wire import kv_params, protocol
from kvshare_connector.transfer.wire.settings import EngineSettings
from kvshare_connector.transfer.wire.side_channel_client import ask

# ---- a. block counts, c. null blocks ----------------------------------------------------


def _group(index: int, block_size: int, window: int | None = None) -> GroupSpec:
    kind = "sliding" if window else "full"
    spec = LayerSpec(block_size, 1, 8, "bfloat16", 2, kind, window)
    return GroupSpec(index, spec, (f"layer.{index}",))


FULL16 = _group(0, 16)
SLIDE32 = _group(1, 32, window=128)  # keep = ceil(128 / 32) + 1 = 5 blocks


def test_block_counts_must_be_equal_without_decode_token_counts():
    with pytest.raises(kv_params.KVTransferParamsError, match="group 0: prefill sent 2 block"):
        align_block_ids([[1, 2, 3]], [[7, 8]])  # decode holds more than prefill sent
    with pytest.raises(kv_params.KVTransferParamsError, match="group 1: prefill sent 3 block"):
        align_block_ids([[1, 2], [4]], [[7, 8], [9, 10, 11]])  # silently truncated before


def test_legitimate_counts_pair_at_the_tail():
    groups = [FULL16, SLIDE32]
    # 300 tokens, nothing cached: full 19 blocks; window 10 blocks clipped to 5, of which
    # decode loads cdiv(300, 32) - (300 - 127) // 32 = 10 - 5 = 5.
    local = [list(range(100, 119)), [200, 201, 202, 203, 204]]
    remote = [list(range(1, 20)), [21, 22, 23, 24, 25]]
    out_l, out_r = align_block_ids(local, remote, groups, 300, 0, 300)
    assert out_l == local and out_r == remote

    # 310 tokens, 64 cached locally: full group loads blocks 4..19 (16); window: decode
    # starts at max(64 // 32, (310 - 127) // 32) = 5 -> 10 - 5 = 5 blocks; prefill's window
    # tail begins with the null block its window left (position 5 of 10 is real here).
    local = [list(range(100, 116)), [300, 301, 302, 303, 304]]
    remote = [list(range(1, 21)), [40, 41, 42, 43, 44]]
    out_l, out_r = align_block_ids(local, remote, groups, 310, 64, 310)
    assert out_l == local
    assert out_r == [list(range(5, 21)), [40, 41, 42, 43, 44]]


def test_window_null_blocks_stay_unpaired():
    """vLLM, 320 tokens, window 128, B 32: 10 blocks; prefill's window left positions below
    (320 - 127) // 32 = 6 (null); its clipped tail of 5 (positions 5..9) starts with one
    null, which decode (4 blocks, positions 6..9) does not pair."""
    groups = [SLIDE32]
    out_l, out_r = align_block_ids([[60, 61, 62, 63]], [[0, 51, 52, 53, 54]], groups, 320, 0, 320)
    assert out_l == [[60, 61, 62, 63]] and out_r == [[51, 52, 53, 54]]


@pytest.mark.parametrize(
    ("local", "remote", "tokens", "cached", "remote_tokens", "message"),
    [
        # decode holds one block fewer than 300 uncached tokens need
        ([list(range(100, 118)), [1, 2, 3, 4, 5]], None, 300, 0, 300, "group 0: prefill"),
        # a local hit of 64 tokens leaves 15 blocks to load, not 19
        (None, None, 300, 64, 300, "group 0: prefill sent 19 block(s) and decode holds 19"),
        # prefill computed other tokens than this prompt
        (None, None, 300, 0, 374, "prefill computed 374 tokens, this request's prompt has 300"),
    ],
)
def test_block_counts_other_than_the_rule_are_refused(
    local, remote, tokens, cached, remote_tokens, message
):
    local = local or [list(range(100, 119)), [200, 201, 202, 203, 204]]
    remote = remote or [list(range(1, 20)), [21, 22, 23, 24, 25]]
    with pytest.raises(kv_params.KVTransferParamsError, match=re.escape(message)):
        align_block_ids(local, remote, [FULL16, SLIDE32], tokens, cached, remote_tokens)


def test_each_group_pairs_past_its_own_hit():
    """Issue 50: 320 tokens whose first 224 full attention holds (14 blocks) and the
    sliding-window group none (its window at 224 was never loaded): full attention loads
    positions 14..19, the window positions 6..9, each paired at prefill's tail. The same
    blocks under one hit for both, either way, are refused; so is a hit per group that
    names another number of groups."""
    groups = [FULL16, SLIDE32]
    local = [list(range(100, 106)), [60, 61, 62, 63]]
    remote = [list(range(1, 21)), [0, 51, 52, 53, 54]]
    out_l, out_r = align_block_ids(local, remote, groups, 320, (224, 192), 320)
    assert out_l == local and out_r == [list(range(15, 21)), [51, 52, 53, 54]]
    for one, group in ((224, 1), (192, 0), (0, 0)):
        with pytest.raises(kv_params.KVTransferParamsError, match=f"group {group}: prefill"):
            align_block_ids(local, remote, groups, 320, one, 320)
    with pytest.raises(kv_params.KVTransferParamsError, match="name 3 KV cache group"):
        align_block_ids(local, remote, groups, 320, (224, 192, 0), 320)


def test_remote_null_block_paired_with_a_real_local_block_is_refused():
    with pytest.raises(kv_params.KVTransferParamsError, match="group 1, position 0 of decode's"):
        align_block_ids([[5, 6], [7, 8]], [[1, 2], [0, 9]])


# ---- b. the prompt prefill computed -----------------------------------------------------


def test_prefill_states_its_prompt_and_decode_compares():
    ids = list(range(3, 303))
    params = kv_params.kv_transfer_params(
        remote_block_ids=[[1]],
        remote_engine_id="p",
        remote_request_id="r",
        remote_host="127.0.0.1",
        remote_port=5600,
        remote_num_tokens=300,
        prompt_token_ids=ids,
    )
    assert params["remote_prompt_tokens"] == 300
    parsed = kv_params.remote_prefill_params(dict(params, do_remote_prefill=True))
    assert kv_params.prompt_mismatch(parsed, ids) is None
    assert "prefill had 300 prompt tokens, this request has 299" in kv_params.prompt_mismatch(
        parsed, ids[:-1]
    )
    other = [*ids[:-1], 7]
    assert "digest of the prompt's 300 token ids" in kv_params.prompt_mismatch(parsed, other)
    # A prompt that extends prefill's (the first-token hand-off) is prefill's for its first
    # 300 tokens: those are compared and loaded, the rest is decode's to compute.
    assert kv_params.prompt_mismatch(parsed, [*ids, 11, 12]) is None
    assert kv_params.loaded_prompt_tokens(parsed, 302) == 300
    assert kv_params.loaded_prompt_tokens(parsed, 300) == 300
    assert "the prompt's first 300 of 301 token ids" in kv_params.prompt_mismatch(
        parsed, [*other, 11]
    )
    # A proxy or prefill of elsewhere: nothing to compare, accepted, and no prefix is taken
    # on its word: the whole prompt counts (the block counts then refuse another length).
    legacy = {k: v for k, v in params.items() if not k.startswith("remote_prompt")}
    assert kv_params.prompt_mismatch(kv_params.remote_prefill_params(legacy), other) is None
    assert kv_params.loaded_prompt_tokens(kv_params.remote_prefill_params(legacy), 302) == 302
    undigested = {k: v for k, v in params.items() if k != "remote_prompt_digest"}
    assert kv_params.loaded_prompt_tokens(kv_params.remote_prefill_params(undigested), 302) == 302


def test_decode_scheduler_refuses_another_prompt_and_computes_it_locally():
    """vLLM's real Scheduler: a digest of another prompt fails the load before any
    handshake (nothing listens at remote_port); a request without a digest is accepted
    (and fails at the unreachable prefill instead)."""
    from lab.tools.engine_sim import Engine, decode_requests, make_request

    decode = Engine(
        "g4tiny",
        "per_layer",
        "kv_consumer",
        pick_free_port(),
        {"handshake_timeout_s": 1.0, "transfer_timeout_s": 2.0},
        failure_policy="recompute",  # vLLM >= 0.30 would end the failed load otherwise
    )
    try:
        base = {
            "do_remote_prefill": True,
            "remote_block_ids": [[1, 2]] * 6,
            "remote_engine_id": "gone",
            "remote_request_id": "p0",
            "remote_host": "127.0.0.1",
            "remote_port": pick_free_port(),
            "tp_size": 1,
            "remote_num_tokens": 200,
        }
        # decode_requests gives request p<i> the prompt of make_request(.., 200 + 37 i, seed i)
        prompt = list(make_request("x", 237, 1, None, 1).prompt_token_ids)
        wrong = dict(base, remote_prompt_tokens=200, remote_prompt_digest="0" * 64)
        right = dict(
            base,
            remote_prompt_tokens=237,
            remote_num_tokens=237,
            remote_prompt_digest=kv_params.prompt_digest(prompt),
            remote_request_id="p1",
        )
        # vLLM drains the scheduler's stats every step: keep what it took.
        taken = []
        connector = decode.scheduler.connector
        drain = connector.get_kv_connector_stats
        connector.get_kv_connector_stats = lambda: taken.append(drain()) or taken[-1]
        report = decode_requests(decode, {"p0": {"kv_transfer_params": wrong}}, 200)
        error = report["d0"]["kv_transfer_params"]["kv_load_error"]
        assert "the prompt is not the one prefill computed" in error, error
        assert report["d0"]["tokens"]
        assert sum(s.data["failed_loads"] for s in taken if s is not None) == 1

        # "d1": the prompt prefill stated (237 tokens, seed 1): the digest is accepted
        report = decode_requests(decode, {"p1": {"kv_transfer_params": right}}, 200)
        error = report["d1"]["kv_transfer_params"]["kv_load_error"]
        assert "no answer from the prefill side channel" in error, error  # digest accepted
        pool = decode.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    finally:
        decode.close()


# ---- d. one reader, e. only the request's blocks (KVSource on a stand-in transport) -----


class StandInTransport:
    """What ``KVSource`` needs of a transport, without NIXL: claims are side-channel work."""

    name = "stand-in"
    registered_bytes = 0

    def __init__(self) -> None:
        self.pending: dict[str, list[bytes]] = {}

    def register(self, regions: Any) -> None:
        return None

    def metadata(self) -> bytes:
        return b"stand-in-metadata"

    def notifications(self) -> dict[str, list[bytes]]:
        out, self.pending = self.pending, {}
        return out

    def close(self) -> None:
        return None


def tiny_topology() -> KVTopology:
    group = _group(0, 16)
    geometry = BlockGeometry(0x10000, 512, (Dim("token", 16, 32), Dim("content", 16, 2)), 0, 2, -1)
    owner = OwnerLayer("layer.0", 0, group.spec, geometry, ("block", "token", "content"))
    return KVTopology(
        groups=(group,),
        owners={"layer.0": owner},
        sharers={},
        regions=(Region(0x10000, 512 * 64, -1),),
        num_blocks=64,
        layout="per_layer",
    )


@pytest.fixture
def source():
    from kvshare_connector.transfer.prefill.source import KVSource

    made = KVSource(tiny_topology(), StandInTransport(), EngineSettings("prefill-x"))
    made.hold("req-a", block_ids=[[4, 5, 6]])
    yield made
    made.close()


def _claim(source, token: str, blocks: list[list[int]], request_id: str = "req-a"):
    claim = protocol.Claim(
        protocol.PROTOCOL_VERSION,
        "decode-1",
        [request_id],
        5.0,
        token=token,
        block_ids={request_id: [protocol.pack_ids(ids) for ids in blocks]},
    )
    return protocol.decode(
        ask("127.0.0.1", source.port, protocol.encode(claim), 5.0, engine_id="prefill-x")
    )


def test_second_reader_is_refused_while_the_first_reads_and_after(source):
    first = _claim(source, "a" * 32, [[4, 5, 6]])
    assert first.held == ["req-a"]
    assert _claim(source, "a" * 32, [[4, 5, 6]]).held == ["req-a"]  # the same reader, again
    second = _claim(source, "b" * 32, [[4, 5, 6]])
    assert second.held == [] and "already claimed by another decode" in second.refused["req-a"]
    # The refused reader's abort does not free the first reader's blocks ...
    source.transport.pending = {
        "decode-2": [protocol.notification(protocol.NOTIF_ABORT, "req-a", "b" * 32)]
    }
    assert source.poll() == (set(), set())
    assert "req-a" in source.held
    # ... the reader's done does, and a claim after the read finds the blocks gone.
    source.transport.pending = {
        "decode-1": [protocol.notification(protocol.NOTIF_DONE, "req-a", "a" * 32)]
    }
    assert source.poll() == ({"req-a"}, set())
    late = _claim(source, "b" * 32, [[4, 5, 6]])
    assert late.gone == ["req-a"] and late.held == []
    assert source.take_refused()["refused_claims"] == 1


def test_a_claim_must_name_exactly_the_blocks_the_request_holds(source):
    reply = _claim(source, "c" * 32, [[4, 5, 9]])
    assert reply.held == []
    assert "block ids of group 0 are not the ones prefill holds for request req-a" in (
        reply.refused["req-a"]
    )
    assert "the first 2: it names block 9, prefill holds 6 there" in reply.refused["req-a"]
    # A subset (or nothing at all) would let a claimer that saw part of the params steal
    # the request from its real reader: refused too.
    assert "it names 2, prefill holds 3" in _claim(source, "c" * 32, [[5, 6]]).refused["req-a"]
    assert "it names 0, prefill holds 3" in _claim(source, "c" * 32, [[]]).refused["req-a"]
    # The request's own blocks in another order would put each block's KV at another
    # position: reversed, sorted differently, rotated, each refused, naming where.
    for order, first in (([6, 5, 4], 0), ([4, 6, 5], 1), ([5, 6, 4], 0)):
        why = _claim(source, "c" * 32, [order]).refused["req-a"]
        assert "in their order" in why and f"the first {first}:" in why, why
    # ids that are not whole 4-byte ids, and 2**32 - 1 where a block is held
    claim = protocol.Claim(protocol.PROTOCOL_VERSION, "decode-1", ["req-a"], 5.0, token="c" * 32,
                           block_ids={"req-a": [b"\x04\x00\x00\x00\x05"]})  # fmt: skip
    reply = protocol.decode(ask("127.0.0.1", source.port, protocol.encode(claim), 5.0,
                                engine_id="prefill-x"))  # fmt: skip
    assert "not a whole number of ids" in reply.refused["req-a"]
    top = _claim(source, "c" * 32, [[4, 5, (1 << 32) - 1]])
    assert "names block 4294967295" in top.refused["req-a"]
    reply = _claim(source, "c" * 32, [[4], [5]])
    assert "names 2 group(s) of blocks, prefill holds 1" in reply.refused["req-a"]
    # A refused claim took nothing: the right claim still gets the blocks.
    assert _claim(source, "c" * 32, [[4, 5, 6]]).held == ["req-a"]


def test_one_claim_for_several_requests_binds_each_to_its_own_reader(source):
    """Decode claims a step's requests from one prefill in one message, each request with
    its own reader token: each is bound, refused or granted on its own."""
    source.hold("req-b", block_ids=[[7, 8]])
    assert _claim(source, "x" * 32, [[7, 8]], "req-b").held == ["req-b"]  # another reader
    claim = protocol.Claim(
        protocol.PROTOCOL_VERSION,
        "decode-1",
        ["req-a", "req-b"],
        5.0,
        tokens={"req-a": "a" * 32, "req-b": "b" * 32},
        block_ids={"req-a": [protocol.pack_ids([4, 5, 6])], "req-b": [protocol.pack_ids([7, 8])]},
    )
    reply = protocol.decode(
        ask("127.0.0.1", source.port, protocol.encode(claim), 5.0, engine_id="prefill-x")
    )
    assert reply.held == ["req-a"]
    assert "already claimed by another decode" in reply.refused["req-b"]
    # req-a's reader is the token the claim gave it, not the claim's (empty) default one
    assert "already claimed" in _claim(source, "c" * 32, [[4, 5, 6]]).refused["req-a"]
    assert _claim(source, "a" * 32, [[4, 5, 6]]).held == ["req-a"]


def test_claim_tokens_for_requests_it_does_not_name_are_refused(source):
    claim = protocol.Claim(
        protocol.PROTOCOL_VERSION, "d", ["req-a"], 1.0, tokens={"req-z": "z" * 32}
    )
    reply = protocol.decode(
        ask("127.0.0.1", source.port, protocol.encode(claim), 5.0, engine_id="prefill-x")
    )
    assert isinstance(reply, protocol.ErrorReply)
    assert "claim tokens for requests the claim does not name" in reply.message
    assert "req-a" in source.held and source.take_refused()["refused_messages"] == 1


def test_claims_over_the_per_message_caps_are_refused(source):
    claim = protocol.Claim(
        protocol.PROTOCOL_VERSION,
        "d",
        [f"r{i}" for i in range(protocol.MAX_IDS_PER_MESSAGE + 1)],
        1.0,
    )
    reply = protocol.decode(
        ask("127.0.0.1", source.port, protocol.encode(claim), 5.0, engine_id="prefill-x")
    )
    assert isinstance(reply, protocol.ErrorReply) and "request ids in one message" in reply.message
    assert source.take_refused()["refused_messages"] == 1


# ---- f. the engine identity -------------------------------------------------------------


def test_identity_differences_are_named_and_travel_in_the_layout():
    topology = tiny_topology()
    mine = EngineIdentity("google/gemma-4-E2B-it", "aa", "bfloat16", "auto", 16, "0.26.0")
    theirs = EngineIdentity("google/gemma-4-E4B-it", "bb", "float16", "fp8", 32, "0.26.1")
    found = differences(topology, topology, mine, theirs)
    assert found == [
        "model: local google/gemma-4-E2B-it, remote google/gemma-4-E4B-it",
        "model_config_hash: local aa, remote bb",
        "dtype: local bfloat16, remote float16",
        "cache_dtype: local auto, remote fp8",
        "block_size: local 16, remote 32",
        "vllm_version: local 0.26.0, remote 0.26.1",
    ]
    assert differences(topology, topology, mine, mine) == []
    assert differences(topology, topology, mine, None) == []  # an engine that does not say

    msg = protocol.layout_to_msg(topology, theirs)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=protocol.LayoutMsg)
    protocol.layout_from_msg(wire)
    assert protocol.identity_from_msg(wire) == theirs
    tampered = msgspec.structs.replace(
        wire, identity=msgspec.structs.replace(wire.identity, model="google/gemma-4-E2B-it")
    )
    with pytest.raises(protocol.ProtocolError, match="fingerprint does not match"):
        protocol.layout_from_msg(tampered)


def test_config_digest_ignores_where_the_model_was_loaded_from():
    config = {"model_type": "gemma4", "hidden_size": 1536, "_name_or_path": "/models/a"}
    moved = dict(config, _name_or_path="google/gemma-4-E2B-it", transformers_version="5.17")
    assert config_digest(config) == config_digest(moved)
    assert config_digest(config) != config_digest(dict(config, hidden_size=2048))


def test_claiming_again_never_holds_a_request_past_its_first_claims_bound():
    """A reader that claims again and again (each claim asks for more time) once kept a
    request's blocks for as long as it went on; they are freed at the first claim's
    bound, and that is counted."""
    from kvshare_connector.transfer.prefill.source import KVSource

    made = KVSource(tiny_topology(), StandInTransport(), EngineSettings("prefill-x", lease_s=0.2))
    try:
        made.hold("req-a", block_ids=[[4, 5, 6]])
        claim = protocol.Claim(protocol.PROTOCOL_VERSION, "decode-1", ["req-a"], 0.5,
                               token="p" * 32,
                               block_ids={"req-a": [protocol.pack_ids([4, 5, 6])]})  # fmt: skip
        payload = protocol.encode(claim)
        first = time.monotonic()
        expired: set[str] = set()
        while not expired and time.monotonic() - first < 10.0:  # claims every 50 ms
            reply = protocol.decode(ask("127.0.0.1", made.port, payload, 5.0,
                                        engine_id="prefill-x"))  # fmt: skip
            assert reply.held == ["req-a"] or reply.gone == ["req-a"]
            _, expired = made.poll()
            time.sleep(0.05)
        assert expired == {"req-a"}, "re-claiming held the request for 10 s"
        assert made.take_refused()["hold_limits"] == 1
    finally:
        made.close()
