"""Side-channel security (issue 13, item 5): HMAC-SHA256 on every message with a shared
secret, bounded message size and per-peer rate, refusals answered and counted."""

from __future__ import annotations

import os
import struct
import time

import pytest
import zmq

from kvshare_connector.transfer import side_channel
from kvshare_connector.transfer.side_channel import SideChannelError, SideChannelServer, ask

SECRET = b"a shared secret of the deployment"


@pytest.fixture
def server():
    asked: list[bytes] = []

    def handler(payload: bytes) -> bytes:
        asked.append(payload)
        return b"answer to " + payload

    made = SideChannelServer(
        "127.0.0.1",
        0,
        handler,
        secret=SECRET,
        error=lambda message: b"ERROR " + message.encode(),
        max_request_bytes=1 << 16,
        peer_rate=50.0,
        peer_burst=20.0,
    )
    made.asked = asked
    yield made
    made.close()


def _raw(port: int, frames: list[bytes], timeout_s: float = 3.0) -> list[bytes] | None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart(frames)
        return sock.recv_multipart() if sock.poll(int(timeout_s * 1000)) else None
    finally:
        sock.close()


def test_authenticated_request_and_reply(server):
    assert ask("127.0.0.1", server.port, b"hello", 3.0, SECRET) == b"answer to hello"
    assert server.refused == {}


def test_unauthenticated_wrong_secret_and_garbage_are_refused_and_counted(server):
    # A client without the secret gets the protocol's error payload, clearly worded.
    plain = ask("127.0.0.1", server.port, b"hello", 3.0)
    assert plain.startswith(b"ERROR ") and b"requires the shared side_channel_secret" in plain
    with pytest.raises(SideChannelError, match="refused the message: .*wrong MAC"):
        ask("127.0.0.1", server.port, b"hello", 3.0, b"another secret")
    reply = _raw(server.port, [b"", b"\x00" * 56, b"garbage"])  # auth-sized garbage
    assert reply is not None and reply[1] == b"" and b"wrong MAC" in reply[2]
    reply = _raw(server.port, [b"", b"short auth", b"payload"])
    assert reply is not None and b"not authenticated" in reply[2]
    assert server.asked == []  # the handler never saw any of them
    assert server.refused == {"unauthenticated": 4}


def test_replayed_and_stale_messages_are_refused(server):
    import hmac

    def signed(payload: bytes, sent: float, nonce: bytes) -> list[bytes]:
        stamp = struct.pack(">Q", int(sent * 1000))
        mac = hmac.new(
            SECRET, b"kvshare-side-channel-request\0" + nonce + stamp + payload, "sha256"
        ).digest()
        return [b"", nonce + stamp + mac, payload]

    nonce = os.urandom(16)
    first = _raw(server.port, signed(b"claim", time.time(), nonce))
    assert first is not None and first[2] == b"answer to claim"
    again = _raw(server.port, signed(b"claim", time.time(), nonce))
    assert again is not None and b"was replayed" in again[2]
    old = _raw(server.port, signed(b"claim", time.time() - 3600, os.urandom(16)))
    assert old is not None and b"s old" in old[2]
    assert server.asked == [b"claim"]
    assert server.refused == {"replayed": 1, "stale": 1}


def test_a_forged_reply_is_not_accepted():
    """A reply without the right MAC (a peer without the secret, or a forger) is an error on
    the asking side, never an answer."""
    plain = SideChannelServer("127.0.0.1", 0, lambda payload: b"forged answer")
    try:
        with pytest.raises(SideChannelError, match="has no side_channel_secret"):
            ask("127.0.0.1", plain.port, b"hello", 3.0, SECRET)
    finally:
        plain.close()
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        import threading

        def forge() -> None:
            if sock.poll(3000):
                identity, *_ = sock.recv_multipart()
                sock.send_multipart([identity, b"", b"\x01" * 32, b"forged answer"])

        thread = threading.Thread(target=forge)
        thread.start()
        with pytest.raises(SideChannelError, match="is not authenticated"):
            ask("127.0.0.1", port, b"hello", 3.0, SECRET)
        thread.join()
    finally:
        sock.close(linger=0)


def test_oversize_messages_and_fast_peers_are_refused(server):
    big = b"x" * ((1 << 16) + 1)
    with pytest.raises(SideChannelError, match="exceeds 65536 B"):
        ask("127.0.0.1", server.port, big, 3.0, SECRET)
    # One peer address gets a burst of 20 and 50 per second: 60 asks at once overrun it.
    answers = 0
    for _ in range(60):
        try:
            ask("127.0.0.1", server.port, b"hi", 3.0, SECRET)
            answers += 1
        except SideChannelError as exc:
            assert "sends too fast" in str(exc)
    assert answers < 60
    refused = server.refused
    assert refused["oversize"] == 1 and refused["rate_limited"] == 60 - answers
    assert server.take_refused() == refused and server.refused == {}


def test_without_a_secret_it_works_as_before_and_warns_once(monkeypatch):
    warnings: list[str] = []
    monkeypatch.setattr(side_channel, "_warned_no_secret", False)
    monkeypatch.setattr(side_channel.logger, "warning", lambda msg, *a: warnings.append(msg))
    side_channel.warn_if_no_secret(None)
    side_channel.warn_if_no_secret(None)
    side_channel.warn_if_no_secret(SECRET)
    assert len(warnings) == 1 and "without a shared secret" in warnings[0]
    plain = SideChannelServer("127.0.0.1", 0, lambda payload: b"answer")
    try:
        assert ask("127.0.0.1", plain.port, b"hello", 3.0) == b"answer"
    finally:
        plain.close()


def test_secret_comes_from_the_extra_config_or_the_environment(monkeypatch):
    monkeypatch.delenv(side_channel.SECRET_ENV, raising=False)
    assert side_channel.resolve_secret({}) is None
    assert side_channel.resolve_secret({"side_channel_secret": "s1"}) == b"s1"
    monkeypatch.setenv(side_channel.SECRET_ENV, "s2")
    assert side_channel.resolve_secret(None) == b"s2"
    assert side_channel.resolve_secret({"side_channel_secret": "s1"}) == b"s1"
