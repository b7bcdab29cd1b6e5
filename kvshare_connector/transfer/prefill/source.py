"""Prefill side of the pull transfer: hold requests' blocks, serve the layout, free on read.

No vLLM here: the connector's worker drives ``KVSource``; the CPU tests and the demo drive it
the same way across real processes. All NIXL calls happen on the caller's thread (NIXL agents
are not thread-safe by default); the side-channel server answers from its own thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence

import numpy as np

from kvshare_connector.common.failpoints import failpoint
from kvshare_connector.common.log import LogBudget, get_logger
from kvshare_connector.layout.descriptors import request_descriptors
from kvshare_connector.layout.sharding import Shard
from kvshare_connector.layout.staging import PackedLayout
from kvshare_connector.layout.topology import KVTopology
from kvshare_connector.transfer.device.digests import Digester, PendingDigests
from kvshare_connector.transfer.device.lanes import LaneInfo, effective, wire_settings
from kvshare_connector.transfer.device.nameplate import NAMEPLATE_BYTES, Nameplate
from kvshare_connector.transfer.device.nixl import NixlTransport
from kvshare_connector.transfer.device.packing import Packer
from kvshare_connector.transfer.device.probe import ProbeBuffer
from kvshare_connector.transfer.prefill.held import (
    Held,
    Packed,
    digest_msgs,
    order_difference,
    over_caps,
)
from kvshare_connector.transfer.wire import protocol
from kvshare_connector.transfer.wire.kv_params import host_problem
from kvshare_connector.transfer.wire.settings import EngineSettings
from kvshare_connector.transfer.wire.side_channel import (
    Answer,
    SideChannelServer,
    check_exposure,
    warn_if_no_secret,
)

logger = get_logger(__name__)

RELEASED_MEMORY = 100_000  # freed request ids a prefill remembers, to refuse late claims
EARLY_MEMORY = 4096  # done/abort/releases of requests not held yet (decode was faster)
MAX_CLAIM_HOLD_S = 90.0  # a claim extends a lease by at most this (or the lease, if longer)
# A request's blocks are held at most lease + MAX_CLAIM_HOLD_S: its first claim fixes how long
# its reader may take, and claiming again (a retry, TP's other ranks) never extends that.


class KVSource:
    """Prefill side: registers owners, answers handshakes, frees blocks when read or expired.

    Fail closed on claims: the first claim of a held request makes its token the only
    reader (a second decode is refused while the first reads and after: the blocks may be
    free by then), a claim must name exactly the blocks held for that request, per group and
    in their order (a reordered list would put each block's KV at another position), only
    the reader (or, before any claim, anyone) can free a request early, and no claim holds
    a request past its first claim's bound.
    """

    def __init__(
        self,
        topology: KVTopology,
        transport: NixlTransport,
        settings: EngineSettings,
        packer: Packer | None = None,
        digester: Digester | None = None,
        shard: Shard | None = None,
        probe: ProbeBuffer | None = None,
        lane: LaneInfo | None = None,
    ):
        why = host_problem(settings.host)
        if why is not None:  # decode refuses params naming it: no load would ever succeed
            raise ValueError(
                f"the KV side channel's host {settings.host!r} is what kv_transfer_params "
                f"name and decode dials, and it is {why}: set VLLM_NIXL_SIDE_CHANNEL_HOST to "
                "this engine's address"
            )
        bind = settings.bind_host or settings.host
        check_exposure(bind, settings.secret, settings.insecure)
        self.settings = settings
        self.engine_id = settings.engine_id
        self.topology = topology
        self.transport = transport
        self.lease_s = settings.lease_s
        transport.register(topology.regions)
        # Packed transfer: each held request gathered into one staging slot, read as a few
        # large runs (``layout.staging``); without room it is read block by block.
        self.packer = packer
        if packer is not None:
            transport.register([packer.staging.region])
        # verify_kv: each held request digested once, on the device, for its reader to check
        self.digester = digester
        self.probe = probe
        probe_ref = self._probe_ref(probe, lane)  # registered before the metadata is taken
        self.nameplate = Nameplate()  # which side channel answers for this agent
        transport.register([self.nameplate.region])
        reply = protocol.HandshakeReply(
            protocol_version=protocol.PROTOCOL_VERSION,
            engine_id=self.engine_id,
            agent_name=transport.name,
            agent_metadata=transport.metadata(),
            layout=protocol.layout_to_msg(topology, settings.identity, shard),
            probe=probe_ref,
            nameplate=protocol.NameplateRef(self.nameplate.region.addr, NAMEPLATE_BYTES),
        )
        self._reply: bytes | None = None  # handed out once the nameplate is written
        # The side channel thread (claims) and the engine thread (hold/poll) share these.
        self._lock = threading.Lock()
        self._held: dict[str, Held] = {}
        self._early: OrderedDict[str, float] = OrderedDict()  # read before held: deadline
        self._freed: set[str] = set()  # done with since the last poll: free their blocks
        # Recently freed requests (bounded by count, not time: a late decode may come much
        # later): claims for them are answered "gone".
        self._released: OrderedDict[str, None] = OrderedDict()
        self._refused = Counter[str]()  # refused messages / claims the server did not count
        self._log = LogBudget(20, 10.0, logger=logger)  # refusals
        self._info = LogBudget(20, 10.0, logging.INFO, logger=logger)  # handshakes, releases
        self._warned_unknown_blocks = False
        warn_if_no_secret(settings.secret)
        self.server = SideChannelServer(
            bind, settings.port, self._answer, settings.secret, self.engine_id,
            advertise=settings.host,
        )  # fmt: skip
        self.host, self.port = settings.host, self.server.port
        self.nameplate.write(self.server.destination)
        self._reply = protocol.encode(reply)

    def _probe_ref(self, probe: ProbeBuffer | None, lane: LaneInfo | None) -> protocol.ProbeRef:
        """Register the lane probe (decode measures the lane with it) and name it, with this
        engine's UCX settings (without ``lane``: this process's); no probe: 0 bytes."""
        lane = lane or LaneInfo(effective())
        if probe is None or probe.seed is None:
            return protocol.ProbeRef(0, 0, -1, 0, wire_settings(lane.settings))
        self.transport.register([probe.region])
        r = probe.region
        return protocol.ProbeRef(
            r.addr,
            r.nbytes,
            r.device_id,
            probe.seed,
            wire_settings(lane.settings),
            lane.kv_ipc_capable,
        )

    def take_refused(self) -> dict[str, int]:
        """Refusals since the last call, for stats: ``refused_messages`` (unauthenticated,
        malformed, oversize, rate-limited, replayed, misaddressed or over the per-message
        caps, and connections evicted or refused at accept over the connection caps),
        ``refused_claims`` (another reader, or blocks not held for the request in
        that order) and ``hold_limits`` (claimed requests freed at their claim's bound)."""
        messages = sum(self.server.take_refused().values())
        with self._lock:
            messages += self._refused.pop("refused_messages", 0)
            claims = self._refused.pop("refused_claims", 0)
            limits = self._refused.pop("hold_limits", 0)
        return {"refused_messages": messages, "refused_claims": claims, "hold_limits": limits}

    def _error(self, message: str) -> bytes:
        """A refused message: counted, logged within budget, answered with why."""
        with self._lock:
            self._refused["refused_messages"] += 1
        self._log.log(message)
        return protocol.encode(protocol.ErrorReply(message[: protocol.MAX_REASON_CHARS]))

    def _answer(self, payload: bytes) -> Answer:
        """The reply, or (a claim whose gather or digests still run on the device) the
        work that waits for them, which the server runs off its loop."""
        try:
            message = protocol.decode(payload)
        except protocol.ProtocolError as exc:
            return self._error(str(exc))
        if not isinstance(message, protocol.Hello | protocol.Claim | protocol.Release):
            return self._error(f"expected hello, claim or release, got {type(message).__name__}")
        if message.protocol_version != protocol.PROTOCOL_VERSION:
            return self._error(
                f"protocol version {message.protocol_version} not supported (this engine "
                f"speaks {protocol.PROTOCOL_VERSION})"
            )
        too_big = over_caps(message)
        if too_big:
            return self._error(too_big)
        if isinstance(message, protocol.Claim):
            return self._claim(message)
        if isinstance(message, protocol.Release):
            return protocol.encode(self._give_up(message))
        if message.expect_engine_id not in (None, self.engine_id):
            return self._error(
                f"this is engine {self.engine_id!r}, not {message.expect_engine_id[:100]!r}"
            )
        if self._reply is None:
            return self._error("this engine is starting: ask again")
        self._info.log(f"handshake from engine {message.engine_id[:100]}")
        return self._reply

    def _claim(self, claim: protocol.Claim) -> Answer:
        """Extend the leases of held requests for their one reader; say which are gone,
        which are refused (the rest: not yet held)."""
        arrived = time.monotonic()
        hold_s = min(max(claim.hold_s, 0.0), max(self.lease_s, MAX_CLAIM_HOLD_S))
        held, gone, refused = [], [], {}
        packs: dict[str, Packed] = {}
        digests: dict[str, tuple[list[list[int]], PendingDigests]] = {}
        ages: dict[str, float] = {}
        with self._lock:
            now = time.monotonic()
            deadline = now + hold_s
            for request_id in claim.request_ids:
                record = self._held.get(request_id)
                if record is None:
                    if request_id in self._released or request_id in self._freed:
                        gone.append(request_id)
                    continue
                token = claim.tokens.get(request_id, claim.token)
                reason = self._refusal(request_id, record, claim, token)
                if reason:
                    refused[request_id] = reason
                    self._refused["refused_claims"] += 1
                    self._log.log(f"claim of request {request_id} refused: {reason}")
                    continue
                if record.reader is None:  # TP: several decode ranks read it
                    record.readers_left = min(max(claim.readers, 1), protocol.MAX_TP)
                    record.claim_bound = deadline
                record.reader = token
                record.deadline = max(record.deadline, min(deadline, record.claim_bound))
                held.append(request_id)
                ages[request_id] = round(now - record.since, 6)
                if claim.packed and record.packed is not None:
                    packs[request_id] = record.packed
                if claim.verify and record.digests is not None:
                    digests[request_id] = record.digests

        def reply() -> bytes:
            packed = {}
            for request_id, pack in packs.items():
                pack.copy.wait()  # the gather runs on a side stream: done before decode reads
                assert self.packer is not None
                packed[request_id] = protocol.PackedRef(
                    self.packer.staging.addr + pack.slot, pack.nbytes, pack.device_id
                )
            answer = protocol.ClaimReply(held, gone, refused, packed, digest_msgs(digests), ages,
                                         round(time.monotonic() - arrived, 6))  # fmt: skip
            if held:
                failpoint("source.claim_answered")
            return protocol.encode(answer)

        waits = any(not p.copy.done() for p in packs.values()) or any(
            not pending.ready() for _, pending in digests.values()
        )  # done long before a claim comes, mostly: then it is answered at once
        return reply if waits else reply()

    def _refusal(
        self, request_id: str, record: Held, claim: protocol.Claim, token: str
    ) -> str | None:
        """Why ``claim`` (its reader's ``token``) may not read held ``request_id``, or None.
        Caller holds the lock."""
        if not token:
            return "the claim carries no reader token"
        if record.reader is not None and record.reader != token:
            return (
                f"request {request_id} is already claimed by another decode (engine "
                f"{claim.engine_id[:100]} asked): one reader per request, a retry or second "
                "sample must be prefilled again"
            )
        if record.blocks is None:
            if not self._warned_unknown_blocks:
                self._warned_unknown_blocks = True
                logger.warning(
                    "the block ids of held requests are unknown (hold() without block_ids): "
                    "claims cannot be checked against them"
                )
            return None
        named = claim.block_ids.get(request_id)
        if named is None:
            return "the claim does not name the block ids of the request"
        if len(named) != len(record.blocks):
            return (
                f"the claim names {len(named)} group(s) of blocks, prefill holds "
                f"{len(record.blocks)}"
            )
        for group, (ids, own) in enumerate(zip(named, record.blocks, strict=True)):
            why = order_difference(ids, own)
            if why:
                return (
                    f"the claim's block ids of group {group} are not the ones prefill holds "
                    f"for request {request_id}, in their order: {why}"
                )
        return None

    def _give_up(self, release: protocol.Release) -> protocol.ClaimReply:
        """Decode will never read these: free them on the next poll (or at once when the
        scheduler hands them over later), as an abort notification would. The reply says
        what happened to each: freed (``gone``) or refused (another reader claimed it)."""
        now = time.monotonic()
        gone, refused = [], {}
        with self._lock:
            for request_id in release.request_ids:
                if self._decode_done(request_id, now, release.token):
                    gone.append(request_id)
                else:
                    refused[request_id] = "claimed by another reader: only it may free it"
                    self._refused["refused_claims"] += 1
        if gone:
            self._info.log(
                f"decode engine {release.engine_id[:100]} gave up on {len(gone)} request(s) "
                f"({gone[0][:100]}): {release.reason[: protocol.MAX_REASON_CHARS]}; freeing "
                "their blocks"
            )
        return protocol.ClaimReply([], gone, refused)

    def _decode_done(self, request_id: str, now: float, token: str) -> bool:
        """Decode is done with a request (read it, or gave up): free its blocks on the next
        poll, or when the scheduler hands them over if it has not yet (decode can be faster
        than our scheduler's hold). Once a reader claimed the request, only that reader
        frees it early (the lease still bounds it): False for anyone else. Caller holds
        the lock."""
        record = self._held.get(request_id)
        if record is None:
            if request_id not in self._released and request_id not in self._freed:
                self._early[request_id] = now + self.lease_s
                self._early.move_to_end(request_id)
                while len(self._early) > EARLY_MEMORY:
                    self._early.popitem(last=False)
            return True
        if record.reader is not None and token != record.reader:
            self._log.log(
                f"request {request_id}: ignored a done/abort from a decode that is not its reader"
            )
            return False
        if record.reader is not None and record.readers_left > 1:
            record.readers_left -= 1  # TP: another decode rank still reads it
            return True
        self._forget(request_id)
        self._freed.add(request_id)
        return True

    def _forget(self, request_id: str) -> Held:
        record = self._held.pop(request_id)
        if record.packed is not None and self.packer is not None:
            self.packer.staging.release(record.packed.slot)  # later gathers queue behind it
        return record

    def hold(
        self,
        request_id: str,
        lease_s: float | None = None,
        block_ids: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Keep a finished prefill's blocks until decode reads them or the lease ends;
        ``block_ids`` (per group) are what claims for it must name, and what is packed.

        The gather and the digests start at once, not behind the engine's compute stream: a
        request is handed over in a step scheduled after vLLM saw its last sampled token,
        so the forward that wrote its KV is done, and vLLM schedules no step past
        ``max_tokens`` (1 for a prefill) that could write its blocks. With async scheduling
        (vLLM's default) the next step's forward is queued by then, and a claim that came
        early waited for it (2026-12-03b: 100-180 ms at 8k, against 2-12 ms)."""
        with self._lock:
            if self._early.pop(request_id, None) is not None:
                self._freed.add(request_id)  # read (or given up) already: freed next poll
                return
            lease = self.lease_s if lease_s is None else lease_s
            now = time.monotonic()
            record = Held(now + lease, now, None)
            self._held[request_id] = record
            if block_ids is None:
                return
            record.blocks = [np.asarray(ids, dtype=np.int64) for ids in block_ids]  # in order
            real = [[int(b) for b in ids if b] for ids in block_ids]  # never the null block
            if self.packer is not None:
                record.packed = self._pack(request_id, real)
            if self.digester is not None:
                record.digests = (real, self.digester.start(self.topology, real,
                                                            after_compute=False))  # fmt: skip

    def _pack(self, request_id: str, real: list[list[int]]) -> Packed | None:
        """Gather the request into a staging slot (no room: it is read block by block)."""
        assert self.packer is not None
        layout = PackedLayout.of(request_descriptors(self.topology, real))
        slot = self.packer.staging.allocate(layout.nbytes)
        if slot is None:
            logger.info(
                "request %s: no staging room for %.1f MiB: it will be read block by block",
                request_id,
                layout.nbytes / 2**20,
            )
            return None
        copy = self.packer.gather(layout.addr, layout.length, slot + layout.offset,
                                  after_compute=False)  # fmt: skip
        device = self.packer.staging.region.device_id
        return Packed(slot, layout.nbytes, device, copy)

    def packed_slot(self, request_id: str) -> Packed | None:
        """Where a held request was packed (tests and tools that inspect the staging)."""
        with self._lock:
            record = self._held.get(request_id)
            return record.packed if record is not None else None

    @property
    def held(self) -> set[str]:
        with self._lock:
            return set(self._held) | self._freed

    def poll(self) -> tuple[set[str], set[str]]:
        """``(read, expired)`` request ids whose blocks can be freed now."""
        notifications = self.transport.notifications()
        with self._lock:
            read, expired = self._release(notifications)
            for request_id in read | expired:
                self._released[request_id] = None
            while len(self._released) > RELEASED_MEMORY:
                self._released.popitem(last=False)
        if read:
            failpoint("source.before_release")
        return read, expired

    def _release(self, notifications: dict[str, list[bytes]]) -> tuple[set[str], set[str]]:
        now = time.monotonic()
        for peer, messages in notifications.items():
            for message in messages:
                try:
                    _, request_id, token = protocol.parse_notification(message)
                except protocol.ProtocolError as exc:
                    self._log.log(f"notification from {peer[:100]} ignored: {exc}")
                    continue
                self._decode_done(request_id, now, token)
        read, self._freed = self._freed, set()
        expired = {r for r, record in self._held.items() if record.deadline <= now}
        for request_id in expired:
            record = self._forget(request_id)
            if record.reader is None:
                logger.warning(
                    "decode never read request %s within its lease: freeing its blocks",
                    request_id,
                )
                continue
            self._refused["hold_limits"] += 1
            self._log.log(
                f"request {request_id}: its reader claimed it but never said done within "
                f"the claim's bound ({record.claim_bound - record.since:.0f} s after prefill "
                "finished): freeing its blocks"
            )
        while self._early and next(iter(self._early.values())) <= now:  # oldest first
            self._early.popitem(last=False)
        return read, expired

    def close(self) -> None:
        self.server.close()
        self.transport.close()
