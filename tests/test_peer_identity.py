"""Decode reads only what the engine owning the memory approved, whoever else answers.

Prefill: a real ``transfer_peer.py`` process, no shared secret (the one-host default).
Decode: this process, a ``KVSink`` over vLLM's real KV memory. The liar: a side channel in
this process, named in ``kv_transfer_params``, that relays the real prefill's handshake
(anyone can fetch it without a secret) and approves every claim itself. Before the
nameplate (``transfer/device/nameplate.py``), decode then READ the victim request's blocks from
the real prefill, which never saw a claim; and evicting the liar unloaded the NIXL agent
it shares with the real prefill, whose every later read failed with NIXL_ERR_NOT_FOUND.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvshare_connector.demo.parts import request_block_ids
from kvshare_connector.transfer.wire import protocol
from kvshare_connector.transfer.wire.side_channel import SideChannelServer
from kvshare_connector.transfer.wire.side_channel_client import ask

from .support.transfer_decode import assert_landed, decoder_pool, new_id, with_defaults
from .support.transfer_peer import PeerProcess

SOURCES = with_defaults([
    {"name": "real", "model": "g4tiny", "layout": "per_layer", "requests": 7, "seed": 1300},
])  # fmt: skip


@pytest.fixture(scope="module")
def peer():
    with PeerProcess(SOURCES) as process:
        yield process


@pytest.fixture(scope="module")
def decoders(peer):
    yield from decoder_pool()


def relay(real: dict, hello: Callable[[protocol.Hello], protocol.Hello]) -> Callable:
    """A side channel that forwards hellos (``hello`` rewrites them) to the real prefill
    and grants every claim and release itself."""
    host, port, engine = real["host"], real["port"], real["engine_id"]

    def answer(payload: bytes) -> bytes:
        message = protocol.decode(payload)
        if isinstance(message, protocol.Hello):
            return ask(host, port, protocol.encode(hello(message)), 5.0, engine_id=engine)
        return protocol.encode(protocol.ClaimReply(list(message.request_ids), []))

    return answer


@pytest.fixture
def liar(peer):
    made: list[SideChannelServer] = []

    def start(engine_id: str, hello=lambda m: m) -> SideChannelServer:
        made.append(SideChannelServer("127.0.0.1", 0, relay(peer.source("real"), hello),
                                      engine_id=engine_id))  # fmt: skip
        return made[-1]

    yield start
    for server in made:
        server.close()


def read(decoder, request: dict, request_id: str, seed: int, **params):
    local_ids = request_block_ids(decoder.topology, 300, seed=seed)
    return decoder.read(request, local_ids, request_id, **params), local_ids


def test_a_relayed_handshake_is_refused_and_the_real_prefill_keeps_serving(peer, decoders, liar):
    decoder = decoders("g4tiny", "per_layer")
    real = peer.source("real")
    # decode knows the real prefill first (its agent loaded), as in a running deployment
    first, local_ids = read(decoder, peer.request("real", 0), new_id("real"), seed=1)
    assert_landed(decoder, first, local_ids)
    decoder.sink.counters.clear()

    fake = liar(real["engine_id"])
    victim = peer.request("real", 1)
    stolen, _ = read(decoder, victim, new_id("stolen"), seed=2, remote_port=fake.port)
    assert not stolen.done, "decode read another request's KV through a relayed handshake"
    assert "relayed handshake" in stolen.failure and f":{real['port']}" in stolen.failure
    assert decoder.untouched()
    assert decoder.sink.counters["refused_peers"] == 1

    # the relay's eviction left the real prefill's agent loaded: its next read, and the
    # victim's own read (prefill never saw a claim for it), go through at once
    for index, seed in ((1, 3), (2, 4)):
        again, local_ids = read(decoder, peer.request("real", index), new_id("real"), seed=seed)
        assert_landed(decoder, again, local_ids)


def test_a_handshake_from_another_engine_than_the_params_name_is_refused(peer, decoders, liar):
    decoder = decoders("g4tiny", "per_layer")
    real = peer.source("real")
    decoder.sink.counters.clear()
    # answers for "someone-else" with the real prefill's handshake
    fake = liar("someone-else", lambda m: protocol.Hello(m.protocol_version, m.engine_id,
                                                         real["engine_id"]))  # fmt: skip
    result, _ = read(decoder, peer.request("real", 3), new_id("other"), seed=5,
                     remote_port=fake.port, remote_engine_id="someone-else")  # fmt: skip
    assert not result.done
    assert f"is engine {real['engine_id']!r}, kv_transfer_params name 'someone-else'" in (
        result.failure
    )
    assert decoder.sink.counters["refused_peers"] == 1
    assert decoder.untouched()


def test_a_missing_agent_is_handshaken_again(peer, decoders):
    """NIXL forgot the prefill's agent (here: removed behind the sink's back): the read that
    finds it missing fails, and the next one handshakes again instead of failing too."""
    decoder = decoders("g4tiny", "per_layer")
    real = peer.source("real")
    first, local_ids = read(decoder, peer.request("real", 4), new_id("gone"), seed=6)
    assert_landed(decoder, first, local_ids)
    peer_now = decoder.sink.peers.known((real["host"], real["port"]), real["engine_id"])
    assert peer_now is not None
    decoder.transport.remove_peer(peer_now.agent)
    missing, _ = read(decoder, peer.request("real", 5), new_id("gone"), seed=7)
    assert not missing.done and "NOT_FOUND" in missing.failure, missing.failure
    again, local_ids = read(decoder, peer.request("real", 6), new_id("gone"), seed=8)
    assert_landed(decoder, again, local_ids)
