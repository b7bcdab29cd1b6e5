"""What goes wrong around a NIXL transfer, with real peers in separate processes: garbage
on the side channel, a prefill that answers wrong or not at all, one killed mid-READ, a
decode that never comes (leases), a READ NIXL will not release, block ids that do not fit.
Each fails the request with an error naming the problem, moves no byte it should not, and
leaves both sides serving with nothing held.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, replace

import msgspec
import numpy as np
import pytest

from kvshare_connector.demo import kvcheck
from kvshare_connector.demo.parts import request_block_ids
from kvshare_connector.layout.descriptors import request_descriptors
from kvshare_connector.toolkit.procs import pick_free_port
from kvshare_connector.transfer.wire import kv_params, protocol, side_channel
from kvshare_connector.transfer.wire.side_channel_client import ask
from lab.tools.attacks import exchange, read_frame, request_header

from .support.transfer_decode import (
    E2B,
    FAULT_HANDSHAKE_S,
    HANDSHAKE_S,
    TOKENS,
    TRANSFER_S,
    assert_landed,
    decoder_pool,
    new_id,
    with_defaults,
)
from .support.transfer_peer import PeerProcess

PEER_SOURCES = with_defaults([
    {"name": "tiny", "model": "g4tiny", "layout": "per_layer", "requests": 3, "seed": 100},
    {"name": "drain", "model": "g4tiny", "layout": "per_layer", "requests": 2, "seed": 900},
    {"name": "lease", "model": "g4tiny", "layout": "per_layer", "requests": 1, "lease_s": 1.5,
     "kv_mib": 8, "seed": 600},
])  # fmt: skip

# The peer that gets killed: E2B-shaped, requests of ~120 MiB so a READ lasts long
# enough to be killed in the middle of it. Filled with 0x5A bytes (patterns cost seconds).
VICTIM_TOKENS = 20_000
VICTIM_SOURCES = [
    {"name": "victim", "model": E2B, "layout": "per_layer", "requests": 3,
     "tokens": VICTIM_TOKENS, "kv_mib": 400, "fill": "bytes"},
]  # fmt: skip


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


@pytest.fixture(scope="module")
def decoders(peers):
    """Depends on ``peers`` so that the peers start importing vLLM while this process does."""
    yield from decoder_pool()


# ---- the side channel under garbage ---------------------------------------------------


def _answer(port: int, engine_id: str, payload: bytes) -> protocol.SideMessage:
    """Send ``payload`` as a well-framed request: the protocol's answer to it."""
    where = side_channel.destination(engine_id, "127.0.0.1", port)
    frame, _ = side_channel.encode_request(payload, where)
    reply = exchange(port, frame)
    assert reply is not None, f"no answer to {payload[:16]!r}"
    code, _mac, answer = reply
    assert code == "ok", (code, answer)
    return protocol.decode(answer)


def test_prefill_side_channel_answers_garbage_with_errors_and_keeps_serving(peers, decoders):
    # Every source built: the answers below are bounded at 3 s, which a peer still
    # building vLLM stacks on a loaded 2-core box (holding the GIL) may not meet.
    assert peers.main.all_ready.wait(300)
    info = peers.main.source("tiny")
    port = info["requests"][0]["kv_transfer_params"]["remote_port"]
    engine = info["engine_id"]
    hello = protocol.encode(protocol.Hello(protocol.PROTOCOL_VERSION, "tester"))
    bad_payloads = {
        b"garbage": "malformed side-channel message",
        b"": "malformed side-channel message",
        np.random.default_rng(0).bytes(64 << 10): "malformed side-channel message",
        hello[:-3]: "malformed side-channel message",  # truncated
        hello[:1]: "malformed side-channel message",
        b"\x91" * 1000 + b"\x01": "malformed side-channel message",  # 1,000 levels deep
        protocol.encode(protocol.ErrorReply("hi")): (
            "expected hello, claim or release, got ErrorReply"
        ),
        protocol.encode(protocol.Hello(99, "tester")): "protocol version 99 not supported",
        protocol.encode(protocol.Hello(protocol.PROTOCOL_VERSION, "t", "someone-else")): (
            "not 'someone-else'"
        ),
    }
    for payload, message in bad_payloads.items():
        answer = _answer(port, engine, payload)
        assert isinstance(answer, protocol.ErrorReply), answer
        assert message in answer.message, answer.message
    # What is not a well-framed request is refused at the framing, answered, and the
    # connection closed; the server lives on.
    for data, code in [
        (b"\xff" * 64 + b"GET / HTTP/1.1\r\n\r\n", "malformed"),
        (request_header(600 << 20), "oversize"),
        (side_channel.encode_request(hello, "someone@127.0.0.1:1")[0], "misaddressed"),
        # a signed request to a side channel without a secret
        (side_channel.encode_request(hello, f"{engine}@127.0.0.1:{port}", b"k" * 16)[0],
         "unauthenticated"),
    ]:  # fmt: skip
        reply = exchange(port, data)
        assert reply is not None, code
        assert reply[0] == code

    # A good handshake still works, and so does a read.
    answer = protocol.decode(ask("127.0.0.1", port, hello, HANDSHAKE_S, engine_id=engine))
    assert isinstance(answer, protocol.HandshakeReply)
    assert answer.engine_id == info["engine_id"]
    decoder = decoders("g4tiny", "per_layer")
    request = info["requests"][0]
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=14)
    assert_landed(decoder, decoder.read(request, local_ids, new_id("after-garbage")), local_ids)


class FakeSideChannel:
    """A raw TCP server standing where a prefill's side channel should be."""

    def __init__(self, behaviour: str, topology):
        self.behaviour = behaviour
        self.topology = topology
        self.asked = 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.05)
        self.port = self._server.getsockname()[1]
        self._stop = threading.Event()
        self._open: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _answer(self) -> bytes | None:
        ok = side_channel.encode_reply
        if self.behaviour == "garbage":
            return ok("ok", b"\x93\xff\x00 definitely not msgpack")
        if self.behaviour == "wrong_type":
            return ok("ok", protocol.encode(protocol.Hello(protocol.PROTOCOL_VERSION, "fake")))
        if self.behaviour == "refuses":
            return ok("ok", protocol.encode(protocol.ErrorReply("go away")))
        if self.behaviour == "bad_frames":
            return b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 64
        if self.behaviour == "bad_layout":
            layout = protocol.layout_to_msg(self.topology)
            layout = msgspec.structs.replace(layout, fingerprint="0" * 16)
            reply = protocol.HandshakeReply(
                protocol.PROTOCOL_VERSION, "fake-prefill", "fake-agent", b"not metadata", layout
            )
            return ok("ok", protocol.encode(reply))
        return None  # silent

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            self._open.append(conn)
            conn.settimeout(5)
            with contextlib.suppress(OSError, ConnectionError):
                read_frame(conn)
                self.asked += 1
                answer = self._answer()
                if answer is not None:
                    conn.sendall(answer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for conn in self._open:
            conn.close()
        self._server.close()


@pytest.mark.parametrize(
    ("behaviour", "expected"),
    [
        ("garbage", "answered garbage"),
        ("wrong_type", "answered a Hello"),
        ("refuses", "refused the handshake: go away"),
        ("bad_frames", "answered something else than a kvshare side-channel reply"),
        ("bad_layout", "unusable layout: layout fingerprint does not match"),
        ("silent", f"no answer from the prefill side channel at 127.0.0.1:{{port}} within "
                   f"{FAULT_HANDSHAKE_S:g} s"),
        ("nobody", "no answer from the prefill side channel at 127.0.0.1:{port}: Connection "
                   "refused"),
    ],
)  # fmt: skip
def test_broken_side_channel_fails_the_request_in_bounded_time(decoders, behaviour, expected):
    decoder = decoders("g4tiny", "per_layer", handshake_s=FAULT_HANDSHAKE_S)
    fake = FakeSideChannel(behaviour, decoder.topology) if behaviour != "nobody" else None
    port = fake.port if fake else pick_free_port()
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
        decoder.sink.request(request_id, kv_params.remote_prefill_params(params), ids)
        done, failure, seconds = decoder.wait(request_id, FAULT_HANDSHAKE_S + 5)
    finally:
        if fake:
            fake.close()

    assert not done
    assert failure.startswith("HandshakeError: "), failure
    assert expected.format(port=port) in failure, failure
    assert seconds < FAULT_HANDSHAKE_S + 2.0
    if behaviour == "silent":
        assert seconds >= FAULT_HANDSHAKE_S * 0.9  # it did wait, for the bound and no longer
    elif fake is not None:
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
            kv_params.remote_prefill_params(info["requests"][0]["kv_transfer_params"]),
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
            kv_params.remote_prefill_params(info["requests"][1]["kv_transfer_params"]),
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
            kv_params.remote_prefill_params(info["requests"][2]["kv_transfer_params"]),
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
    fault.sink.request(late, kv_params.remote_prefill_params(params), params["remote_block_ids"])
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
    # a read before the fault: the prefill's handshake and nameplate READ are done
    warm_ids = request_block_ids(decoder.topology, TOKENS, seed=40)
    warm = decoder.read(peers.main.request("drain", 1), warm_ids, new_id("drain"))
    assert_landed(decoder, warm, warm_ids)
    request = peers.main.request("drain", 0)
    local_ids = request_block_ids(decoder.topology, TOKENS, seed=41)
    rid = new_id("drain")
    monkeypatch.setattr(sink, "settings", replace(sink.settings, transfer_timeout_s=0.2))
    monkeypatch.setattr(transport, "state", lambda handle: "PROC")  # never finishes
    real_release = type(transport).release
    monkeypatch.setattr(transport, "release", lambda handle: False)  # NIXL refuses
    sink.request(rid, kv_params.remote_prefill_params(request["kv_transfer_params"]), local_ids)
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


@pytest.mark.parametrize("fault", ["group_count", "out_of_range"])
def test_bad_block_ids_fail_the_request_and_free_prefill(peers, decoders, fault):
    """Block ids that do not fit: the request fails before a byte moves, and decode tells
    prefill to free its blocks (the handshake is done, so it can)."""
    decoder = decoders("g4tiny", "per_layer")
    index = {"group_count": 1, "out_of_range": 2}[fault]
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
    decoder.sink.request(request_id, kv_params.remote_prefill_params(params), local_ids)
    done, failure, _ = decoder.wait(request_id, HANDSHAKE_S + 5)

    assert not done
    assert failure.startswith(expected), failure
    assert decoder.untouched()
    assert decoder.sink.in_flight == set()
    released = peers.main.released_event("tiny", request["request_id"])
    assert request["request_id"] not in released["held"]
