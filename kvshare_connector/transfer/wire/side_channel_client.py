"""Asking a prefill's side channel (``transfer.wire.side_channel`` is the server and the framing).

Two ways, for two kinds of traffic:

* ``ask`` / ``ask_retrying``: one request on a connection of its own, blocking until the
  reply; for handshakes and releases, run on a helper thread per prefill (``peers``).
* ``Pipe``: one persistent connection per prefill that the engine thread drives without
  blocking, for claims, which sit on every request's path to its first token. With the
  engine thread running Python, every hop of a helper thread (wake up, connect, send,
  receive, hand back) waits up to a GIL switch interval (5 ms); a claim through the helper
  thread took 35 ms against a busy decode on the CPU, and 48-55 ms p50 in GPU serving
  (``lab/benchmarks/bench_claim_latency.py``).
"""

from __future__ import annotations

import errno
import os
import socket
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from kvshare_connector.transfer.wire.side_channel import (
    HEADER_BYTES,
    MAX_REPLY_BYTES,
    SideChannelError,
    SideChannelRefused,
    SideChannelReset,
    destination,
    encode_request,
    open_reply,
    reply_length,
)


class _Closed(ConnectionError):
    """The peer closed the connection before the reply was whole."""


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly ``n`` bytes into one buffer, grown only as they arrive (a peer that
    announces much and sends little costs what it sent)."""
    out = bytearray()
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        chunk = sock.recv(min(n - len(out), 1 << 20))
        if not chunk:
            raise _Closed("connection closed before the whole reply")
        out += chunk
    return bytes(out)


def ask(
    host: str,
    port: int,
    payload: bytes,
    timeout_s: float,
    secret: bytes | None = None,
    engine_id: str = "",
    max_reply_bytes: int = MAX_REPLY_BYTES,
) -> bytes:
    """Send one request to engine ``engine_id`` at ``host:port`` and wait at most
    ``timeout_s`` for its reply (authenticated both ways with ``secret``).
    ``SideChannelRefused`` if it refused, ``SideChannelError`` if it did not answer."""
    request, nonce = encode_request(payload, destination(engine_id, host, port), secret)
    where = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(request)
            header = _recv_exact(sock, HEADER_BYTES, deadline)
            body = _recv_exact(sock, reply_length(header, where, max_reply_bytes), deadline)
    except TimeoutError as exc:
        raise SideChannelError(
            f"no answer from the prefill side channel at {where} within {timeout_s:.3g} s"
        ) from exc
    except OSError as exc:
        raise _unanswered(exc, where) from exc
    return open_reply(body, nonce, secret, where)


def _unanswered(exc: OSError, where: str) -> SideChannelError:
    """Reset, broken or closed unanswered: a server over its connection cap evicts or
    resets (a send after that breaks the pipe), one over an address's refusal budget closes
    without reading; ask again. Refused: nobody listens."""
    why = exc.strerror or str(exc)
    alive = isinstance(
        exc, ConnectionResetError | BrokenPipeError | ConnectionAbortedError | _Closed
    )
    kind = SideChannelReset if alive else SideChannelError
    return kind(f"no answer from the prefill side channel at {where}: {why}")


def retryable(exc: BaseException) -> bool:
    """The peer is alive and worth asking again: it answered ``busy`` or ``overloaded``,
    or reset the connection unanswered."""
    if isinstance(exc, SideChannelRefused):
        return exc.busy
    return isinstance(exc, SideChannelError) and exc.retryable


def ask_retrying(
    host: str,
    port: int,
    payload: bytes,
    timeout_s: float,
    secret: bytes | None = None,
    engine_id: str = "",
    max_reply_bytes: int = MAX_REPLY_BYTES,
) -> bytes:
    """``ask``, asking again (with backoff, within ``timeout_s`` in all) while the peer
    answers ``busy`` or ``overloaded``, or resets the connection unanswered: it is alive,
    and a refusal for rate is no reason to give up on it (or to evict it)."""
    deadline = time.monotonic() + timeout_s
    pause = 0.005
    while True:
        try:
            left = deadline - time.monotonic()
            return ask(host, port, payload, left, secret, engine_id, max_reply_bytes)
        except SideChannelError as exc:
            if not retryable(exc) or time.monotonic() + pause >= deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 0.2)


PUMP_BYTES = 4 << 20  # read by one ``Pipe.pump`` at most: the engine thread's share per call


@dataclass
class _Pending:
    nonce: bytes
    deadline: float
    future: Future[bytes]
    max_reply: int  # the largest answer this request can have: a longer one is refused unread


class Pipe:
    """A persistent connection to one prefill's side channel that never blocks its caller.

    ``send`` queues a signed request and returns the future of its answer; ``pump`` moves
    bytes both ways as far as the socket allows now and settles the futures whose replies
    came in whole (the server answers a connection's requests in order). Nothing here
    waits: the engine thread calls ``pump`` at its step boundaries. A reply that is late
    past ``timeout_s`` fails, and so does every request behind it on the connection,
    which is closed (the next ``send`` opens another); a reset or a closed connection
    fails its requests with ``SideChannelReset`` (``retryable``).

    Whatever the peer sends, one ``pump`` reads at most ``PUMP_BYTES``, and only what
    the oldest request's reply still lacks: its header first, whose length is checked
    against what that request can be answered with (``send``'s ``max_reply``) before any
    of the body is read; a reply longer than that fails the connection unread.
    """

    def __init__(
        self,
        host: str,
        port: int,
        engine_id: str,
        timeout_s: float,
        secret: bytes | None = None,
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ):
        self.where = f"{host}:{port}"
        self._destination = destination(engine_id, host, port)
        self.timeout_s, self._secret, self._max = timeout_s, secret, max_reply_bytes
        # resolved here (the caller may be a helper thread; a name lookup can block)
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        self._family, self._address = info[0], info[4]
        self._sock: socket.socket | None = None
        self._connecting = False
        self._out = bytearray()
        self._in = bytearray()
        self._pending: deque[_Pending] = deque()

    def send(self, payload: bytes, max_reply: int | None = None) -> Future[bytes]:
        """Queue ``payload`` as a signed request; its future gets the answer (or why not),
        which may be at most ``max_reply`` bytes (default: the pipe's bound)."""
        future: Future[bytes] = Future()  # pending until settled (``close`` cancels it)
        self.pump()  # a connection the peer closed meanwhile is seen closed now
        try:
            if self._sock is None:
                self._open()
        except OSError as exc:
            future.set_exception(_unanswered(exc, self.where))
            return future
        frame, nonce = encode_request(payload, self._destination, self._secret)
        self._out += frame
        bound = self._max if max_reply is None else min(max_reply, self._max)
        self._pending.append(_Pending(nonce, time.monotonic() + self.timeout_s, future, bound))
        self.pump()
        return future

    def pump(self) -> None:
        """Write what is queued, read what came in, settle what it answers; never waits."""
        if self._sock is None:
            return
        try:
            if self._connecting and not self._connected():
                self._expire(time.monotonic())
                return
            self._write()
            self._read()
        except SideChannelError as exc:  # garbage where a reply should be, or too long
            self.close(exc)
            return
        except OSError as exc:  # what came in whole before it ended was settled already
            self.close(_unanswered(exc, self.where))
            return
        self._expire(time.monotonic())

    def close(self, error: SideChannelError | None = None) -> None:
        """Close the connection; its requests not answered fail with ``error`` (default:
        cancelled)."""
        if self._sock is not None:
            self._sock.close()
        self._sock, self._connecting = None, False
        self._out.clear()
        self._in.clear()
        pending, self._pending = self._pending, deque()
        for p in pending:
            if error is None:
                p.future.cancel()
            else:
                p.future.set_exception(error)

    # -- the socket ---------------------------------------------------------------------

    def _open(self) -> None:
        sock = socket.socket(self._family, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        code = sock.connect_ex(self._address)
        if code not in (0, errno.EINPROGRESS, errno.EAGAIN):
            sock.close()
            raise OSError(code, os.strerror(code))
        self._sock, self._connecting = sock, code != 0

    def _connected(self) -> bool:
        assert self._sock is not None
        code = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            raise OSError(code, os.strerror(code))
        try:
            self._sock.getpeername()
        except OSError as exc:
            if exc.errno == errno.ENOTCONN:
                return False  # still connecting
            raise
        self._connecting = False
        return True

    def _write(self) -> None:
        assert self._sock is not None
        while self._out:
            try:
                sent = self._sock.send(self._out)
            except BlockingIOError:
                return
            del self._out[:sent]

    def _read(self) -> None:
        """Read what the oldest unanswered reply lacks, settling each as it completes,
        within ``PUMP_BYTES``; with nothing asked, anything the peer sends is an error."""
        assert self._sock is not None
        budget = PUMP_BYTES
        while budget > 0:
            want = self._lacking()
            if want is None:  # answered everything asked: the peer has nothing to say
                if budget == PUMP_BYTES:  # (not looked at past a reply just read)
                    self._idle()
                return
            try:
                chunk = self._sock.recv(min(want, budget, 1 << 20))
            except BlockingIOError:
                return
            if not chunk:
                raise _Closed("connection closed by the peer")
            self._in += chunk
            budget -= len(chunk)
            self._settle()

    def _lacking(self) -> int | None:
        """Bytes the oldest pending reply still lacks (its header's length checked against
        its bound as soon as the header is in); None when nothing is pending."""
        if not self._pending:
            return None
        if len(self._in) < HEADER_BYTES:
            return HEADER_BYTES - len(self._in)
        length = reply_length(
            bytes(self._in[:HEADER_BYTES]), self.where, self._pending[0].max_reply
        )
        return HEADER_BYTES + length - len(self._in)

    def _idle(self) -> None:
        """Nothing is asked: the peer closing is seen now, a byte it sends is an error."""
        assert self._sock is not None
        try:
            chunk = self._sock.recv(1)
        except BlockingIOError:
            return
        if not chunk:
            raise _Closed("connection closed by the peer")
        raise SideChannelError(f"peer at {self.where} sent a reply nobody asked for")

    def _settle(self) -> None:
        """Hand the oldest request its reply once the buffer holds it whole."""
        want = self._lacking()
        if want is None or want > 0:
            return
        p = self._pending.popleft()
        with memoryview(self._in) as view, view[HEADER_BYTES:] as body:  # decoded in place
            try:
                p.future.set_result(open_reply(body, p.nonce, self._secret, self.where))  # type: ignore[arg-type]
            except SideChannelError as exc:
                p.future.set_exception(exc)
        self._in = bytearray()

    def _expire(self, now: float) -> None:
        if self._pending and self._pending[0].deadline <= now:
            self.close(
                SideChannelError(
                    f"no answer from the prefill side channel at {self.where} within "
                    f"{self.timeout_s:.3g} s"
                )
            )
