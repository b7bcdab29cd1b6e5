"""The side channel's transport (docs/security.md): HMAC-SHA256 over every request and its
destination with a shared secret, replies bound to their request, everything bounded before
it is buffered, refusals answered, counted and logged within a budget, separate budgets for
authenticated and refused traffic, and no serving beyond loopback without a secret."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time

import msgspec
import pytest

from kvshare_connector.transfer.wire import side_channel, side_channel_wire
from kvshare_connector.transfer.wire.side_channel import (
    Limits,
    SideChannelError,
    SideChannelRefused,
    SideChannelServer,
    destination,
    encode_reply,
    encode_request,
)
from kvshare_connector.transfer.wire.side_channel_client import ask
from lab.tools.attacks import exchange, read_frame, request_header

SECRET = b"a shared secret of the deployment"
ENGINE = "prefill-0"


@pytest.fixture
def server():
    asked: list[bytes] = []

    def handler(payload: bytes) -> bytes:
        asked.append(payload)
        return b"answer to " + payload

    limits = Limits(max_request_bytes=1 << 16, rate=50.0, burst=20.0, request_s=1.0, idle_s=2.0)
    made = SideChannelServer("127.0.0.1", 0, handler, SECRET, ENGINE, limits)
    made.asked = asked
    yield made
    made.close()


def _to(server: SideChannelServer) -> str:
    return destination(ENGINE, "127.0.0.1", server.port)


def test_authenticated_request_and_reply(server):
    assert ask("127.0.0.1", server.port, b"hello", 3.0, SECRET, ENGINE) == b"answer to hello"
    assert server.refused == {}


def test_unauthenticated_wrong_secret_and_garbage_are_refused_and_counted(server):
    with pytest.raises(SideChannelRefused, match="requires the shared side_channel_secret"):
        ask("127.0.0.1", server.port, b"hello", 3.0, None, ENGINE)
    with pytest.raises(SideChannelRefused, match="wrong MAC"):
        ask("127.0.0.1", server.port, b"hello", 3.0, b"another secret", ENGINE)
    forged = msgspec.msgpack.encode([_to(server), b"\x00" * 56, b"garbage"])  # auth-sized
    reply = exchange(server.port, side_channel._frame(1, forged))
    assert reply is not None and reply[0] == "unauthenticated" and b"wrong MAC" in reply[2]
    assert exchange(server.port, side_channel._frame(1, b"\xc1 not msgpack"))[0] == "malformed"
    assert server.asked == []  # the handler never saw any of them
    assert server.refused == {"unauthenticated": 3, "malformed": 1}


def test_a_request_relayed_to_another_engine_is_refused(server):
    """The relay attack: decode signs a request for the endpoint kv_transfer_params name (an
    attacker's), which forwards it unchanged to prefill. The MAC covers the destination, so
    prefill refuses it, and the attacker learns nothing."""
    relayed, _ = encode_request(b"hello", destination(ENGINE, "10.9.8.7", 5600), SECRET)
    reply = exchange(server.port, relayed)
    assert reply is not None and reply[0] == "misaddressed"
    assert b"relayed" in reply[2] and reply[1] == b""
    # Claiming to be addressed here while signed for elsewhere breaks the MAC instead.
    body = msgspec.msgpack.decode(relayed[side_channel.HEADER_BYTES :])
    body[0] = _to(server)
    reply = exchange(server.port, side_channel._frame(1, msgspec.msgpack.encode(body)))
    assert reply is not None and reply[0] == "unauthenticated"
    assert server.asked == []
    with pytest.raises(SideChannelRefused, match="misaddressed"):
        ask("127.0.0.1", server.port, b"hello", 3.0, SECRET, "another-engine")


def test_replayed_and_stale_requests_are_refused(server):
    def signed(sent: float, nonce: bytes) -> bytes:
        stamp = struct.pack(">Q", int(sent * 1000))
        where = _to(server).encode()
        mac = hmac.new(
            SECRET,
            side_channel_wire._REQUEST_DOMAIN + nonce + stamp + where + b"\0" + b"claim",
            hashlib.sha256,
        ).digest()
        body = msgspec.msgpack.encode([_to(server), nonce + stamp + mac, b"claim"])
        return side_channel._frame(1, body)

    nonce = os.urandom(16)
    assert exchange(server.port, signed(time.time(), nonce))[2] == b"answer to claim"
    again = exchange(server.port, signed(time.time(), nonce))
    assert again[0] == "replayed"
    old = exchange(server.port, signed(time.time() - 3600, os.urandom(16)))
    assert old[0] == "stale" and b"s old" in old[2]
    assert server.asked == [b"claim"]
    assert server.refused == {"replayed": 1, "stale": 1}


def test_a_forged_or_misrouted_reply_is_not_accepted():
    """A reply without the right MAC (a peer without the secret, a forger, or the answer to
    another request) is an error on the asking side, never an answer."""
    plain = SideChannelServer("127.0.0.1", 0, lambda payload: b"answer", None, ENGINE)
    try:
        with pytest.raises(SideChannelRefused, match="has no side_channel_secret"):
            ask("127.0.0.1", plain.port, b"hello", 3.0, SECRET, ENGINE)
    finally:
        plain.close()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def forge() -> None:
        conn, _ = listener.accept()
        with conn:
            read_frame(conn)
            conn.sendall(encode_reply("ok", b"forged answer", b"\x01" * 32))

    thread = threading.Thread(target=forge)
    thread.start()
    try:
        with pytest.raises(SideChannelError, match="is not authenticated"):
            ask("127.0.0.1", port, b"hello", 3.0, SECRET, ENGINE)
    finally:
        thread.join()
        listener.close()


def test_oversize_requests_are_refused_unread_and_the_server_lives_on(server):
    with pytest.raises(SideChannelRefused, match="exceeds 65536 B"):
        ask("127.0.0.1", server.port, b"x" * ((1 << 16) + 1), 3.0, SECRET, ENGINE)
    # A header announcing 500 MiB: refused at once, nothing read, the connection closed.
    header = request_header(500 << 20)
    reply = exchange(server.port, header + b"x" * 1024)
    assert reply is not None and reply[0] == "oversize"
    assert ask("127.0.0.1", server.port, b"still", 3.0, SECRET, ENGINE) == b"answer to still"
    assert server.refused == {"oversize": 2}


def test_a_request_that_stalls_is_cut_off(server):
    """A client that sends a header and then nothing (slowloris) holds a connection for at
    most ``request_s``; the server answers others meanwhile."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(request_header(1000))
        assert ask("127.0.0.1", server.port, b"other", 3.0, SECRET, ENGINE) == b"answer to other"
        started = time.monotonic()
        assert sock.recv(1) == b""  # closed by the server
        assert time.monotonic() - started < 5
    assert server.refused == {"incomplete": 1}


def test_rate_limits_say_busy_and_refusals_do_not_starve_signed_requests(server):
    """Accepted requests over the per-address rate are refused as ``busy`` (which clients
    retry); a flood of refused ones from the same address spends a budget of its own, so
    the signed requests still get through."""
    answers, busy = 0, 0
    for _ in range(60):
        try:
            ask("127.0.0.1", server.port, b"hi", 3.0, SECRET, ENGINE)
            answers += 1
        except SideChannelRefused as exc:
            assert exc.busy and exc.code == "busy" and "retry" in str(exc)
            busy += 1
    assert answers < 60 and busy == 60 - answers
    time.sleep(0.5)  # the accepted budget refills (50/s)
    for _ in range(300):  # unauthenticated, same address: their own budget runs dry
        try:
            ask("127.0.0.1", server.port, b"flood", 3.0, None, ENGINE)
        except SideChannelRefused as exc:
            assert exc.code == "unauthenticated"
        except SideChannelError:
            pass  # refusal budget spent: closed without an answer
    assert ask("127.0.0.1", server.port, b"legit", 3.0, SECRET, ENGINE) == b"answer to legit"
    assert server.asked.count(b"legit") == 1


def test_refusals_are_logged_within_a_budget(caplog):
    limits = Limits(log_lines=5, log_window_s=60.0, refused_rate=1e6, refused_burst=1e6)
    made = SideChannelServer("127.0.0.1", 0, lambda payload: b"ok", SECRET, ENGINE, limits)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.kvshare"):
            for _ in range(50):
                with pytest.raises(SideChannelRefused):
                    ask("127.0.0.1", made.port, b"x" * 100, 3.0, None, ENGINE)
    finally:
        made.close()
    lines = [r for r in caplog.records if "side channel" in r.getMessage()]
    assert len(lines) == 5
    assert all(len(r.getMessage()) <= 400 for r in lines)
    assert made.refused == {"unauthenticated": 50}


def test_no_secret_beyond_loopback_refuses_to_start_unless_opted_in():
    side_channel.check_exposure("127.0.0.1", None, insecure=False)
    side_channel.check_exposure("localhost", None, insecure=False)
    with pytest.raises(SideChannelError, match="would listen on 0.0.0.0 without side_channel"):
        side_channel.check_exposure("0.0.0.0", None, insecure=False)
    side_channel.check_exposure("0.0.0.0", SECRET, insecure=False)
    side_channel.check_exposure("0.0.0.0", None, insecure=True)


def test_without_a_secret_it_works_and_warns_once(monkeypatch):
    warnings: list[str] = []
    monkeypatch.setattr(side_channel, "_warned_no_secret", False)
    monkeypatch.setattr(side_channel.logger, "warning", lambda msg, *a: warnings.append(msg))
    side_channel.warn_if_no_secret(None)
    side_channel.warn_if_no_secret(None)
    side_channel.warn_if_no_secret(SECRET)
    assert len(warnings) == 1 and "without a shared secret" in warnings[0]
    plain = SideChannelServer("127.0.0.1", 0, lambda payload: b"answer", None, ENGINE)
    try:
        assert ask("127.0.0.1", plain.port, b"hello", 3.0, None, ENGINE) == b"answer"
    finally:
        plain.close()
