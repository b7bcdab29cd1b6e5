"""Who may hold the side channel's connections, and how fast an address may ask
(``side_channel.SideChannelServer`` asks this module; it knows nothing of sockets).

A connection is *pre-auth* until one of its requests authenticates (with a secret: MAC,
stamp and nonce good; without a secret none ever does). Pre-auth connections are capped per
address and in all, and any of them whose handler is not running can be evicted: a new
connection over a cap resets the pre-auth connection that sat still the longest (of its own
address for the per-address cap; of the address holding the most for the total) instead of
being turned away. So connections held open, or trickled, from a decode's own address or
from many addresses cannot keep a decode out (issue 46: eight idle connections from
decode's address made it wait 9.8 s and give prefill up): the newest connection, a decode's
about to send its request, goes last, and so does one whose request is streaming in (a
connection turned away would start over, and clients over the cap would evict each other
before any finished). Authenticated connections have caps of their own, larger per address
(TP decodes share a host); only another authenticated connection evicts one, the longest
idle first, and never one in the middle of a request.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvshare_connector.transfer.wire.side_channel_wire import MAX_REQUEST_BYTES


@dataclass(frozen=True)
class Limits:
    """What one server spends on its peers, at most."""

    max_request_bytes: int = MAX_REQUEST_BYTES
    connections: int = 128  # not authenticated yet, open at once, all addresses
    per_address_connections: int = 8  # x max_request_bytes: what one client can make us hold
    authenticated_connections: int = 256  # authenticated (a secret's holders), all addresses
    per_address_authenticated: int = 32  # TP decodes on one host, each with its claims pipe
    request_s: float = 5.0  # a started request must arrive whole within this
    idle_s: float = 30.0  # a connection with no request for this long is closed
    rate: float = 2000.0  # accepted requests per second and address, sustained
    burst: float = 4000.0
    refused_rate: float = 100.0  # refused ones per second and address (they cost replies)
    refused_burst: float = 200.0
    log_lines: int = 20  # refusal log lines per ``log_window_s``; the rest are summed up
    log_window_s: float = 10.0
    senders: int = 4096  # signing processes told apart at once (side_channel_replay)


@dataclass(eq=False)
class Connection:
    """One connection as admission sees it; the server keeps ``stage`` and ``deadline``
    current and ends it past its deadline (``end("expired")``)."""

    address: str
    end: Callable[[str], None]  # ends it at once: "evicted" (a reset) or "expired"
    authenticated: bool = False
    # "idle" (between requests: an authenticated one is evicted only then), "request"
    # (arriving), "handler" (running: never evicted), "reply" (leaving)
    stage: str = "idle"
    since: int = 0  # when it last moved on (bytes came, or it went idle): the oldest goes first
    deadline: float = math.inf  # monotonic: ended then unless the stage moved on


class _Pool:
    """Connections under one pair of caps (in all, per address)."""

    def __init__(self, total: int, per_address: int):
        self.total, self.per_address = total, per_address
        self.members: dict[Connection, None] = {}
        self.by_address: Counter[str] = Counter()

    def add(self, conn: Connection) -> None:
        self.members[conn] = None
        self.by_address[conn.address] += 1

    def remove(self, conn: Connection) -> bool:
        if self.members.pop(conn, False) is False:
            return False
        self.by_address[conn.address] -= 1
        if not self.by_address[conn.address]:
            del self.by_address[conn.address]
        return True

    def victim(
        self, conn: Connection, evictable: Callable[[Connection], bool]
    ) -> Connection | None:
        """Who makes room for ``conn``: None if there is room, ``conn`` itself if nobody
        can be evicted."""
        if self.by_address[conn.address] >= self.per_address:
            same = [c for c in self.members if c.address == conn.address and evictable(c)]
            return min(same, key=lambda c: c.since, default=conn)
        if len(self.members) >= self.total:
            # only from an address holding at least 2 more than the newcomer's: the
            # addresses' shares even out, and stop (a newcomer from the most crowded
            # address would only move a slot between equals, again and again)
            count, mine = self.by_address, self.by_address[conn.address]
            others = [c for c in self.members if count[c.address] > mine + 1 and evictable(c)]
            return min(others, key=lambda c: (-count[c.address], c.since), default=conn)
        return None


class Admission:
    """The two pools, pre-auth and authenticated."""

    def __init__(
        self, connections: int, per_address: int, authenticated: int, per_address_authenticated: int
    ):
        self._pre = _Pool(connections, per_address)
        self._auth = _Pool(authenticated, per_address_authenticated)
        self._clock = itertools.count()

    def admit(self, conn: Connection) -> bool:
        """A new connection: in, possibly evicting a pre-auth one; False if every one
        in its way is running a handler (without a secret)."""
        conn.since = next(self._clock)
        if not self._make_room(self._pre, conn, lambda c: c.stage != "handler"):
            return False
        self._pre.add(conn)
        return True

    def authenticate(self, conn: Connection) -> bool:
        """``conn`` authenticated a request: it moves to the authenticated pool, possibly
        evicting the longest idle authenticated one; False if all in its way are at work."""
        if conn.authenticated:
            return True
        if not self._make_room(self._auth, conn, lambda c: c.stage == "idle"):
            return False
        self._pre.remove(conn)
        self._auth.add(conn)
        conn.authenticated = True
        return True

    def rest(self, conn: Connection, deadline: float) -> None:
        """``conn`` waits for its next request, until ``deadline``."""
        conn.stage, conn.deadline = "idle", deadline
        self.moved(conn)

    def moved(self, conn: Connection) -> None:
        """Bytes of ``conn``'s request came: evicted after those that sat still longer."""
        conn.since = next(self._clock)

    def leave(self, conn: Connection) -> None:
        """``conn`` ended (a second call, after an eviction, does nothing)."""
        if not self._pre.remove(conn):
            self._auth.remove(conn)

    def overdue(self, now: float) -> list[Connection]:
        """Connections past their deadline."""
        return [c for p in (self._pre, self._auth) for c in p.members if c.deadline < now]

    def _make_room(
        self, pool: _Pool, conn: Connection, evictable: Callable[[Connection], bool]
    ) -> bool:
        victim = pool.victim(conn, evictable)
        if victim is conn:
            return False
        if victim is not None:
            pool.remove(victim)
            victim.end("evicted")
        return True


class Buckets:
    """Token buckets per address, oldest forgotten first."""

    def __init__(self, rate: float, burst: float, size: int = 4096):
        self.rate, self.burst, self.size = rate, burst, size
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, address: str) -> bool:
        now = time.monotonic()
        tokens, last = self._buckets.pop(address, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        allowed = tokens >= 1.0
        self._buckets[address] = (tokens - 1.0 if allowed else tokens, now)
        while len(self._buckets) > self.size:
            self._buckets.popitem(last=False)
        return allowed
