"""The claims' pipe (``side_channel_client.Pipe``) against a real side-channel server: a
persistent connection the engine thread drives without ever waiting, whose failures end
its requests with the reason."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvshare_connector.toolkit.procs import pick_free_port
from kvshare_connector.transfer.wire.side_channel import (
    Limits,
    SideChannelError,
    SideChannelRefused,
    SideChannelReset,
    SideChannelServer,
    encode_reply,
)
from kvshare_connector.transfer.wire.side_channel_client import Pipe, retryable

SECRET = b"the deployment's secret"
ENGINE = "prefill-pipe"


def _server(handler, limits: Limits | None = None, secret: bytes | None = SECRET):
    return SideChannelServer("127.0.0.1", 0, handler, secret, ENGINE, limits)


def _settle(pipe: Pipe, futures, timeout_s: float = 10.0) -> None:
    """Pump as an engine's steps do until every future is settled."""
    deadline = time.monotonic() + timeout_s
    while not all(f.done() for f in futures):
        assert time.monotonic() < deadline, "the pipe never settled its requests"
        pipe.pump()
        time.sleep(0.002)


@pytest.fixture
def echo():
    threads: list[str] = []

    def handler(payload: bytes):
        threads.append(threading.current_thread().name)
        if payload.startswith(b"slow"):  # waits: the server runs it off its loop

            def later() -> bytes:
                threads.append(threading.current_thread().name)
                time.sleep(0.3)
                return b"late " + payload

            return later
        return b"re: " + payload

    server = _server(handler)
    server.threads = threads
    yield server
    server.close()


def test_requests_on_one_connection_are_answered_in_order(echo):
    pipe = Pipe("127.0.0.1", echo.port, ENGINE, 5.0, SECRET)
    futures = [pipe.send(b"claim %d" % i) for i in range(20)]
    _settle(pipe, futures)
    assert [f.result() for f in futures] == [b"re: claim %d" % i for i in range(20)]
    sock = pipe._sock
    more = pipe.send(b"again")
    _settle(pipe, [more])
    assert more.result() == b"re: again" and pipe._sock is sock  # the same connection
    # answered on the server's loop thread: no hop to a helper thread for them
    assert set(echo.threads) == {"kvshare-side-channel"}
    pipe.close()


def test_the_caller_never_waits_for_a_reply(echo):
    """A request whose answer takes 0.3 s leaves ``send`` and ``pump`` pending at once; the
    reply behind it on the connection waits for it (the server answers in order)."""
    pipe = Pipe("127.0.0.1", echo.port, ENGINE, 5.0, SECRET)
    slow, quick = pipe.send(b"slow one"), pipe.send(b"quick one")
    pipe.pump()
    assert not slow.done() and not quick.done()
    _settle(pipe, [slow, quick])
    assert (slow.result(), quick.result()) == (b"late slow one", b"re: quick one")
    assert any(name.startswith("kvshare-side-channel_") for name in echo.threads)  # its pool
    pipe.close()


def test_a_connection_the_server_closed_idle_is_opened_again(echo):
    idle = _server(lambda p: b"re: " + p, Limits(idle_s=0.2))
    try:
        pipe = Pipe("127.0.0.1", idle.port, ENGINE, 5.0, SECRET)
        first = pipe.send(b"one")
        _settle(pipe, [first])
        time.sleep(0.6)  # the server closes the connection meanwhile
        second = pipe.send(b"two")
        _settle(pipe, [second])
        assert (first.result(), second.result()) == (b"re: one", b"re: two")
        pipe.close()
    finally:
        idle.close()


def test_nobody_listening_fails_the_request_not_retryable():
    pipe = Pipe("127.0.0.1", pick_free_port(), ENGINE, 5.0, SECRET)
    future = pipe.send(b"anyone?")
    _settle(pipe, [future])
    with pytest.raises(SideChannelError, match="no answer from the prefill side channel") as e:
        future.result()
    assert not retryable(e.value)


def test_a_reply_late_past_the_timeout_fails_it_and_those_behind_it(echo):
    pipe = Pipe("127.0.0.1", echo.port, ENGINE, 0.1, SECRET)
    slow, behind = pipe.send(b"slow one"), pipe.send(b"behind it")
    _settle(pipe, [slow, behind])
    for future in (slow, behind):
        with pytest.raises(SideChannelError, match=r"within 0.1 s"):
            future.result()
    assert pipe._sock is None  # closed: a late reply must not answer the next request
    pipe.timeout_s = 5.0  # the next one on a busy CI machine
    after = pipe.send(b"after")
    _settle(pipe, [after])
    assert after.result() == b"re: after"
    pipe.close()


def test_a_busy_refusal_is_retryable_and_the_connection_goes_on():
    server = _server(lambda p: b"ok", Limits(rate=0.001, burst=2.0))
    try:
        pipe = Pipe("127.0.0.1", server.port, ENGINE, 5.0, SECRET)
        futures = [pipe.send(b"x") for _ in range(3)]
        _settle(pipe, futures)
        assert [f.result() for f in futures[:2]] == [b"ok", b"ok"]
        with pytest.raises(SideChannelRefused, match="busy") as e:
            futures[2].result()
        assert retryable(e.value)
        pipe.close()
    finally:
        server.close()


def test_replies_signed_with_another_secret_are_refused(echo):
    pipe = Pipe("127.0.0.1", echo.port, ENGINE, 5.0, b"another secret")
    future = pipe.send(b"hello")
    _settle(pipe, [future])
    with pytest.raises(SideChannelRefused, match="unauthenticated"):
        future.result()
    pipe.close()


def test_a_peer_that_dies_mid_reply_resets_its_requests():
    """A raw server that reads the request, sends half a reply and closes."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def half_reply() -> None:
        conn, _ = listener.accept()
        conn.recv(1 << 16)
        conn.sendall(encode_reply("ok", b"")[:8] + (256).to_bytes(4, "big") + b"partial")
        conn.close()

    thread = threading.Thread(target=half_reply, daemon=True)
    thread.start()
    pipe = Pipe("127.0.0.1", port, ENGINE, 5.0, SECRET)
    future = pipe.send(b"claim")
    _settle(pipe, [future])
    with pytest.raises(SideChannelReset, match="closed by the peer"):
        future.result()
    assert retryable(future.exception())
    thread.join(timeout=5)
    listener.close()


def test_close_cancels_what_is_pending(echo):
    pipe = Pipe("127.0.0.1", echo.port, ENGINE, 5.0, SECRET)
    future = pipe.send(b"slow one")
    pipe.close()
    assert future.cancelled()


def test_claims_over_the_pipe_are_answered_during_a_flood_without_the_secret():
    """``lab.tools.attacks.flood`` (the fault matrix's case e): every flood request is refused,
    and the decode's signed requests over its pipe are all answered meanwhile."""
    from lab.tools.attacks import flood

    server = _server(lambda p: b"re: " + p)
    try:
        pipe = Pipe("127.0.0.1", server.port, ENGINE, 5.0, SECRET)
        first = pipe.send(b"claim")  # connected before the flood, as a decode is
        _settle(pipe, [first])
        codes: dict[str, int] = {}
        flooder = threading.Thread(target=lambda: codes.update(flood(server.port, 1.5)))
        flooder.start()
        answered = [first.result()]
        while flooder.is_alive():
            future = pipe.send(b"claim")
            _settle(pipe, [future])
            answered.append(future.result())
        flooder.join()
        pipe.close()
        assert sum(codes.values()) > 10 and "ok" not in codes, codes
        assert set(codes) <= {"misaddressed", "busy", "overloaded", "closed"}, codes
        assert answered and set(answered) == {b"re: claim"}
        assert server.refused.get("misaddressed", 0) > 0
    finally:
        server.close()
