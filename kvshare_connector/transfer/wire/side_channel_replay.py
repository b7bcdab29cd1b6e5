"""Replay protection for signed side-channel requests, bounded by time, not by count.

A request's 16-byte nonce is this process's sender id (8 random bytes) and a counter that
only grows (8 bytes). The server keeps, per sender, the highest counter seen and a bitmap of
the ``WINDOW`` counters below it (as IPsec does: requests leave from several threads and
connections, so they may arrive a little out of order). A counter seen before, or below the
window, is refused. A sender is forgotten only once the newest stamp it sent is older than
the freshness bound, when every request it ever sent is refused as stale anyway; a cache of
recent nonces forgot them by count instead, so a fast enough flow of signed requests let an
old one through again (issue 46).
"""

from __future__ import annotations

import os
import secrets
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

SENDER_BYTES, COUNTER_BYTES = 8, 8
NONCE_BYTES = SENDER_BYTES + COUNTER_BYTES
WINDOW = 4096  # counters below a sender's highest still told apart (512 B a sender)
MAX_SENDERS = 4096  # senders remembered at once (only holders of the secret add one)
_COUNTER = struct.Struct(">Q")


class _NonceSource:
    """This process's sender id and counter; a forked child gets a sender id of its own
    (it would otherwise repeat its parent's counters, which the server refuses)."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._sender = secrets.token_bytes(SENDER_BYTES)
        self._counter = 0

    def next(self) -> bytes:
        with self._lock:
            self._counter += 1
            return self._sender + _COUNTER.pack(self._counter)


next_nonce = _NonceSource().next


@dataclass
class _Sender:
    highest: int  # the highest counter accepted
    seen: int  # bit i: counter ``highest - i`` was accepted
    newest: float  # the newest stamp accepted (wall clock, s)


class ReplayWindows:
    """Per sender, which counters were accepted; ``check`` is called once a request's MAC
    and stamp are good. ``fresh_s``: how old a stamp may be (older ones are refused as
    stale before they get here)."""

    def __init__(self, fresh_s: float, max_senders: int = MAX_SENDERS, window: int = WINDOW):
        self.fresh_s, self.max_senders, self.window = fresh_s, max_senders, window
        self._mask = (1 << window) - 1
        self._senders: OrderedDict[bytes, _Sender] = OrderedDict()  # least recently first
        self._swept = float("-inf")

    def __len__(self) -> int:
        return len(self._senders)

    def check(self, nonce: bytes, sent: float, now: float) -> str | None:
        """Accept ``nonce`` (None) or say why not: ``replayed``, or ``busy`` when the
        table is full of live senders (a new one is refused, no old one forgotten)."""
        sender, counter = nonce[:SENDER_BYTES], _COUNTER.unpack(nonce[SENDER_BYTES:])[0]
        self._forget(now)
        state = self._senders.get(sender)
        if state is None:
            if len(self._senders) >= self.max_senders:
                self._forget(now, everyone=True)
                if len(self._senders) >= self.max_senders:
                    return "busy"
            self._senders[sender] = _Sender(counter, 1, sent)
            return None
        if counter > state.highest:
            shift = counter - state.highest
            state.seen = ((state.seen << shift) | 1) & self._mask if shift < self.window else 1
            state.highest = counter
        else:
            back = state.highest - counter
            if back >= self.window or state.seen >> back & 1:
                return "replayed"
            state.seen |= 1 << back
        state.newest = max(state.newest, sent)
        self._senders.move_to_end(sender)
        return None

    def _forget(self, now: float, everyone: bool = False) -> None:
        """Drop senders whose every request is stale by now: from the least recently
        heard, while they are; all of them (at most once a second) when the table is full."""
        senders = self._senders
        while senders:
            sender, state = next(iter(senders.items()))
            if now - state.newest <= self.fresh_s:
                break
            del senders[sender]
        if everyone and now - self._swept >= 1.0:
            self._swept = now
            for sender in [s for s, state in senders.items() if now - state.newest > self.fresh_s]:
                del senders[sender]
