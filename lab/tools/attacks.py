"""Attacks on prefill's side channel (docs/security.md), aimed at a real prefill
(``lab.tools.attack_target.TargetProcess``, re-exported here).

Each attack is a bounded loop of what a hostile client on the network can send, from a
loopback address of its choice (``source``: 127.0.0.2 and up are as good as 127.0.0.1 on
Linux, and each has budgets of its own at the server); ``tests/test_side_channel_attacks.py``
asserts what must hold after each, ``lab/benchmarks/bench_side_channel.py`` runs each for a
while and measures what a legitimate decode sees meanwhile.
"""

from __future__ import annotations

import collections
import contextlib
import json
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from kvshare_connector.transfer.wire import protocol, side_channel, side_channel_client
from kvshare_connector.transfer.wire.side_channel_replay import WINDOW
from lab.tools.attack_target import (
    READY,
    STATS,
    TOKENS,
    TargetProcess,
    Watch,
    _hold_gil,
)

__all__ = ["READY", "STATS", "TOKENS", "TargetProcess", "Watch", "_hold_gil"]  # and below

DECODE = "127.0.0.1"  # where the legitimate decode asks from
# A map whose first value nests 1,000 deep before the tag: msgspec skips it looking for the
# tag, recursing (issue 46: RecursionError, a traceback per message, 12 MB of log in 10 s)
NESTED = b"\x82\xa1x" + b"\x91" * 1000 + b"\x01" + b"\xa4type\xa5hello"
_LINGER_0 = struct.pack("ii", 1, 0)


# ---- what a client sends --------------------------------------------------------------------


def connect(port: int, source: str = DECODE, timeout_s: float = 5.0) -> socket.socket:
    """A connection to the side channel on 127.0.0.1:``port`` from address ``source``."""
    sock = socket.create_connection(("127.0.0.1", port), timeout_s, (source, 0))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as decode's clients
    return sock


def exchange(
    port: int, data: bytes, timeout_s: float = 5.0, source: str = DECODE
) -> tuple[str, bytes, bytes] | None:
    """Send raw bytes to a side channel on 127.0.0.1; its reply as ``(code, mac, payload)``,
    or None if it closed without one."""
    with connect(port, source, timeout_s) as sock:
        with contextlib.suppress(OSError):  # refused unread: the server stops reading
            sock.sendall(data)
        try:
            return _decode(read_frame(sock))
        except (TimeoutError, ConnectionError, OSError):
            return None


def read_frame(sock: socket.socket) -> bytes:
    """The body of the next framed message on ``sock`` (``ConnectionError`` if it ends)."""
    header = _recv(sock, side_channel.HEADER_BYTES)
    return _recv(sock, int.from_bytes(header[-4:], "big"))


def _recv(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return bytes(data)


def _frames(sock: socket.socket, count: int) -> list[str]:
    """The codes of the next ``count`` replies on ``sock``, read in large chunks."""
    codes: list[str] = []
    buffer = bytearray()
    at = 0
    while len(codes) < count:
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("closed")
        buffer += chunk
        while len(buffer) - at >= side_channel.HEADER_BYTES:
            end = at + side_channel.HEADER_BYTES + int.from_bytes(buffer[at + 8 : at + 12], "big")
            if len(buffer) < end:
                break
            codes.append(_decode(bytes(buffer[at + side_channel.HEADER_BYTES : end]))[0])
            at = end
    return codes


def _decode(body: bytes) -> tuple[str, bytes, bytes]:
    import msgspec

    code, mac, payload = msgspec.msgpack.decode(body)
    return code, mac, payload


def signed(target: TargetProcess, message: Any, secret: bytes | None = None) -> bytes:
    """A framed request to ``target`` (signed with ``secret``, default the target's)."""
    payload = message if isinstance(message, bytes) else protocol.encode(message)
    return side_channel.encode_request(payload, target.where, secret or target.secret)[0]


def legit_round(target: TargetProcess, timeout_s: float = 5.0) -> float:
    """What a decode does first: a signed handshake and a claim; seconds it took."""
    started = time.perf_counter()
    hello = protocol.Hello(protocol.PROTOCOL_VERSION, "legit", target.engine_id)
    for message in (hello, _claim(target, "not-held-yet", [[1]], "legit-token")):
        reply = protocol.decode(
            side_channel_client.ask_retrying(  # as decode asks: "busy" is asked again
                "127.0.0.1", target.port, protocol.encode(message), timeout_s, target.secret,
                target.engine_id,
            )
        )  # fmt: skip
        if isinstance(reply, protocol.ErrorReply):
            raise RuntimeError(reply.message)
    return time.perf_counter() - started


def _claim(target: TargetProcess, request_id: str, ids: list[list[int]], token: str) -> Any:
    return protocol.Claim(
        protocol.PROTOCOL_VERSION, "attacker", [request_id], 30.0, token=token,
        block_ids={request_id: [protocol.pack_ids(g) for g in ids]},
    )  # fmt: skip


def _release(ids: list[str], reason: str, token: str = "") -> Any:
    return protocol.Release(protocol.PROTOCOL_VERSION, "attacker", ids, reason, token)


def request_header(length: int) -> bytes:
    """A request's header announcing a body of ``length`` bytes."""
    return side_channel.encode_request(b"", "")[0][:8] + length.to_bytes(4, "big")


def attack_oversize(target: TargetProcess, rounds: int, source: str = DECODE) -> list[str | None]:
    """Headers announcing 510 MiB (the old 34 frames x 15 MiB), then a little of the body."""
    data = request_header(510 << 20) + b"x" * (1 << 16)
    return [_code(exchange(target.port, data, source=source)) for _ in range(rounds)]


def attack_big_bodies(
    target: TargetProcess, rounds: int, connections: int = 16, source: str = DECODE
) -> list[str]:
    """Bodies just under the size cap, unauthenticated, from many connections at once."""
    body = b"\x00" * (side_channel.MAX_REQUEST_BYTES - 64)
    frame = side_channel.encode_request(body, target.where, None)[0]
    return _flood(target.port, frame, rounds, connections, source)


def attack_claim_flood(target: TargetProcess, rounds: int, source: str = DECODE) -> list[str]:
    """Unsigned claims naming 100k block ids of made-up requests, as fast as answered."""
    ids = [list(range(1, 100_001))]
    frame = signed(target, _claim(target, "x" * 500, ids, "t" * 32), b"not the secret")
    return [_code(exchange(target.port, frame, source=source)) or "closed" for _ in range(rounds)]


def attack_heavy_claims(target: TargetProcess, rounds: int, source: str = DECODE) -> list[str]:
    """Claims of a held request naming 2**17 block ids it does not hold, signed (an insider,
    or anyone without a secret): each refused by a vectorised compare under the lock that
    prefill's ``poll()`` takes."""
    request_id = sorted(target.requests)[0]
    groups = len(target.requests[request_id])  # its groups, the first naming the bulk
    bulk = protocol.MAX_BLOCK_IDS_PER_MESSAGE - (groups - 1)
    ids = [list(range(1, bulk + 1))] + [[bulk + g] for g in range(1, groups)]
    claim = _claim(target, request_id, ids, "h" * 32)
    payload = protocol.encode(claim)
    return [  # each signed anew: a signed frame sent twice is a replay
        _ok_error(exchange(target.port, signed(target, payload), source=source))
        for _ in range(rounds)
    ]


def attack_release_flood(target: TargetProcess, rounds: int) -> list[str]:
    """Signed releases of 256 made-up request ids each (pre-releasing guessed ids)."""
    codes = []
    for r in range(rounds):
        ids = [f"guess-{r}-{i}" for i in range(protocol.MAX_IDS_PER_MESSAGE)]
        frame = signed(target, _release(ids, "bye"))
        codes.append(_code(_when_admitted(target.port, frame)) or "closed")
    return codes


def attack_long_reason(target: TargetProcess, rounds: int) -> list[str]:
    """Signed releases of 256 ids with a 256 KiB reason (a log flood, if it were logged)."""
    ids = [f"r-{i}" for i in range(protocol.MAX_IDS_PER_MESSAGE)]
    release = _release(ids, "x" * (256 << 10))
    return [_ok_error(_when_admitted(target.port, signed(target, release))) for _ in range(rounds)]


def attack_hello_flood(
    target: TargetProcess, rounds: int, connections: int = 4, source: str = DECODE
) -> list[str]:
    """Unsigned handshakes (by default from the decode's own address)."""
    frame = signed(target, protocol.Hello(protocol.PROTOCOL_VERSION, "x"), b"wrong")
    return _flood(target.port, frame, rounds, connections, source)


def flood(port: int, seconds: float, connections: int = 4) -> collections.Counter[str]:
    """What a client without the secret can send a live prefill on 127.0.0.1:``port`` for
    ``seconds``: handshakes and 100k-id claims signed with a wrong secret, from
    ``connections`` threads as fast as answered; the answers' codes (``closed``: none)."""
    hello = protocol.Hello(protocol.PROTOCOL_VERSION, "flood")
    claim = protocol.Claim(
        protocol.PROTOCOL_VERSION, "flood", ["x" * 64], 30.0, token="t" * 32,
        block_ids={"x" * 64: [protocol.pack_ids(range(1, 100_001))]},
    )  # fmt: skip
    where = side_channel.destination("", "127.0.0.1", port)
    frames = [
        side_channel.encode_request(protocol.encode(m), where, b"not the secret")[0]
        for m in (hello, claim)
    ]
    codes: collections.Counter[str] = collections.Counter()
    end = time.monotonic() + seconds

    def one(offset: int) -> None:
        i = offset
        while time.monotonic() < end:
            try:
                code = _code(exchange(port, frames[i % 2], timeout_s=2.0)) or "closed"
            except OSError as exc:
                code = type(exc).__name__
            codes[code] += 1
            i += 1

    workers = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(connections)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(seconds + 10)
    return codes


def attack_odd_messages(target: TargetProcess, name: str) -> list[str]:
    """Signed but wrong: deep nesting, another protocol version, a reply type, a claim with
    no block ids and one with a subset of held request ``name``'s."""
    ids = target.requests[name]
    messages: list[Any] = [
        b"\x91" * 1000 + b"\x01",
        protocol.Hello(99, "x"),
        protocol.ErrorReply("hi"),
        protocol.Claim(protocol.PROTOCOL_VERSION, "attacker", [name], 30.0, token="t" * 32),
        _claim(target, name, [g[:1] for g in ids], "t" * 32),
    ]
    return [_ok_error(_when_admitted(target.port, signed(target, m))) for m in messages]


def _when_admitted(
    port: int, data: bytes, tries: int = 100, source: str = DECODE
) -> tuple[str, bytes, bytes] | None:
    """``exchange``, again while the server turns the connection away (an earlier attack's
    connections still count against this address); such a request was never read."""
    for _ in range(tries):
        reply = exchange(port, data, source=source)
        if reply is not None and reply[0] != "overloaded":
            return reply
        time.sleep(0.05)
    return reply


def _code(reply: tuple[str, bytes, bytes] | None) -> str | None:
    return None if reply is None else reply[0]


def _ok_error(reply: tuple[str, bytes, bytes] | None) -> str:
    """``error: <text>`` for an answered protocol refusal, else the transport's code."""
    if reply is None:
        return "closed"
    code, _mac, payload = reply
    if code != "ok":
        return code
    answer = protocol.decode(payload)
    if isinstance(answer, protocol.ErrorReply):
        return "error: " + answer.message
    if isinstance(answer, protocol.ClaimReply) and answer.refused:
        return "refused: " + next(iter(answer.refused.values()))
    return "ok"


def _flood(
    port: int, frame: bytes, rounds: int, connections: int, source: str = DECODE
) -> list[str]:
    """``frame`` sent ``rounds`` times from each of ``connections`` threads: the codes."""
    codes: list[str] = []

    def one() -> None:
        for _ in range(rounds):
            codes.append(_code(exchange(port, frame, source=source)) or "closed")

    workers = [threading.Thread(target=one) for _ in range(connections)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return codes


# ---- issue 46: held connections, deep nesting, resets, replays ------------------------------


class HeldConnections:
    """``per_source`` connections from each address of ``sources``, held open without a
    byte sent until ``close``; with ``reopen``, one the server ends (or refuses) is opened
    again at once, so the attacker keeps its count. ``ended`` counts those the server
    ended. ``announce``: each first sends an unsigned request and reads its refusal, so it
    is known to be accepted when the constructor returns (then it is idle, as the others)."""

    def __init__(
        self, port: int, sources: list[str], per_source: int, reopen: bool = True,
        announce: bool = False,
    ):  # fmt: skip
        self.port, self.reopen, self.ended = port, reopen, 0
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._missing: collections.Counter[str] = collections.Counter()
        self.sockets: list[socket.socket] = []
        for source in sources:
            for _ in range(per_source):
                self._open(source, announce)
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _open(self, source: str, announce: bool = False) -> None:
        try:
            sock = connect(self.port, source)
            if announce:
                sock.sendall(side_channel.encode_request(b"held", "", None)[0])
                read_frame(sock)
        except OSError:
            self._missing[source] += 1  # opened again by the watch, with ``reopen``
            return
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ, source)
        self.sockets.append(sock)

    def _watch(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    if sock.recv(1 << 16):
                        continue  # a late reply to the announcement
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                self.ended += 1
                self._selector.unregister(sock)
                self.sockets.remove(sock)
                sock.close()
                self._missing[key.data] += 1
            if self.reopen:
                missing, self._missing = self._missing, collections.Counter()
                for source, count in missing.items():
                    for _ in range(count):
                        if not self._stop.is_set():
                            self._open(source)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in self.sockets:
            sock.close()
        self._selector.close()

    def __enter__(self) -> HeldConnections:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def attack_deep_nesting(target: TargetProcess, rounds: int, source: str = DECODE) -> list[str]:
    """``NESTED``, signed with the target's secret (an insider's; unsigned without one)."""
    return [
        _ok_error(_when_admitted(target.port, signed(target, NESTED), source=source))
        for _ in range(rounds)
    ]


def reset_after_reply(port: int, rounds: int, source: str = DECODE) -> list[str]:
    """A refused request (510 MiB announced) with 256 KiB of its body, ended by a reset the
    moment the refusal arrives: the server, its reading paused, still holds unread bytes
    (issue 46: its ``write_eof()`` then met ENOTCONN, a traceback per connection).
    ``answered`` or ``closed`` per round."""
    data = request_header(510 << 20) + b"x" * (256 << 10)
    ends = []
    for _ in range(rounds):
        with connect(port, source) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_0)
            try:
                sock.sendall(data)
                ends.append("answered" if sock.recv(1) else "closed")
            except OSError:
                ends.append("closed")
    return ends


def replay_after(
    port: int, where: str, secret: bytes, captured: bytes, messages: int, payload: bytes,
    sources: list[str], rate: float = 1900.0,
) -> dict[str, Any]:  # fmt: skip
    """Send the signed request ``captured`` once, then ``messages`` signed requests of
    ``payload`` to ``where`` (pipelined, from each address of ``sources`` at most ``rate``
    per second: under the server's accepted rate), then ``captured`` again: issue 46
    found it accepted again after 2^18 of them. The codes of both sends, the count."""
    first = _code(exchange(port, captured, source=sources[0]))
    codes: collections.Counter[str] = collections.Counter()
    started = time.monotonic()
    in_order = threading.Lock()  # a batch leaves as soon as it is signed: counters in order

    def one(source: str, count: int) -> None:
        sent, batch = 0, max(1, WINDOW // 2 // len(sources))  # arrive within the window
        while sent < count:
            try:
                with connect(port, source, 30.0) as sock:
                    while sent < count:
                        k = min(batch, count - sent)
                        with in_order:
                            sock.sendall(
                                b"".join(
                                    side_channel.encode_request(payload, where, secret)[0]
                                    for _ in range(k)
                                )
                            )
                        codes.update(_frames(sock, k))
                        sent += k
                        ahead = sent / rate - (time.monotonic() - started)
                        if ahead > 0:
                            time.sleep(ahead)
            except OSError:
                codes["closed"] += 1

    share = -(-messages // len(sources))
    workers = [threading.Thread(target=one, args=(s, share)) for s in sources]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    again = _code(exchange(port, captured, source=sources[0]))
    return {"first": first, "replay": again, "signed": sum(codes.values()),
            "codes": dict(codes), "seconds": round(time.monotonic() - started, 1)}  # fmt: skip


def attack_replay(target: TargetProcess, messages: int = (1 << 18) + 4096) -> dict[str, Any]:
    """``replay_after`` on the target: a captured signed Hello, then releases of nothing
    from 8 addresses of 127.0.1.x (as issue 46 sent them: 2^18 in 25.6 s), then the Hello
    again (``replay``: ``ok`` if accepted)."""
    assert target.secret is not None, "a replay needs signed requests: a target with a secret"
    hello = protocol.encode(protocol.Hello(protocol.PROTOCOL_VERSION, "captured"))
    captured = side_channel.encode_request(hello, target.where, target.secret)[0]
    release = protocol.encode(_release([], "bye"))
    sources = [f"127.0.1.{i}" for i in range(1, 9)]
    return replay_after(
        target.port, target.where, target.secret, captured, messages, release, sources
    )


class HeldElsewhere:
    """``HeldConnections`` in a process of its own (``python -m ...attacks hold``): its
    reconnects then compete with the measured client for the CPU, not for its GIL.
    ``close`` returns the child's ``ended`` and sockets held."""

    def __init__(self, port: int, sources: list[str], per_source: int):
        argv = [sys.executable, "-m", __name__, "hold", str(port), str(per_source), *sources]
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        self.process.stdout.readline()  # "holding": all opened once

    def close(self) -> dict[str, int]:
        out, _ = self.process.communicate("", timeout=30)
        return json.loads(out.splitlines()[-1])


def _hold(port: int, per_source: int, sources: list[str]) -> int:
    with HeldConnections(port, sources, per_source) as held:
        print("holding", flush=True)
        sys.stdin.read()  # until the parent closes it
        print(json.dumps({"held": len(held.sockets), "ended by the server": held.ended}))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["hold"]:
        sys.exit(_hold(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]))
    sys.exit(f"usage: python -m {__spec__.name} hold PORT PER_SOURCE SOURCE...")
