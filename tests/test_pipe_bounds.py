"""What a peer's reply can cost decode's engine thread (``side_channel_client.Pipe``): its
header is checked against what the request can be answered with before any of the body is
read, each ``pump`` reads a bounded amount, and nothing past the reply is read.

The peer is a raw socket server here: it answers with a valid header and then streams
bytes for as long as the connection is open, which a real prefill never does. Before
these bounds, a reply announcing 64 MiB followed by endless bytes kept the engine thread
in one ``pump`` for 79-1,229 ms and grew decode by 71-1,141 MiB.
"""

from __future__ import annotations

import socket
import time

import pytest

from kvshare_connector.transfer.wire import side_channel_client
from kvshare_connector.transfer.wire.side_channel import HEADER_BYTES, SideChannelError
from kvshare_connector.transfer.wire.side_channel_client import Pipe
from lab.benchmarks.bench_reply_flood import Flood


@pytest.fixture
def flood():
    made: list[Flood] = []

    def start(length: int) -> Flood:
        made.append(Flood(length))
        return made[-1]

    yield start
    for server in made:
        server.close()


def pump_until_settled(pipe: Pipe, future, pumps: int = 2000) -> list[int]:
    """Pump as the engine's steps do; the bytes buffered after each pump."""
    buffered = []
    for _ in range(pumps):
        pipe.pump()
        buffered.append(len(pipe._in))
        if future.done():
            return buffered
        time.sleep(0.001)
    raise AssertionError("the pipe never settled its request")


def test_a_reply_longer_than_its_request_can_have_is_refused_unread(flood):
    server = flood(64 << 20)
    pipe = Pipe("127.0.0.1", server.port, "prefill", 10.0)
    future = pipe.send(b"claim", max_reply=64 << 10)
    buffered = pump_until_settled(pipe, future)
    with pytest.raises(SideChannelError, match=f"{64 << 20} B"):
        future.result()
    assert max(buffered) <= HEADER_BYTES  # not a byte of the body was read
    assert pipe._sock is None  # closed: the rest of what it sends is never read


def test_a_reply_within_its_bound_is_read_in_bounded_pumps_and_nothing_after_it(flood, monkeypatch):
    monkeypatch.setattr(side_channel_client, "PUMP_BYTES", 256 << 10)
    server = flood(2 << 20)
    pipe = Pipe("127.0.0.1", server.port, "prefill", 10.0)
    future = pipe.send(b"claim", max_reply=4 << 20)
    reads: list[int] = []

    class Counting:  # the pipe's socket, counting what each pump takes off it
        def __init__(self, sock: socket.socket):
            self.sock = sock

        def recv(self, n: int) -> bytes:
            data = self.sock.recv(n)
            reads.append(len(data))
            return data

        def __getattr__(self, name: str):
            return getattr(self.sock, name)

    reads.append(len(pipe._in))  # what ``send``'s own pump took already
    pipe._sock = Counting(pipe._sock)
    per_pump = [reads[0]]
    for _ in range(5000):
        before = len(reads)
        pipe.pump()
        per_pump.append(sum(reads[before:]))
        if future.done():
            break
        time.sleep(0.001)
    assert future.done()
    with pytest.raises(SideChannelError, match="malformed reply"):  # the body is garbage
        future.result()
    assert max(per_pump) <= 256 << 10  # every pump within its budget
    assert sum(reads) == HEADER_BYTES + (2 << 20)  # the reply, and not one byte after it
    pipe.pump()
    assert server.sent > sum(reads)  # the peer went on sending: none of it was read


def test_the_reply_flood_benchmark_measures_a_refused_reply():
    from lab.benchmarks.bench_reply_flood import one_case

    result = one_case(64 << 20, 64 << 10, pumps=500)
    assert result["settled"] and "answered something else" in result["error"]
    assert set(result) >= {"max_pump_ms", "pumps", "rss_growth_mib", "peer_sent_mib"}
