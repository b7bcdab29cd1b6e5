"""Replay protection bounded by time, not by count (issue 46, item 7): a nonce is a sender
id and its counter, and the server keeps a window of counters per sender, forgetting a
sender only once all it sent is stale. Real servers and sockets on loopback, and the
window itself with a clock of the test's."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
from collections.abc import Iterator

import msgspec
import pytest

from kvshare_connector.transfer.wire import side_channel
from kvshare_connector.transfer.wire.side_channel import (
    Limits,
    SideChannelError,
    SideChannelServer,
    destination,
    encode_request,
    reply_length,
)
from lab.tools.attacks import connect, exchange, replay_after

SECRET = b"the deployment's shared secret"
ENGINE = "prefill-replay"


@pytest.fixture
def make_server() -> Iterator:
    made: list[SideChannelServer] = []

    def make(limits: Limits) -> SideChannelServer:
        made.append(SideChannelServer("127.0.0.1", 0, lambda p: b"ok", SECRET, ENGINE, limits))
        return made[-1]

    yield make
    for server in made:
        server.close()


def _signed(server: SideChannelServer, sender: bytes, counter: int) -> bytes:
    """A request signed with the secret, with a nonce of our choosing."""
    from kvshare_connector.transfer.wire.side_channel_wire import _REQUEST_DOMAIN

    where = destination(ENGINE, "127.0.0.1", server.port)
    nonce = sender + struct.pack(">Q", counter)
    stamp = struct.pack(">Q", int(time.time() * 1000))
    mac = hmac.new(
        SECRET, _REQUEST_DOMAIN + nonce + stamp + where.encode() + b"\0" + b"hi",
        hashlib.sha256,
    ).digest()  # fmt: skip
    return side_channel._frame(1, msgspec.msgpack.encode([where, nonce + stamp + mac, b"hi"]))


@pytest.mark.slow
def test_a_replay_is_refused_however_many_signed_messages_came_between(make_server):
    """Issue 46: nonces were remembered 2^18 at most, so a captured signed request was
    accepted again after 2^18 others (25.6 s of them; legitimate traffic above ~2,200
    messages/s would do the same). Here 2^18 + 4,096 signed requests from 4 addresses come
    between: every one of them is accepted (the control: counters out of order within the
    window are no replays), the captured one only the first time."""
    server = make_server(Limits(rate=1e9, burst=1e9))
    where = destination(ENGINE, "127.0.0.1", server.port)
    captured = encode_request(b"hello", where, SECRET)[0]
    sources = [f"127.0.2.{i}" for i in range(1, 5)]
    seen = replay_after(
        server.port, where, SECRET, captured, (1 << 18) + 4096, b"x", sources, rate=1e9
    )
    assert seen["first"] == "ok" and seen["codes"] == {"ok": (1 << 18) + 4096}, seen
    assert seen["replay"] == "replayed"


def test_counters_in_and_out_of_order_replays_and_a_full_table(make_server):
    """On the wire: counters arriving out of order are accepted once each, a repeated one
    and one below the window are replays; a new sender over the table's bound is told
    ``busy`` (retried), while no sender it holds is forgotten (its replay still refused)."""
    server = make_server(Limits(senders=2))
    first, second, third = b"A" * 8, b"B" * 8, b"C" * 8
    for counter in (5, 3, 4, 5000, 4500):
        assert exchange(server.port, _signed(server, first, counter))[0] == "ok", counter
    for counter in (3, 5000, 5000 - 4096):
        assert exchange(server.port, _signed(server, first, counter))[0] == "replayed", counter
    assert exchange(server.port, _signed(server, second, 1))[0] == "ok"
    assert exchange(server.port, _signed(server, third, 1))[0] == "busy"
    assert exchange(server.port, _signed(server, first, 4))[0] == "replayed"
    assert server.refused == {"replayed": 4, "busy": 1}


def test_a_sender_is_forgotten_only_once_all_it_sent_is_stale():
    from kvshare_connector.transfer.wire.side_channel_replay import ReplayWindows

    windows = ReplayWindows(fresh_s=120.0, max_senders=1)
    nonce = b"A" * 8 + struct.pack(">Q", 7)
    assert windows.check(nonce, sent=1000.0, now=1000.0) is None
    assert windows.check(b"B" * 8 + struct.pack(">Q", 1), 1100.0, now=1100.0) == "busy"
    assert windows.check(nonce, sent=1000.0, now=1119.0) == "replayed"  # still fresh
    # 121 s on, everything A sent is stale (refused before it gets here): A makes room
    assert windows.check(b"B" * 8 + struct.pack(">Q", 1), 1121.0, now=1121.0) is None
    assert len(windows) == 1


def test_a_forked_process_signs_as_another_sender():
    """A child would repeat its parent's counters, which the server refuses as replays."""
    from kvshare_connector.transfer.wire.side_channel_replay import SENDER_BYTES, next_nonce

    mine = next_nonce()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(write, next_nonce())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 64)
    os.close(read)
    os.close(write)
    assert len(child) == len(mine) == 16 and child[:SENDER_BYTES] != mine[:SENDER_BYTES]
    assert next_nonce()[:SENDER_BYTES] == mine[:SENDER_BYTES]  # the control: ours stays


def test_a_peer_of_another_frame_version_is_told_so(make_server):
    """The nonce's meaning changed with frame version 2: a version 1 request is refused
    with a reply a version 1 peer reads, naming both versions; a version 1 reply is an
    error naming both (the control: this version's request is answered)."""
    server = make_server(Limits())
    where = destination(ENGINE, "127.0.0.1", server.port)
    frame = encode_request(b"hi", where, SECRET)[0]
    assert exchange(server.port, frame)[0] == "ok"
    old = frame[:4] + b"\x01" + encode_request(b"hi", where, SECRET)[0][5:]
    with connect(server.port) as sock:
        sock.sendall(old)
        sock.shutdown(socket.SHUT_WR)
        reply = b"".join(iter(lambda: sock.recv(1 << 16), b""))
    header = reply[: side_channel.HEADER_BYTES]
    assert header[4] == 1  # framed as the peer's version: it can read the refusal
    code, _mac, text = msgspec.msgpack.decode(reply[side_channel.HEADER_BYTES :])
    assert code == "version" and b"version 1" in text and b"speaks 2" in text
    with pytest.raises(SideChannelError, match="frame version 1, this engine 2"):
        reply_length(header, "there")
