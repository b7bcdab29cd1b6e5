"""Prefill side of the pull transfer: hold requests' blocks, serve the layout, free on read.

No vLLM here: the connector's worker drives ``KVSource``; the CPU tests and the demo drive it
the same way across real processes. All NIXL calls happen on the caller's thread (NIXL agents
are not thread-safe by default); the side-channel server answers from its own thread.
"""

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvshare_connector.common.log import get_logger
from kvshare_connector.layout.descriptors import request_descriptors
from kvshare_connector.layout.matching import EngineIdentity
from kvshare_connector.layout.sharding import Shard
from kvshare_connector.layout.staging import PackedLayout
from kvshare_connector.layout.topology import KVTopology
from kvshare_connector.transfer import protocol
from kvshare_connector.transfer.digests import Digester, PendingDigests
from kvshare_connector.transfer.nixl import NixlTransport
from kvshare_connector.transfer.packing import Copy, Packer
from kvshare_connector.transfer.side_channel import SideChannelServer, warn_if_no_secret

logger = get_logger(__name__)

RELEASED_MEMORY = 100_000  # freed request ids a prefill remembers, to refuse late claims


@dataclass
class _Packed:
    slot: int  # offset in the staging area
    nbytes: int
    device_id: int
    copy: Copy  # the gather, possibly still running


class KVSource:
    """Prefill side: registers owners, answers handshakes, frees blocks when read or expired.

    Fail closed on claims: the first claim of a held request makes its token the only
    reader (a second decode is refused while the first reads and after: the blocks may be
    free by then), a claim may name only blocks held for that request, and only the reader
    (or, before any claim, anyone) can free a request early.
    """

    def __init__(
        self,
        engine_id: str,
        topology: KVTopology,
        transport: NixlTransport,
        host: str = "127.0.0.1",
        port: int = 0,
        lease_s: float = 30.0,
        identity: EngineIdentity | None = None,
        secret: bytes | None = None,
        packer: Packer | None = None,
        digester: Digester | None = None,
        shard: Shard | None = None,
    ):
        self.engine_id = engine_id
        self.topology = topology
        self.transport = transport
        self.lease_s = lease_s
        transport.register(topology.regions)
        # Packed transfer: each held request gathered into one staging slot, read as a few
        # large runs (``layout.staging``); without room it is read block by block.
        self.packer = packer
        self._packed: dict[str, _Packed] = {}
        # verify_kv: each held request digested once, on the device, for its reader to check
        self.digester = digester
        self._digests: dict[str, tuple[list[list[int]], PendingDigests]] = {}
        if packer is not None:
            transport.register([packer.staging.region])
        self._reply = protocol.encode(
            protocol.HandshakeReply(
                protocol_version=protocol.PROTOCOL_VERSION,
                engine_id=engine_id,
                agent_name=transport.name,
                agent_metadata=transport.metadata(),
                layout=protocol.layout_to_msg(topology, identity, shard),
            )
        )
        # The side channel thread (claims) and the engine thread (hold/poll) share these.
        self._lock = threading.Lock()
        self._held: dict[str, float] = {}  # request id -> lease deadline
        self._blocks: dict[str, list[frozenset[int]]] = {}  # held block ids per group
        self._reader: dict[str, str] = {}  # request id -> claim token of its one reader
        # TP: done/abort notifications still awaited from the reader's other ranks
        self._readers_left: dict[str, int] = {}
        self._refused = Counter[str]()  # refused messages / claims the server did not count
        self._warned_unknown_blocks = False
        self._early: dict[str, float] = {}  # read before we were told to hold it
        self._read_before_hold: set[str] = set()
        # Recently freed requests (bounded by count, not time: a late decode may come much
        # later): claims for them are refused.
        self._released: OrderedDict[str, None] = OrderedDict()
        warn_if_no_secret(secret)
        self.server = SideChannelServer(
            host,
            port,
            self._answer,
            secret=secret,
            error=lambda message: protocol.encode(protocol.ErrorReply(message)),
        )
        self.host, self.port = host, self.server.port

    def take_refused(self) -> dict[str, int]:
        """Refusals since the last call, for stats: ``refused_messages`` (unauthenticated,
        malformed, oversize, rate-limited, replayed or over the per-message caps) and
        ``refused_claims`` (another reader, or blocks not held for the request)."""
        messages = sum(self.server.take_refused().values())
        with self._lock:
            messages += self._refused.pop("refused_messages", 0)
            claims = self._refused.pop("refused_claims", 0)
        return {"refused_messages": messages, "refused_claims": claims}

    def _answer(self, payload: bytes) -> bytes:
        try:
            message = protocol.decode(payload)
        except protocol.ProtocolError as exc:
            logger.warning("side channel: %s", exc)
            with self._lock:
                self._refused["refused_messages"] += 1
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
        too_big = _over_caps(message)
        if too_big:
            with self._lock:
                self._refused["refused_messages"] += 1
            logger.warning("side channel: %s", too_big)
            return protocol.encode(protocol.ErrorReply(too_big))
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
        """Extend the leases of held requests for their one reader; say which are gone,
        which are refused (the rest: not yet held)."""
        hold_s = min(max(claim.hold_s, 0.0), 10 * self.lease_s)
        held, gone, refused = [], [], {}
        with self._lock:
            deadline = time.monotonic() + hold_s
            for request_id in claim.request_ids:
                if request_id in self._held:
                    reason = self._refusal(request_id, claim)
                    if reason:
                        refused[request_id] = reason
                        self._refused["refused_claims"] += 1
                        logger.warning("claim of request %s refused: %s", request_id, reason)
                        continue
                    if request_id not in self._reader:  # TP: several decode ranks read it
                        self._readers_left[request_id] = min(max(claim.readers, 1), protocol.MAX_TP)
                    self._reader[request_id] = claim.token
                    self._held[request_id] = max(self._held[request_id], deadline)
                    held.append(request_id)
                elif request_id in self._released or request_id in self._read_before_hold:
                    gone.append(request_id)
            packs = {r: self._packed[r] for r in held if claim.packed and r in self._packed}
            digests = {r: self._digests[r] for r in held if claim.verify and r in self._digests}
        packed = {}
        for request_id, pack in packs.items():
            pack.copy.wait()  # the gather runs on a side stream: done before decode reads
            packed[request_id] = protocol.PackedRef(
                self.packer.staging.addr + pack.slot, pack.nbytes, pack.device_id
            )
        return protocol.ClaimReply(held, gone, refused, packed, _digest_msgs(digests))

    def _refusal(self, request_id: str, claim: protocol.Claim) -> str | None:
        """Why ``claim`` may not read held ``request_id``, or None. Caller holds the lock."""
        reader = self._reader.get(request_id)
        if not claim.token:
            return "the claim carries no reader token"
        if reader is not None and reader != claim.token:
            return (
                f"request {request_id} is already claimed by another decode (engine "
                f"{claim.engine_id} asked): one reader per request, a retry or second "
                "sample must be prefilled again"
            )
        held = self._blocks.get(request_id)
        if held is None:
            if not self._warned_unknown_blocks:
                self._warned_unknown_blocks = True
                logger.warning(
                    "the block ids of held requests are unknown (hold() without block_ids): "
                    "claims cannot be checked against them"
                )
            return None
        named = claim.block_ids.get(request_id)
        if named is None:
            return "the claim does not name the block ids it will read"
        if len(named) != len(held):
            return f"the claim names {len(named)} group(s) of blocks, prefill holds {len(held)}"
        for group, (ids, own) in enumerate(zip(named, held, strict=True)):
            foreign = [b for b in ids if b not in own]
            if foreign:
                return (
                    f"the claim names block(s) {foreign[:5]} of group {group} that prefill does "
                    f"not hold for request {request_id}"
                )
        return None

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
                self._decode_done(request_id, now, "")
        return protocol.ClaimReply([], list(release.request_ids))

    def _decode_done(self, request_id: str, now: float, token: str) -> None:
        """Decode is done with a request (read it, or gave up): free its blocks on the next
        poll, or when the scheduler hands them over if it has not yet (decode can be faster
        than our scheduler's hold). Once a reader claimed the request, only that reader
        frees it early (the lease still bounds it). Caller holds the lock."""
        reader = self._reader.get(request_id)
        if reader is not None and token != reader:
            logger.warning(
                "request %s: ignored a done/abort from a decode that is not its reader",
                request_id,
            )
            return
        if reader is not None and self._readers_left.get(request_id, 1) > 1:
            self._readers_left[request_id] -= 1  # TP: another decode rank still reads it
            return
        if self._held.pop(request_id, None) is not None:
            self._forget(request_id)
            self._read_before_hold.add(request_id)
        elif request_id not in self._released:
            self._early[request_id] = now + self.lease_s

    def _forget(self, request_id: str) -> None:
        self._blocks.pop(request_id, None)
        self._digests.pop(request_id, None)
        self._reader.pop(request_id, None)
        self._readers_left.pop(request_id, None)
        pack = self._packed.pop(request_id, None)
        if pack is not None and self.packer is not None:
            self.packer.staging.release(pack.slot)  # later gathers queue behind this one

    def hold(
        self,
        request_id: str,
        lease_s: float | None = None,
        block_ids: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Keep a finished prefill's blocks until decode reads them or the lease ends;
        ``block_ids`` (per group) are what claims for it may name, and what is packed."""
        with self._lock:
            if self._early.pop(request_id, None) is not None:
                self._read_before_hold.add(request_id)  # freed on the next poll
                return
            lease = self.lease_s if lease_s is None else lease_s
            self._held[request_id] = time.monotonic() + lease
            if block_ids is not None:
                self._blocks[request_id] = [frozenset(b for b in ids if b) for ids in block_ids]
                if self.packer is not None:
                    self._pack(request_id, block_ids)
                if self.digester is not None:
                    real = [[int(b) for b in ids if b] for ids in block_ids]
                    self._digests[request_id] = (real, self.digester.start(self.topology, real))

    def _pack(self, request_id: str, block_ids: Sequence[Sequence[int]]) -> None:
        """Gather the request into a staging slot (no room: it is read block by block).
        Caller holds the lock."""
        assert self.packer is not None
        real = [[b for b in ids if b] for ids in block_ids]  # never the null block
        layout = PackedLayout.of(request_descriptors(self.topology, real))
        slot = self.packer.staging.allocate(layout.nbytes)
        if slot is None:
            logger.info(
                "request %s: no staging room for %.1f MiB: it will be read block by block",
                request_id,
                layout.nbytes / 2**20,
            )
            return
        copy = self.packer.gather(layout.addr, layout.length, slot + layout.offset)
        device = self.packer.staging.region.device_id
        self._packed[request_id] = _Packed(slot, layout.nbytes, device, copy)

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
                    _, request_id, token = protocol.parse_notification(message)
                except protocol.ProtocolError as exc:
                    logger.warning("notification from %s ignored: %s", peer, exc)
                    continue
                self._decode_done(request_id, now, token)
        read, self._read_before_hold = self._read_before_hold, set()
        expired = {r for r, deadline in self._held.items() if deadline <= now}
        for request_id in expired:
            del self._held[request_id]
            self._forget(request_id)
            logger.warning(
                "decode never read request %s within its lease: freeing its blocks", request_id
            )
        self._early = {r: d for r, d in self._early.items() if d > now}
        return read, expired

    def close(self) -> None:
        self.server.close()
        self.transport.close()


def _digest_msgs(
    digests: dict[str, tuple[list[list[int]], PendingDigests]],
) -> dict[str, protocol.KVDigests]:
    """Digests as sent (waits for the device work, done long before a claim comes)."""
    out = {}
    for request_id, (block_ids, pending) in digests.items():
        layers = {name: v.astype("<u8").tobytes() for name, v in pending.result().items()}
        out[request_id] = protocol.KVDigests(block_ids, layers)
    return out


def _over_caps(message: protocol.SideMessage) -> str | None:
    """Why a message asks for more work than one message may, or None."""
    ids = getattr(message, "request_ids", [])
    if len(ids) > protocol.MAX_IDS_PER_MESSAGE:
        return f"{len(ids)} request ids in one message (at most {protocol.MAX_IDS_PER_MESSAGE})"
    names = [*ids, getattr(message, "engine_id", "")]
    if any(len(n) > protocol.MAX_ID_CHARS for n in names):
        return f"an id longer than {protocol.MAX_ID_CHARS} characters"
    if isinstance(message, protocol.Claim):
        blocks = sum(len(g) for ids in message.block_ids.values() for g in ids)
        if blocks > protocol.MAX_BLOCK_IDS_PER_MESSAGE or len(message.block_ids) > len(ids):
            return (
                f"a claim naming {blocks} block ids of {len(message.block_ids)} request(s) "
                f"(at most {protocol.MAX_BLOCK_IDS_PER_MESSAGE}, of the claimed requests)"
            )
    return None
