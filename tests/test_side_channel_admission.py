"""Who holds the side channel's connections (issue 46, item 4): connections that have not
authenticated cannot keep out what an authenticated decode needs. Real servers and sockets
on loopback (127.0.0.2 and up are further source addresses); each held connection is
known to be accepted (it sent one unsigned request and read the refusal) before the decode
asks, and whether it was evicted is read from the socket: a reset, or an answer."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from kvshare_connector.transfer.wire.side_channel import (
    HEADER_BYTES,
    Limits,
    SideChannelServer,
    destination,
    encode_request,
)
from kvshare_connector.transfer.wire.side_channel_client import Pipe, ask
from lab.tools.attacks import connect, exchange, read_frame

SECRET = b"the deployment's shared secret"
ENGINE = "prefill-admission"


@pytest.fixture
def make_server() -> Iterator:
    made: list[SideChannelServer] = []

    def make(limits: Limits, secret: bytes | None = SECRET) -> SideChannelServer:
        made.append(
            SideChannelServer("127.0.0.1", 0, lambda p: b"re: " + p, secret, ENGINE, limits)
        )
        return made[-1]

    yield make
    for server in made:
        server.close()


def _held(server: SideChannelServer, source: str, count: int) -> list[socket.socket]:
    """``count`` connections from ``source``, each accepted (an unsigned request answered)
    and idle since: oldest first."""
    socks = []
    for _ in range(count):
        sock = connect(server.port, source)
        sock.sendall(encode_request(b"held", _to(server), None)[0])
        read_frame(sock)
        socks.append(sock)
    return socks


def _signed(server: SideChannelServer, source: str = "127.0.0.1") -> socket.socket:
    """A connection that authenticated: one signed request answered on it."""
    sock = connect(server.port, source)
    assert _answered(server, sock, SECRET)
    return sock


def _to(server: SideChannelServer) -> str:
    return destination(ENGINE, "127.0.0.1", server.port)


def _answered(server: SideChannelServer, sock: socket.socket, secret: bytes | None) -> bool:
    """Whether ``sock`` is still served: a request on it is answered (False: reset)."""
    try:
        sock.sendall(encode_request(b"again", _to(server), secret)[0])
        read_frame(sock)
        return True
    except ConnectionError:
        return False


def _evicted(sock: socket.socket) -> bool:
    """Whether the server ended ``sock`` (a reset, or its end): nothing was asked on it,
    so anything but that would block until the socket's timeout."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_connections_held_open_from_the_decodes_address_cannot_keep_it_out(make_server):
    """Issue 46: connections held open from decode's address filled its per-address cap,
    and decode was refused ("overloaded") until they closed. Now its request evicts the
    oldest of them and is answered; the newer ones stay open (the control)."""
    server = make_server(Limits(per_address_connections=3))
    oldest, *newer = _held(server, "127.0.0.1", 3)
    assert ask("127.0.0.1", server.port, b"hello", 3.0, SECRET, ENGINE) == b"re: hello"
    assert _evicted(oldest)
    assert all(_answered(server, sock, None) for sock in newer)
    assert server.refused.get("evicted") == 1


def test_connections_from_many_addresses_cannot_fill_the_total_for_a_decode(make_server):
    """Issue 46: 136 connections from 17 addresses filled the cap of all connections. Now a
    decode's connection evicts one of the address holding the most (the oldest of those),
    not one of an address holding few."""
    server = make_server(Limits(connections=8, per_address_connections=3))
    older = _held(server, "127.0.0.5", 1) + _held(server, "127.0.0.2", 2)
    crowded = _held(server, "127.0.0.3", 3)  # the most: its oldest is evicted first
    newer = _held(server, "127.0.0.4", 2)  # 8 in all: full
    assert ask("127.0.0.1", server.port, b"hello", 3.0, SECRET, ENGINE) == b"re: hello"
    assert _evicted(crowded[0])
    assert all(_answered(server, sock, None) for sock in older + crowded[1:] + newer)


def test_an_authenticated_connection_is_not_evicted_by_unauthenticated_ones(make_server):
    """A decode's persistent connection, once a request on it authenticated, is outside
    the unauthenticated connections' caps: held connections from its own address evict each
    other (the control: the oldest of them is reset), never it."""
    server = make_server(Limits(per_address_connections=2))
    decode = _signed(server)
    oldest, *newer = _held(server, "127.0.0.1", 3)
    assert _evicted(oldest)
    assert _answered(server, decode, SECRET)
    assert all(_answered(server, sock, None) for sock in newer)


def test_authenticated_connections_evict_only_each_other_the_longest_idle_first(make_server):
    """Over the authenticated cap of an address (TP decodes on one host), the connection
    that authenticates last evicts the one idle the longest, never one whose request is
    arriving (the control: that one is answered once it is whole)."""
    server = make_server(Limits(per_address_authenticated=3))
    arriving, idle_longest, idle = _signed(server), _signed(server), _signed(server)
    frame = encode_request(b"slow", _to(server), SECRET)[0]
    arriving.sendall(frame[:HEADER_BYTES])  # its request is arriving: not evicted
    # another address's refusal comes after the server read that header
    assert exchange(server.port, b"garbage!" * 2, source="127.0.0.9") is not None
    newest = _signed(server)
    assert _evicted(idle_longest)
    arriving.sendall(frame[HEADER_BYTES:])
    assert read_frame(arriving)  # answered
    assert all(_answered(server, sock, SECRET) for sock in (arriving, idle, newest))


def test_without_a_secret_idle_connections_are_evicted_oldest_first(make_server):
    """Without a secret nothing authenticates: every idle connection can be evicted, a
    decode's persistent one too, whose next request then opens another (a reset is
    asked again). The held connections are answered meanwhile (the server was not
    refusing them)."""
    server = make_server(Limits(per_address_connections=2), secret=None)
    pipe = Pipe("127.0.0.1", server.port, ENGINE, 5.0, None)
    try:
        first = pipe.send(b"claim")
        while not first.done():
            pipe.pump()
        assert first.result() == b"re: claim"
        sock = pipe._sock
        held = _held(server, "127.0.0.1", 2)  # the second evicts the pipe's connection
        again = pipe.send(b"claim again")
        while not again.done():
            pipe.pump()
        assert again.result() == b"re: claim again" and pipe._sock is not sock
        assert _evicted(held[0]) and _answered(server, held[1], None)
    finally:
        pipe.close()
