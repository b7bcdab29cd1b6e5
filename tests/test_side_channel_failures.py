"""Failures on the side channel stay inside the log budget (issue 46, item 5): a message
nested 1,000 deep is a refusal like any other, not a RecursionError logged with its
traceback; a peer that resets its connection while the server ends it (ENOTCONN from
``write_eof``) costs no traceback; a handler that fails is logged with its traceback once
per budget window, however often it fails. Real servers and sockets on loopback."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import msgspec
import pytest

from kvshare_connector.transfer.wire import protocol
from kvshare_connector.transfer.wire.side_channel import (
    Limits,
    SideChannelRefused,
    SideChannelServer,
)
from kvshare_connector.transfer.wire.side_channel_client import ask
from lab.tools.attacks import NESTED, reset_after_reply

SECRET = b"the deployment's shared secret"
ENGINE = "prefill-failures"


@pytest.fixture
def make_server() -> Iterator:
    made: list[SideChannelServer] = []

    def make(handler, limits: Limits | None = None) -> SideChannelServer:
        made.append(SideChannelServer("127.0.0.1", 0, handler, SECRET, ENGINE, limits))
        return made[-1]

    yield make
    for server in made:
        server.close()


def _tracebacks(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """Records that carry a traceback, attached or in their text."""
    return [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


def test_a_message_nested_1000_deep_is_a_protocol_error():
    """The tag of a map comes after a value nested 1,000 deep: msgspec recurses skipping it
    (the control: the side-channel decoder itself raises RecursionError on it)."""
    assert len(NESTED) == 1015
    with pytest.raises(RecursionError):
        msgspec.msgpack.Decoder(protocol.SideMessage).decode(NESTED)
    with pytest.raises(protocol.ProtocolError, match="malformed side-channel message"):
        protocol.decode(NESTED)


def test_nested_messages_are_answered_as_refusals_without_tracebacks(make_server, caplog):
    """A handler that decodes what it gets, as prefill's does: each nested message is
    answered with the protocol's error, and nothing is logged with a traceback (the
    control: a message that makes the handler fail is, once)."""

    def handler(payload: bytes) -> bytes:
        try:
            protocol.decode(payload)
        except protocol.ProtocolError as exc:
            return protocol.encode(protocol.ErrorReply(str(exc)[:100]))
        raise AssertionError("a message that decodes: a bug here")

    server = make_server(handler)
    with caplog.at_level(logging.WARNING):
        for _ in range(50):
            reply = protocol.decode(ask("127.0.0.1", server.port, NESTED, 3.0, SECRET, ENGINE))
            assert isinstance(reply, protocol.ErrorReply) and "malformed" in reply.message
        assert _tracebacks(caplog) == []
        hello = protocol.encode(protocol.Hello(protocol.PROTOCOL_VERSION, "x"))
        with pytest.raises(SideChannelRefused, match="failed"):
            ask("127.0.0.1", server.port, hello, 3.0, SECRET, ENGINE)
    assert len(_tracebacks(caplog)) == 1


def test_a_failing_handler_logs_its_traceback_within_a_budget(make_server, caplog):
    """Each failure is answered and counted; its traceback is logged once per window, the
    refusal lines within their own budget: 200 failures, a bounded log."""

    def handler(payload: bytes) -> bytes:
        raise ValueError("a bug in the handler")

    server = make_server(handler, Limits(log_lines=5, refused_rate=1e6, refused_burst=1e6))
    with caplog.at_level(logging.WARNING):
        for _ in range(200):
            with pytest.raises(SideChannelRefused, match="a bug in the handler"):
                ask("127.0.0.1", server.port, b"x", 3.0, SECRET, ENGINE)
    (traced,) = _tracebacks(caplog)
    assert "ValueError: a bug in the handler" in traced.getMessage()
    assert len(caplog.records) <= 1 + 5 and server.refused == {"failed": 200}


def test_resets_while_the_server_ends_a_connection_cost_no_traceback(make_server, caplog):
    """Refused requests whose senders reset the connection the moment the refusal
    arrives, while the server still holds unread bytes of theirs: its ``write_eof()`` meets
    ENOTCONN (an OSError, not a ConnectionError), which escaped the connection's handler
    with a traceback. Every one was refused and answered (the control: the race was run),
    none logged a traceback, and the server still answers."""
    server = make_server(lambda payload: b"ok", Limits(refused_rate=1e6, refused_burst=1e6))
    with caplog.at_level(logging.WARNING):
        ends = reset_after_reply(server.port, 200)
    assert ends.count("answered") >= 100 and server.refused["oversize"] == 200
    assert _tracebacks(caplog) == []
    assert ask("127.0.0.1", server.port, b"x", 3.0, SECRET, ENGINE) == b"ok"
