"""The pull transfer engine: prefill holds blocks and serves its layout, decode reads them.

No vLLM here: the connector's worker drives these two objects; the CPU tests and the demo
drive them the same way across real processes. All NIXL calls happen on the caller's
thread (NIXL agents are not thread-safe by default); only the side-channel ask runs in a
helper thread so a slow or dead prefill never blocks the engine loop.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from kvshare_connector import protocol
from kvshare_connector.descriptors import (
    BlockIds,
    PairedOwner,
    TransferPlan,
    transfer_descriptors,
)
from kvshare_connector.log import get_logger
from kvshare_connector.matching import LayoutMismatch, pair_owners
from kvshare_connector.side_channel import SideChannelError, SideChannelServer, ask
from kvshare_connector.topology import KVTopology
from kvshare_connector.transport.nixl import NixlTransport, TransportError

logger = get_logger(__name__)


RELEASED_MEMORY = 100_000  # freed request ids a prefill remembers, to refuse late claims


class HandshakeError(RuntimeError):
    """The prefill side could not be reached, or answered something unusable."""


@dataclass(frozen=True)
class TransferRecord:
    """One finished read, for stats."""

    request_id: str
    bytes: int
    descriptors: int
    blocks: int
    seconds: float


def align_block_ids(local: BlockIds, remote: BlockIds) -> tuple[list[list[int]], list[list[int]]]:
    """Pair a request's blocks per group, aligned at the tail.

    The decode side may need fewer blocks than prefill holds (a local prefix-cache hit
    leaves only the last blocks to load; sliding-window groups keep only the window), and
    vLLM marks dropped sliding-window blocks with the null block 0 on either side: those
    pairs move nothing.
    """
    if len(local) != len(remote):
        raise protocol.KVTransferParamsError(
            f"remote_block_ids has {len(remote)} group(s), this engine has {len(local)}"
        )
    out_local, out_remote = [], []
    for lids, rids in zip(local, remote, strict=True):
        n = min(len(lids), len(rids))
        pairs = [
            (lb, rb)
            for lb, rb in zip(lids[len(lids) - n :], rids[len(rids) - n :], strict=True)
            if lb != 0 and rb != 0
        ]
        out_local.append([lb for lb, _ in pairs])
        out_remote.append([rb for _, rb in pairs])
    return out_local, out_remote


class KVSource:
    """Prefill side: registers owners, answers handshakes, frees blocks when read or expired."""

    def __init__(
        self,
        engine_id: str,
        topology: KVTopology,
        transport: NixlTransport,
        host: str = "127.0.0.1",
        port: int = 0,
        lease_s: float = 30.0,
    ):
        self.engine_id = engine_id
        self.topology = topology
        self.transport = transport
        self.lease_s = lease_s
        transport.register(topology.regions)
        self._reply = protocol.encode(
            protocol.HandshakeReply(
                protocol_version=protocol.PROTOCOL_VERSION,
                engine_id=engine_id,
                agent_name=transport.name,
                agent_metadata=transport.metadata(),
                layout=protocol.layout_to_msg(topology),
            )
        )
        # The side channel thread (claims) and the engine thread (hold/poll) share these.
        self._lock = threading.Lock()
        self._held: dict[str, float] = {}  # request id -> lease deadline
        self._early: dict[str, float] = {}  # read before we were told to hold it
        self._read_before_hold: set[str] = set()
        # Recently freed requests (bounded by count, not time: a late decode may come much
        # later): claims for them are refused.
        self._released: OrderedDict[str, None] = OrderedDict()
        self.server = SideChannelServer(host, port, self._answer)
        self.host, self.port = host, self.server.port

    def _answer(self, payload: bytes) -> bytes:
        try:
            message = protocol.decode(payload)
        except protocol.ProtocolError as exc:
            logger.warning("side channel: %s", exc)
            return protocol.encode(protocol.ErrorReply(str(exc)))
        if not isinstance(message, protocol.Hello | protocol.Claim | protocol.Release):
            return protocol.encode(
                protocol.ErrorReply(
                    f"expected hello, claim or release, got {type(message).__name__}"
                )
            )
        if message.protocol_version != protocol.PROTOCOL_VERSION:
            return protocol.encode(
                protocol.ErrorReply(
                    f"protocol version {message.protocol_version} not supported "
                    f"(this engine speaks {protocol.PROTOCOL_VERSION})"
                )
            )
        if isinstance(message, protocol.Claim):
            return protocol.encode(self._claim(message))
        if isinstance(message, protocol.Release):
            return protocol.encode(self._give_up(message))
        if message.expect_engine_id not in (None, self.engine_id):
            return protocol.encode(
                protocol.ErrorReply(
                    f"this is engine {self.engine_id!r}, not {message.expect_engine_id!r}"
                )
            )
        logger.info("handshake from engine %s", message.engine_id)
        return self._reply

    def _claim(self, claim: protocol.Claim) -> protocol.ClaimReply:
        """Extend the leases of held requests; say which are gone (the rest: not yet held)."""
        hold_s = min(max(claim.hold_s, 0.0), 10 * self.lease_s)
        held, gone = [], []
        with self._lock:
            deadline = time.monotonic() + hold_s
            for request_id in claim.request_ids:
                if request_id in self._held:
                    self._held[request_id] = max(self._held[request_id], deadline)
                    held.append(request_id)
                elif request_id in self._released or request_id in self._read_before_hold:
                    gone.append(request_id)
        return protocol.ClaimReply(held, gone)

    def _give_up(self, release: protocol.Release) -> protocol.ClaimReply:
        """Decode will never read these: free them on the next poll (or at once when the
        scheduler hands them over later), as an abort notification would."""
        now = time.monotonic()
        with self._lock:
            for request_id in release.request_ids:
                logger.warning(
                    "decode engine %s gave up on request %s: %s; freeing its blocks",
                    release.engine_id,
                    request_id,
                    release.reason,
                )
                self._decode_done(request_id, now)
        return protocol.ClaimReply([], list(release.request_ids))

    def _decode_done(self, request_id: str, now: float) -> None:
        """Decode is done with a request (read it, or gave up): free its blocks on the next
        poll, or when the scheduler hands them over if it has not yet (decode can be faster
        than our scheduler's hold). Caller holds the lock."""
        if self._held.pop(request_id, None) is not None:
            self._read_before_hold.add(request_id)
        elif request_id not in self._released:
            self._early[request_id] = now + self.lease_s

    def hold(self, request_id: str, lease_s: float | None = None) -> None:
        """Keep a finished prefill's blocks until decode reads them or the lease ends."""
        with self._lock:
            if self._early.pop(request_id, None) is not None:
                self._read_before_hold.add(request_id)  # freed on the next poll
                return
            lease = self.lease_s if lease_s is None else lease_s
            self._held[request_id] = time.monotonic() + lease

    @property
    def held(self) -> set[str]:
        with self._lock:
            return set(self._held) | self._read_before_hold

    def poll(self) -> tuple[set[str], set[str]]:
        """``(read, expired)`` request ids whose blocks can be freed now."""
        notifications = self.transport.notifications()
        with self._lock:
            read, expired = self._release(notifications)
            for request_id in read | expired:
                self._released[request_id] = None
            while len(self._released) > RELEASED_MEMORY:
                self._released.popitem(last=False)
        return read, expired

    def _release(self, notifications: dict[str, list[bytes]]) -> tuple[set[str], set[str]]:
        now = time.monotonic()
        for peer, messages in notifications.items():
            for message in messages:
                try:
                    _, request_id = protocol.parse_notification(message)
                except protocol.ProtocolError as exc:
                    logger.warning("notification from %s ignored: %s", peer, exc)
                    continue
                self._decode_done(request_id, now)
        read, self._read_before_hold = self._read_before_hold, set()
        expired = {r for r, deadline in self._held.items() if deadline <= now}
        for request_id in expired:
            del self._held[request_id]
            logger.warning(
                "decode never read request %s within its lease: freeing its blocks", request_id
            )
        self._early = {r: d for r, d in self._early.items() if d > now}
        return read, expired

    def close(self) -> None:
        self.server.close()
        self.transport.close()


@dataclass
class Peer:
    engine_id: str
    agent: str
    topology: KVTopology
    owners: list[PairedOwner]
    plan: TransferPlan  # the owners' address math, prepared once for every read


@dataclass
class _Read:
    request_id: str
    params: protocol.RemotePrefillParams
    local_ids: BlockIds
    created: float = field(default_factory=time.monotonic)
    handle: object | None = None
    started: float = 0.0
    nbytes: int = 0
    descriptors: int = 0
    blocks: int = 0
    claim: Future[protocol.ClaimReply] | None = None
    claimed: bool = False
    next_claim: float = 0.0


class KVSink:
    """Decode side: handshakes with prefill engines and reads requests' blocks from them."""

    def __init__(
        self,
        engine_id: str,
        topology: KVTopology,
        transport: NixlTransport,
        handshake_timeout_s: float = 10.0,
        transfer_timeout_s: float = 60.0,
    ):
        self.engine_id = engine_id
        self.topology = topology
        self.transport = transport
        self.handshake_timeout_s = handshake_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        transport.register(topology.regions)
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvshare-handshake")
        self._handshakes: dict[tuple[str, int], Future[protocol.HandshakeReply]] = {}
        self._peers: dict[tuple[str, int], Peer] = {}
        self._reads: dict[str, _Read] = {}
        self.records: list[TransferRecord] = []

    # -- handshakes --------------------------------------------------------------------

    def _fetch(self, host: str, port: int, expect: str) -> protocol.HandshakeReply:
        hello = protocol.Hello(protocol.PROTOCOL_VERSION, self.engine_id, expect)
        try:
            raw = ask(host, port, protocol.encode(hello), self.handshake_timeout_s)
        except SideChannelError as exc:
            raise HandshakeError(str(exc)) from exc
        try:
            reply = protocol.decode(raw)
        except protocol.ProtocolError as exc:
            raise HandshakeError(f"prefill at {host}:{port} answered garbage: {exc}") from exc
        if isinstance(reply, protocol.ErrorReply):
            raise HandshakeError(f"prefill at {host}:{port} refused the handshake: {reply.message}")
        if not isinstance(reply, protocol.HandshakeReply):
            raise HandshakeError(f"prefill at {host}:{port} answered a {type(reply).__name__}")
        return reply

    def _ask_claim(self, host: str, port: int, request_id: str) -> protocol.ClaimReply:
        claim = protocol.Claim(
            protocol.PROTOCOL_VERSION, self.engine_id, [request_id], self.transfer_timeout_s + 5
        )
        try:
            reply = protocol.decode(
                ask(host, port, protocol.encode(claim), self.handshake_timeout_s)
            )
        except (SideChannelError, protocol.ProtocolError) as exc:
            raise HandshakeError(f"claiming {request_id} at {host}:{port}: {exc}") from exc
        if not isinstance(reply, protocol.ClaimReply):
            raise HandshakeError(f"prefill at {host}:{port} answered a claim with {reply}")
        return reply

    def _claimed(self, read: _Read) -> bool:
        """True once prefill confirmed it holds the blocks (and extended their lease).

        Prefill's scheduler hands a finished request to its worker one step after it
        returned the request's kv_transfer_params, so "not held yet" is retried until the
        handshake bound; "gone" (read or lease expired) fails the request before any read.
        """
        if read.claimed:
            return True
        p = read.params
        if read.claim is None:
            if time.monotonic() >= read.next_claim:
                read.claim = self._executor.submit(
                    self._ask_claim, p.remote_host, p.remote_port, p.remote_request_id
                )
            return False
        if not read.claim.done():
            return False
        reply, read.claim = read.claim.result(), None
        if p.remote_request_id in reply.held:
            read.claimed = True
            return True
        if p.remote_request_id in reply.gone:
            raise TransportError(
                f"prefill {p.remote_engine_id} no longer holds request {p.remote_request_id}'s "
                "blocks (read already, or its lease expired)"
            )
        if time.monotonic() - read.created > self.handshake_timeout_s:
            raise HandshakeError(
                f"prefill {p.remote_engine_id} never held request {p.remote_request_id} "
                f"within {self.handshake_timeout_s:g} s"
            )
        read.next_claim = time.monotonic() + 0.01
        return False

    def _peer(self, host: str, port: int, expect: str) -> Peer | None:
        """The peer if its handshake finished (raises its error), else None (in flight)."""
        key = (host, port)
        peer = self._peers.get(key)
        if peer is not None and peer.engine_id == expect:
            return peer
        future = self._handshakes.get(key)
        if future is None:
            self._handshakes[key] = self._executor.submit(self._fetch, host, port, expect)
            return None
        if not future.done():
            return None
        del self._handshakes[key]
        reply = future.result()  # raises HandshakeError
        try:
            remote = protocol.layout_from_msg(reply.layout)
        except protocol.ProtocolError as exc:
            raise HandshakeError(
                f"prefill at {host}:{port} sent an unusable layout: {exc}"
            ) from exc
        owners = pair_owners(self.topology, remote)  # raises LayoutMismatch
        if peer is not None:
            self.transport.remove_peer(peer.agent)
        agent = self.transport.add_peer(reply.agent_metadata)
        peer = Peer(reply.engine_id, agent, remote, owners, TransferPlan(owners))
        self._peers[key] = peer
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

    # -- reads ---------------------------------------------------------------------------

    def request(
        self, request_id: str, params: protocol.RemotePrefillParams, local_ids: BlockIds
    ) -> None:
        """Queue a read of ``params.remote_block_ids`` into ``local_ids`` (per group)."""
        if request_id in self._reads:
            raise ValueError(f"request {request_id} is already being read")
        self._reads[request_id] = _Read(request_id, params, [list(ids) for ids in local_ids])

    @property
    def in_flight(self) -> set[str]:
        return set(self._reads)

    def poll(self) -> tuple[set[str], dict[str, str]]:
        """Advance every read: ``(done, {failed request id: reason})``."""
        done: set[str] = set()
        failed: dict[str, str] = {}
        now = time.monotonic()
        for read in list(self._reads.values()):
            try:
                if read.handle is None:
                    if now - read.created > self.handshake_timeout_s + self.transfer_timeout_s:
                        raise HandshakeError("timed out waiting for the prefill handshake")
                    if self._start(read):
                        done.add(read.request_id)
                    continue
                state = self.transport.state(read.handle)
                if state == "DONE":
                    self._finish(read)
                    done.add(read.request_id)
                elif state == "ERR":
                    raise TransportError(f"NIXL READ from {read.params.remote_engine_id} failed")
                elif now - read.started > self.transfer_timeout_s:
                    raise TransportError(
                        f"NIXL READ from {read.params.remote_engine_id} did not finish in "
                        f"{self.transfer_timeout_s:g} s"
                    )
            except Exception as exc:  # every failure ends this request only
                failed[read.request_id] = f"{type(exc).__name__}: {exc}"
                self._abandon(read, exc)
        for request_id in done | set(failed):
            self._reads.pop(request_id, None)
        return done, failed

    def _start(self, read: _Read) -> bool:
        """Start the READ once the peer is known; True if nothing had to move."""
        p = read.params
        peer = self._peer(p.remote_host, p.remote_port, p.remote_engine_id)
        if peer is None:
            return False
        local_ids, remote_ids = align_block_ids(read.local_ids, p.remote_block_ids)
        note = protocol.notification(protocol.NOTIF_DONE, p.remote_request_id)
        read.blocks = sum(len(ids) for ids in local_ids)
        if read.blocks == 0:  # e.g. a full local prefix-cache hit: just free prefill
            self.transport.notify(peer.agent, note)
            self.records.append(TransferRecord(read.request_id, 0, 0, 0, 0.0))
            return True
        if not self._claimed(read):
            return False
        local_rows, remote_rows = transfer_descriptors(
            peer.plan, local_ids, remote_ids, self.topology.num_blocks, peer.topology.num_blocks
        )
        read.nbytes = int(local_rows[:, 1].sum())
        read.descriptors = len(local_rows)
        read.started = time.monotonic()
        read.handle = self.transport.read(
            peer.agent, local_rows, _kind(self.topology), remote_rows, _kind(peer.topology), note
        )
        return False

    def _finish(self, read: _Read) -> None:
        self.transport.release(read.handle)
        self.records.append(
            TransferRecord(
                read.request_id,
                read.nbytes,
                read.descriptors,
                read.blocks,
                time.monotonic() - read.started,
            )
        )

    def _abandon(self, read: _Read, error: Exception) -> None:
        """Release what we hold and tell prefill (if reachable) to free its blocks."""
        if read.handle is not None:
            self.transport.release(read.handle)
        p = read.params
        peer = self._peers.get((p.remote_host, p.remote_port))
        if peer is not None and peer.engine_id == p.remote_engine_id:
            self.transport.notify(
                peer.agent, protocol.notification(protocol.NOTIF_ABORT, p.remote_request_id)
            )
        elif isinstance(error, LayoutMismatch):  # prefill answers, but is no NIXL peer
            reason = "KV layouts do not match: " + "; ".join(error.differences[:3])
            self._executor.submit(self._ask_release, p, reason)

    def _ask_release(self, p: protocol.RemotePrefillParams, reason: str) -> None:
        """Best effort: prefill's lease frees the blocks anyway if this does not arrive."""
        release = protocol.Release(
            protocol.PROTOCOL_VERSION, self.engine_id, [p.remote_request_id], reason
        )
        try:
            ask(p.remote_host, p.remote_port, protocol.encode(release), self.handshake_timeout_s)
        except SideChannelError as exc:
            logger.warning(
                "could not ask prefill %s to free request %s: %s",
                p.remote_engine_id,
                p.remote_request_id,
                exc,
            )

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.transport.close()


def _kind(topology: KVTopology) -> str:
    kinds = {r.mem_kind for r in topology.regions}
    if len(kinds) != 1:
        raise TransportError(f"KV regions span memory kinds {sorted(kinds)}")
    return kinds.pop()
