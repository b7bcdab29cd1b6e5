"""Attacks on prefill's side channel, and a real prefill to aim them at (docs/security.md).

``TargetProcess`` starts a prefill process (``python -m kvshare_connector.devtools.attacks``:
vLLM's real KV memory for a small Gemma-4 shape on the CPU, a real NIXL agent and
``KVSource``, requests held) and reads its RSS, its log size and its own counters
(``stats()``: refusals, the longest ``poll()``, unknown-id state). Each attack is a bounded
loop of what a hostile client on the network can send; ``tests/test_side_channel_attacks.py``
asserts what must hold after each, ``benchmarks/bench_side_channel.py`` runs each for a
while and measures what a legitimate decode sees meanwhile.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvshare_connector.common.child_process import parse_report, report
from kvshare_connector.transfer import protocol, side_channel, side_channel_client

READY = "KVSHARE_TARGET_READY "
STATS = "KVSHARE_TARGET_STATS "
TOKENS = 200


# ---- the target: a prefill process ---------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    """The prefill process: hold ``--requests`` requests, poll, answer ``stats`` on stdin."""
    from kvshare_connector.devtools.demo import build, requests_block_ids
    from kvshare_connector.transfer.nixl import NixlTransport
    from kvshare_connector.transfer.settings import EngineSettings
    from kvshare_connector.transfer.source import KVSource

    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)  # as the nixl backend does
    _stack, topology = build("g4tiny", "per_layer", 16, 2048)
    engine_id = f"target-{os.getpid()}"
    secret = args.secret.encode() if args.secret else None
    settings = EngineSettings(engine_id, lease_s=3600.0, secret=secret)
    source = KVSource(
        topology, NixlTransport(engine_id), settings, inline_answers=not args.pool_answers
    )
    held = requests_block_ids(topology, TOKENS, args.requests, 7)
    for index, ids in enumerate(held):
        source.hold(f"req-{index}", block_ids=ids)
    report(READY, {"engine_id": engine_id, "port": source.port,
                   "requests": {f"req-{i}": ids for i, ids in enumerate(held)}})  # fmt: skip
    asked = threading.Event()
    closed = threading.Event()
    busy_s = [args.busy_ms / 1e3]

    def watch_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "stats":
                asked.set()
            elif line.startswith("busy "):
                busy_s[0] = float(line.split()[1]) / 1e3
        closed.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    worst = worst_cpu = 0.0  # wall (waits for the GIL included) and this thread's own CPU
    while not closed.is_set():
        started, cpu = time.perf_counter(), time.thread_time()
        source.poll()
        worst = max(worst, time.perf_counter() - started)
        worst_cpu = max(worst_cpu, time.thread_time() - cpu)
        if asked.is_set():
            asked.clear()
            by_reason = source.server.refused  # since the last stats: taken just below
            refused = source.take_refused()
            with source._lock:
                early, held_now = len(source._early), len(source._held)
            report(STATS, {"max_poll_ms": worst * 1e3,
                           "max_poll_cpu_ms": worst_cpu * 1e3, **refused,
                           "early": early, "held": held_now,
                           "transport": by_reason})  # fmt: skip
            worst = worst_cpu = 0.0
        if busy_s[0]:
            _hold_gil(busy_s[0])
        else:
            time.sleep(0.005)
    source.close()
    return 0


def _hold_gil(seconds: float) -> None:
    """Run Python for ``seconds`` without a pause, as an engine thread does between its
    steps' waits (an eager forward launches every kernel from Python)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(200))


class TargetProcess:
    """A running prefill target; every wait on it is bounded. ``busy_ms``: its engine
    thread holds the GIL as a busy engine does, polling every ``busy_ms``; ``pool``: it
    answers on the side channel's helper thread (``KVSource(inline_answers=False)``);
    ``switch_interval_ms``: Python's thread switch interval there (0: Python's)."""

    def __init__(
        self,
        secret: str | None,
        requests: int = 8,
        busy_ms: float = 0.0,
        pool: bool = False,
        switch_interval_ms: float = 0.0,
    ):
        argv = [sys.executable, "-m", __name__, "--requests", str(requests)]
        argv += ["--busy-ms", str(busy_ms), "--switch-interval-ms", str(switch_interval_ms)]
        argv += ["--pool-answers"] if pool else []
        env = dict(os.environ, PYTHONUNBUFFERED="1", KVSHARE_NIXL_PROGRESS_THREAD="0")
        if secret:
            argv += ["--secret", secret]
        self.secret = secret.encode() if secret else None
        self._changed = threading.Condition()
        for attempt in (1, 2):
            self._spawn(argv, env)
            try:
                ready = self._next(READY, 300)
                break
            except TimeoutError as exc:
                # A CPU vLLM stack can die at start (once in CI: exit 1 before READY, e.g. a
                # port taken between being picked and bound): start it once more, and say so.
                if attempt == 2 or self.process.poll() is None:
                    raise
                print(f"attack target: started again after: {exc}", file=sys.stderr)
        self.engine_id: str = ready["engine_id"]
        self.port: int = ready["port"]
        self.requests: dict[str, list[list[int]]] = ready["requests"]

    def _spawn(self, argv: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env,
        )  # fmt: skip
        self.log_bytes = 0  # all it logged (stdout and stderr)
        self._tail: collections.deque[str] = collections.deque(maxlen=8)  # said why it ended
        self._lines: list[str] = []
        threading.Thread(target=self._read, args=(self.process.stdout, True), daemon=True).start()
        threading.Thread(target=self._read, args=(self.process.stderr, False), daemon=True).start()

    def _read(self, stream: Any, stdout: bool) -> None:
        """Report lines are kept; everything else is log."""
        for line in stream:
            with self._changed:
                if stdout and line.startswith((READY, STATS)):
                    self._lines.append(line)
                else:
                    self.log_bytes += len(line.encode())
                    self._tail.append(line.rstrip()[:300])
                self._changed.notify_all()

    def _next(self, prefix: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                for i, line in enumerate(self._lines):
                    if line.startswith(prefix):
                        del self._lines[: i + 1]
                        return parse_report(line, prefix)
                left = deadline - time.monotonic()
                if left <= 0 or self.process.poll() is not None:
                    code = self.process.poll()
                    raise TimeoutError(
                        f"target: no {prefix.strip()} line (exit {code}); its last lines: "
                        + " | ".join(self._tail)
                    )
                self._changed.wait(min(left, 0.1))

    @property
    def where(self) -> str:
        return side_channel.destination(self.engine_id, "127.0.0.1", self.port)

    def stats(self) -> dict[str, Any]:
        """Its refusals since the last call (``transport``: by reason, at the framing and
        authentication; ``refused_messages``: those and the protocol's; ``refused_claims``),
        the longest poll() meanwhile, and its unknown-id and held-request counts now."""
        assert self.process.stdin is not None
        self.process.stdin.write("stats\n")
        self.process.stdin.flush()
        return self._next(STATS, 30)

    def busy(self, ms: float) -> None:
        """From now on its engine thread holds the GIL, polling every ``ms`` (0: idle)."""
        assert self.process.stdin is not None
        self.process.stdin.write(f"busy {ms}\n")
        self.process.stdin.flush()

    def rss(self) -> int:
        """Resident bytes of the target process now."""
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@dataclass
class Watch:
    """Samples a process's RSS every 20 ms while an attack runs: the peak over the start."""

    target: TargetProcess
    start: int = 0
    peak: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Watch:
        self.start = self.peak = self.target.rss()

        def sample() -> None:
            while not self._stop.wait(0.02):
                self.peak = max(self.peak, self.target.rss())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.target.rss())

    @property
    def growth(self) -> int:
        return self.peak - self.start


# ---- what a client sends --------------------------------------------------------------------


def exchange(port: int, data: bytes, timeout_s: float = 5.0) -> tuple[str, bytes, bytes] | None:
    """Send raw bytes to a side channel on 127.0.0.1; its reply as ``(code, mac, payload)``,
    or None if it closed without one."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
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
        block_ids={request_id: ids},
    )  # fmt: skip


def _release(ids: list[str], reason: str, token: str = "") -> Any:
    return protocol.Release(protocol.PROTOCOL_VERSION, "attacker", ids, reason, token)


def attack_oversize(target: TargetProcess, rounds: int) -> list[str | None]:
    """Headers announcing 510 MiB (the old 34 frames x 15 MiB), then a little of the body."""
    header = b"KVSC\x01\x01\x00\x00" + (510 << 20).to_bytes(4, "big")
    return [_code(exchange(target.port, header + b"x" * (1 << 16))) for _ in range(rounds)]


def attack_big_bodies(target: TargetProcess, rounds: int, connections: int = 16) -> list[str]:
    """Bodies just under the size cap, unauthenticated, from many connections at once."""
    body = b"\x00" * (side_channel.MAX_REQUEST_BYTES - 64)
    frame = side_channel.encode_request(body, target.where, None)[0]
    return _flood(target.port, frame, rounds, connections)


def attack_claim_flood(target: TargetProcess, rounds: int) -> list[str]:
    """Unsigned claims naming 100k block ids of made-up requests, as fast as answered."""
    ids = [list(range(1, 100_001))]
    frame = signed(target, _claim(target, "x" * 500, ids, "t" * 32), b"not the secret")
    return [_code(exchange(target.port, frame)) or "closed" for _ in range(rounds)]


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


def attack_hello_flood(target: TargetProcess, rounds: int, connections: int = 4) -> list[str]:
    """Unsigned handshakes from this (the decode's own) address."""
    frame = signed(target, protocol.Hello(protocol.PROTOCOL_VERSION, "x"), b"wrong")
    return _flood(target.port, frame, rounds, connections)


def flood(port: int, seconds: float, connections: int = 4) -> collections.Counter[str]:
    """What a client without the secret can send a live prefill on 127.0.0.1:``port`` for
    ``seconds``: handshakes and 100k-id claims signed with a wrong secret, from
    ``connections`` threads as fast as answered; the answers' codes (``closed``: none)."""
    hello = protocol.Hello(protocol.PROTOCOL_VERSION, "flood")
    claim = protocol.Claim(
        protocol.PROTOCOL_VERSION, "flood", ["x" * 64], 30.0, token="t" * 32,
        block_ids={"x" * 64: [list(range(1, 100_001))]},
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
    port: int, data: bytes, tries: int = 100
) -> tuple[str, bytes, bytes] | None:
    """``exchange``, again while the server turns the connection away (an earlier attack's
    connections still count against this address); such a request was never read."""
    for _ in range(tries):
        reply = exchange(port, data)
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


def _flood(port: int, frame: bytes, rounds: int, connections: int) -> list[str]:
    """``frame`` sent ``rounds`` times from each of ``connections`` threads: the codes."""
    codes: list[str] = []

    def one() -> None:
        for _ in range(rounds):
            codes.append(_code(exchange(port, frame)) or "closed")

    workers = [threading.Thread(target=one) for _ in range(connections)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return codes


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a prefill side channel to attack")
    parser.add_argument("--secret", default=None)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--busy-ms", type=float, default=0.0)
    parser.add_argument("--pool-answers", action="store_true")
    parser.add_argument("--switch-interval-ms", type=float, default=0.0)
    sys.exit(_serve(parser.parse_args()))
