"""Decode's prefill peers: handshakes, side-channel asks per peer, eviction and memory.

Each prefill endpoint gets its own worker thread for side-channel asks (handshakes,
releases), so a dead or slow prefill, whose asks each wait out the timeout, delays only its
own requests; claims, on every request's way to its first token, go over the peer's
``Pipe``, which the engine thread drives without a thread hop (``side_channel_client``).

A peer that fails (unreachable, a failed READ) is evicted: its NIXL peer is
removed, its queued asks are cancelled, and for ``retry_s`` requests for it fail at once
with the reason instead of waiting; after that it is handshaken again (a restarted
prefill rejoins). Meanwhile it is handshaken in the background every ``EARLY_TRY_S``, and
the first try that succeeds ends the pause (a link back up, a prefill restarted on its
address), still without a request waiting for it. A peer whose layout does not match is
remembered for ``retry_s`` too, not handshaken again per request.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from kvshare_connector.common.failpoints import failpoint
from kvshare_connector.common.log import get_logger
from kvshare_connector.layout.descriptors import PairedOwner, TransferPlan
from kvshare_connector.layout.matching import EngineIdentity, LayoutMismatch, pair_owners
from kvshare_connector.layout.sharding import is_sliced
from kvshare_connector.layout.topology import KVTopology
from kvshare_connector.transfer.device import lanes
from kvshare_connector.transfer.device.nixl import NixlTransport
from kvshare_connector.transfer.wire import protocol
from kvshare_connector.transfer.wire.kv_params import RemotePrefillParams
from kvshare_connector.transfer.wire.settings import EngineSettings
from kvshare_connector.transfer.wire.side_channel import SideChannelError
from kvshare_connector.transfer.wire.side_channel_client import Pipe, ask_retrying

logger = get_logger(__name__)

RETRY_S = 5.0  # how long a failed or mismatched peer is not asked again
EARLY_TRY_S = 1.0  # meanwhile, a failed peer is handshaken in the background this often
# a handshake reply's bound (a layout and NIXL metadata: kilobytes for any model here)
HANDSHAKE_REPLY_BYTES = 16 << 20
ASKS_PER_PEER = 2  # side-channel asks in flight to one prefill at once
T = TypeVar("T")
Key = tuple[str, int]  # (host, port) of a prefill's side channel
# TP (``transfer.decode.shards``): (key, peer's topology, its layout message, its identity) ->
# the owners to read from it, each side cut to the heads they pair
Pairing = Callable[[Key, KVTopology, protocol.LayoutMsg, EngineIdentity | None], list[PairedOwner]]


class HandshakeError(RuntimeError):
    """The prefill side could not be reached, or answered something unusable."""


class PeerUnavailable(HandshakeError):
    """A prefill that failed recently: its requests fail at once until it is retried."""


class PeerIdentityError(HandshakeError):
    """The endpoint asked is not the engine ``kv_transfer_params`` name, or hands over a
    NIXL agent that is not its own."""


@dataclass
class Peer:
    engine_id: str
    agent: str
    topology: KVTopology
    owners: list[PairedOwner]
    plan: TransferPlan  # the owners' address math, prepared once for every read
    sliced: bool = False  # TP: reads cover part of each block (packed transfer off)
    probe: protocol.ProbeRef | None = None  # prefill's lane probe (``transfer.device.probe``)
    nameplate: protocol.NameplateRef | None = None  # ``transfer.device.nameplate``


@dataclass
class _Link:
    """One prefill endpoint: its ask thread, handshake in flight, peer once known."""

    executor: ThreadPoolExecutor
    handshake: Future[tuple[protocol.HandshakeReply, Pipe]] | None = None
    peer: Peer | None = None
    pipe: Pipe | None = None  # claims, once handshaken
    down_until: float = 0.0
    error: Exception | None = None  # why it is down (a LayoutMismatch is re-raised as is)
    early_try: float = 0.0  # while down: when the next background handshake may start


@dataclass
class _Agent:
    """A loaded NIXL agent: NIXL's name for it, its metadata's hash, who handed it over."""

    agent: str
    digest: bytes
    keys: set[Key]


class Peers:
    """The prefill endpoints this decode reads from."""

    def __init__(
        self,
        topology: KVTopology,
        transport: NixlTransport,
        settings: EngineSettings,
        retry_s: float = RETRY_S,
        pairing: Pairing | None = None,
    ):
        self.settings = settings
        self.engine_id = settings.engine_id
        self.topology = topology
        self.transport = transport
        self.timeout_s = settings.handshake_timeout_s
        self.identity = settings.identity
        self.retry_s = retry_s
        self.pairing = pairing
        self._links: dict[Key, _Link] = {}
        # NIXL agents loaded, each by the hash of its metadata and the endpoints that handed
        # it over: removed only when the last of them goes (a relayed handshake hands over
        # another endpoint's agent; evicting the relay must not unload it)
        self._agents: dict[str, _Agent] = {}
        self._retired: list[ThreadPoolExecutor] = []  # of evicted peers, joined at close
        self._lock = threading.Lock()  # links are made on the engine thread, asked from others
        self._warned_no_identity = False
        self._in_flight: set[Key] = set()  # handshakes seen unfinished this round
        self.on_unload: Callable[[str], None] | None = None  # told each agent unloaded

    def next_round(self) -> None:
        """A new round of reads (``KVSink.advance``). A handshake seen unfinished stays so
        for the rest of a round: finishing halfway through, it would let the reads asked
        after it claim a round before the ones asked earlier, in a message of their own."""
        self._in_flight.clear()

    def _link(self, key: Key) -> _Link:
        with self._lock:
            link = self._links.get(key)
            if link is None:
                pool = ThreadPoolExecutor(ASKS_PER_PEER, thread_name_prefix=f"kvshare-{key[1]}")
                link = self._links[key] = _Link(pool)
            return link

    def submit(self, key: Key, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run a side-channel ask on ``key``'s own thread."""
        return self._link(key).executor.submit(fn, *args)

    def ask(self, key: Key, engine_id: str, message: Any) -> protocol.SideMessage:
        """One request/reply with prefill ``engine_id`` at ``key`` (on the caller's thread),
        decoded. A prefill that answers "busy" is asked again (with backoff, within the
        timeout): it is alive, and a refusal for rate is no reason to drop it."""
        if not self.settings.allows(*key):  # every connection decode opens: releases too
            raise SideChannelError(
                f"prefill at {key[0]}:{key[1]} is not in this decode's allowed_prefills"
            )
        payload = protocol.encode(message)
        raw = ask_retrying(key[0], key[1], payload, self.timeout_s, self.settings.secret,
                           engine_id, HANDSHAKE_REPLY_BYTES)  # fmt: skip
        return protocol.decode(raw)

    def pipe(self, key: Key) -> Pipe | None:
        """The connection claims to the handshaken peer at ``key`` go over."""
        link = self._links.get(key)
        return link.pipe if link is not None and link.peer is not None else None

    def pump(self) -> None:
        """Move the claims' bytes both ways (never waits; on the engine thread)."""
        for link in list(self._links.values()):
            if link.pipe is not None:
                link.pipe.pump()

    def known(self, key: Key, engine_id: str) -> Peer | None:
        """The handshaken peer at ``key`` if it is ``engine_id`` (no side effects)."""
        link = self._links.get(key)
        if link is not None and link.peer is not None and link.peer.engine_id == engine_id:
            return link.peer
        return None

    def get(self, host: str, port: int, expect: str) -> Peer | None:
        """The peer if its handshake finished (raises why not), else None (in flight)."""
        key = (host, port)
        if not self.settings.allows(host, port):
            raise HandshakeError(
                f"prefill {expect} at {host}:{port} is not in this decode's allowed_prefills "
                f"({sorted(self.settings.allowed_prefills or ())[:5]})"
            )
        link = self._link(key)
        if link.peer is not None and link.peer.engine_id == expect:
            return link.peer
        now = time.monotonic()
        if link.error is not None and now < link.down_until:
            if isinstance(link.error, LayoutMismatch):
                raise link.error
            peer = self._try_early(key, link, expect, now)
            if peer is not None:
                return peer
            raise PeerUnavailable(
                f"prefill {expect} at {host}:{port} failed {link.down_until - now:.1f} s "
                f"before its next try: {link.error}"
            )
        if link.handshake is None:
            link.handshake = link.executor.submit(self._handshake, host, port, expect)
            self._in_flight.add(key)
            return None
        if not link.handshake.done() or key in self._in_flight:
            self._in_flight.add(key)
            return None
        future, link.handshake = link.handshake, None
        try:
            reply, pipe = future.result()
            peer = self._connect(key, reply)
        except (HandshakeError, LayoutMismatch) as exc:
            self._mark_down(key, link, exc)
            raise
        if link.pipe is not None:
            link.pipe.close()
        link.peer, link.pipe, link.error = peer, pipe, None
        return peer

    def _try_early(self, key: Key, link: _Link, expect: str, now: float) -> Peer | None:
        """While ``link`` is down: the peer, if a background handshake made since came
        back good (the pause ends); else start one when due. Never waits."""
        if link.handshake is None:
            if now >= link.early_try:
                link.early_try = now + EARLY_TRY_S
                link.handshake = link.executor.submit(self._handshake, key[0], key[1], expect)
            return None
        if not link.handshake.done():
            return None
        future, link.handshake = link.handshake, None
        try:
            reply, pipe = future.result()
            peer = self._connect(key, reply)
        except Exception as exc:  # a background try: nothing escapes it
            link.error = exc  # still down, until ``down_until`` or a try that succeeds
            return None
        logger.info("prefill at %s:%d answers again: its pause ended early", *key)
        link.peer, link.pipe, link.error, link.down_until = peer, pipe, None, 0.0
        return peer

    def _connect(self, key: Key, reply: protocol.HandshakeReply) -> Peer:
        host, port = key
        try:
            remote = protocol.layout_from_msg(reply.layout)
        except protocol.ProtocolError as exc:
            raise HandshakeError(
                f"prefill at {host}:{port} sent an unusable layout: {exc}"
            ) from exc
        remote_identity = protocol.identity_from_msg(reply.layout)
        if remote_identity is None and self.identity is not None and not self._warned_no_identity:
            self._warned_no_identity = True
            logger.warning(
                "prefill at %s:%d does not say which model it runs: only its KV layout is checked",
                host,
                port,
            )
        theirs = reply.probe.ucx if reply.probe is not None else {}
        problem = lanes.segment_problem(theirs, lanes.effective())
        if problem is not None:  # before any READ: UCX would crash this process
            raise HandshakeError(f"prefill at {host}:{port}: {problem}")
        if self.pairing is not None:
            owners = self.pairing(key, remote, reply.layout, remote_identity)
        else:
            owners = pair_owners(self.topology, remote, self.identity, remote_identity)
        old = self._links[key].peer
        if old is not None:
            self._unload(old.agent, key)
        agent = self._load(key, reply)
        peer = Peer(reply.engine_id, agent, remote, owners, TransferPlan(owners))
        peer.sliced = is_sliced(self.topology, owners)
        peer.probe = reply.probe
        peer.nameplate = reply.nameplate
        logger.info(
            "handshake with %s at %s:%d: %d owners, %d sharers, layout %s -> %s",
            peer.engine_id,
            host,
            port,
            len(remote.owners),
            len(remote.sharers),
            remote.layout,
            self.topology.layout,
        )
        return peer

    def _load(self, key: Key, reply: protocol.HandshakeReply) -> str:
        """The NIXL agent ``reply`` hands over, loaded once for every endpoint handing over
        the same metadata; another metadata under a loaded agent's name is refused."""
        digest = hashlib.sha256(reply.agent_metadata).digest()
        known = self._agents.get(reply.agent_name)
        if known is not None:
            if known.digest != digest:
                holders = ", ".join(f"{h}:{p}" for h, p in sorted(known.keys))
                raise PeerIdentityError(
                    f"prefill at {key[0]}:{key[1]} handed over NIXL agent {reply.agent_name} "
                    f"with other metadata than {holders} did: refused"
                )
            known.keys.add(key)
            return known.agent
        agent = self.transport.add_peer(reply.agent_metadata)
        loaded = agent.decode(errors="replace") if isinstance(agent, bytes) else agent
        if loaded != reply.agent_name:
            self.transport.remove_peer(agent)
            raise PeerIdentityError(
                f"prefill at {key[0]}:{key[1]} named its agent {reply.agent_name}, its "
                f"metadata is of agent {loaded}"
            )
        self._agents[reply.agent_name] = _Agent(agent, digest, {key})
        return agent

    def _unload(self, agent: str, key: Key) -> None:
        """``key`` no longer uses ``agent``: unload it once no endpoint does."""
        name = agent.decode(errors="replace") if isinstance(agent, bytes) else agent
        known = self._agents.get(name)
        if known is None:
            return
        known.keys.discard(key)
        if not known.keys:
            del self._agents[name]
            self.transport.remove_peer(agent)
            if self.on_unload is not None:
                self.on_unload(agent)

    def _handshake(self, host: str, port: int, expect: str) -> tuple[protocol.HandshakeReply, Pipe]:
        """The peer's handshake and the pipe for its claims (made here: resolving its
        address may block)."""
        reply = self._fetch(host, port, expect)
        try:
            pipe = Pipe(host, port, expect, self.timeout_s, self.settings.secret)
        except OSError as exc:
            raise HandshakeError(f"cannot resolve prefill at {host}:{port}: {exc}") from exc
        return reply, pipe

    def _fetch(self, host: str, port: int, expect: str) -> protocol.HandshakeReply:
        hello = protocol.Hello(protocol.PROTOCOL_VERSION, self.engine_id, expect)
        failpoint("peers.handshake")
        try:
            reply = self.ask((host, port), expect, hello)
        except SideChannelError as exc:
            raise HandshakeError(str(exc)) from exc
        except protocol.ProtocolError as exc:
            raise HandshakeError(f"prefill at {host}:{port} answered garbage: {exc}") from exc
        if isinstance(reply, protocol.ErrorReply):
            raise HandshakeError(f"prefill at {host}:{port} refused the handshake: {reply.message}")
        if not isinstance(reply, protocol.HandshakeReply):
            raise HandshakeError(f"prefill at {host}:{port} answered a {type(reply).__name__}")
        if reply.engine_id != expect:
            raise PeerIdentityError(
                f"prefill at {host}:{port} is engine {reply.engine_id[:100]!r}, "
                f"kv_transfer_params name {expect[:100]!r}: refused"
            )
        if reply.protocol_version != protocol.PROTOCOL_VERSION:
            raise HandshakeError(
                f"prefill at {host}:{port} speaks protocol {reply.protocol_version}, this "
                f"engine {protocol.PROTOCOL_VERSION}"
            )
        return reply

    def release(self, key: Key, params: RemotePrefillParams, token: str, reason: str) -> None:
        """Ask prefill at ``key`` to free a request decode gives up on before reading it
        (on the caller's thread: ``submit`` it). Best effort: its lease frees it anyway."""
        rid = params.remote_request_id
        release = protocol.Release(protocol.PROTOCOL_VERSION, self.engine_id, [rid],
                                   reason[: protocol.MAX_REASON_CHARS], token)  # fmt: skip
        try:
            reply = self.ask(key, params.remote_engine_id, release)
        except (SideChannelError, protocol.ProtocolError) as exc:
            why = str(exc)
        else:
            if isinstance(reply, protocol.ClaimReply) and rid in reply.gone:
                return
            refused = reply.refused if isinstance(reply, protocol.ClaimReply) else {}
            why = refused.get(rid) or repr(reply)
        logger.warning(
            "could not ask prefill %s to free request %s: %s", params.remote_engine_id, rid, why
        )

    def evict(self, host: str, port: int, error: Exception) -> None:
        """``key`` failed: drop its NIXL peer and queued asks; ask again after ``retry_s``."""
        key = (host, port)
        link = self._links.get(key)
        if link is None or (link.error is not None and time.monotonic() < link.down_until):
            return
        logger.warning("prefill at %s:%d evicted for %.0f s: %s", host, port, self.retry_s, error)
        self._mark_down(key, link, error)

    def forget(self, host: str, port: int) -> None:
        """NIXL no longer knows ``host:port``'s agent: handshake again at its next read,
        without the eviction's pause (the peer may be fine)."""
        link = self._links.get((host, port))
        if link is None or link.peer is None:
            return
        logger.warning("prefill at %s:%d: its NIXL agent is gone; handshaking again", host, port)
        self._unload(link.peer.agent, (host, port))
        link.peer = None
        if link.pipe is not None:
            link.pipe.close()
            link.pipe = None

    def _mark_down(self, key: Key, link: _Link, error: Exception) -> None:
        if link.peer is not None:
            self._unload(link.peer.agent, key)
            link.peer = None
        if link.pipe is not None:
            link.pipe.close()  # its claims are cancelled
            link.pipe = None
        link.error, link.down_until = error, time.monotonic() + self.retry_s
        link.early_try = time.monotonic() + EARLY_TRY_S
        if not isinstance(error, LayoutMismatch):  # it answers: its queue may go on
            # Asks queued behind a dead peer's timeouts fail now (their futures are
            # cancelled); a fresh thread serves the peer once it is tried again.
            link.executor.shutdown(wait=False, cancel_futures=True)
            # the last few only: an older one's asks ended long ago (each is bounded)
            self._retired = [*self._retired[-15:], link.executor]
            link.executor = ThreadPoolExecutor(
                ASKS_PER_PEER, thread_name_prefix=f"kvshare-{key[1]}"
            )
            link.handshake = None

    def close(self) -> None:
        """Cancel queued asks, then wait for the running ones (each bounded by the
        side-channel timeout): their threads are gone when this returns."""
        for link in self._links.values():
            link.executor.shutdown(wait=False, cancel_futures=True)
            if link.pipe is not None:
                link.pipe.close()
        for executor in [*self._retired, *(link.executor for link in self._links.values())]:
            executor.shutdown(wait=True)
