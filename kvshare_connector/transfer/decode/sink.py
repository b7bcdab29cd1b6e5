"""Decode side of the pull transfer: handshake with prefill, claim a request, READ its blocks.

No vLLM here: the connector's worker drives ``KVSink``. Every NIXL call is on the caller's
thread (NIXL agents are not thread-safe by default); only side-channel asks run on each
prefill's helper thread (``decode.peers``), so a dead prefill never blocks the engine loop.
A read goes through explicit phases (``decode.reads``): PEER, CLAIM, READ, then done or failed.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvshare_connector.common.failpoints import failpoint
from kvshare_connector.common.log import get_logger
from kvshare_connector.layout.descriptors import transfer_descriptors
from kvshare_connector.layout.staging import packed_read_of
from kvshare_connector.layout.topology import BlockIds, KVTopology
from kvshare_connector.layout.verification import VerificationError
from kvshare_connector.transfer.decode.alignment import align_block_ids, token_counts
from kvshare_connector.transfer.decode.claims import ClaimRefused, Claims, PeerDown
from kvshare_connector.transfer.decode.landing import Lander
from kvshare_connector.transfer.decode.nameplates import Nameplates
from kvshare_connector.transfer.decode.peers import (
    HandshakeError,
    Pairing,
    Peer,
    PeerIdentityError,
    Peers,
)
from kvshare_connector.transfer.decode.reads import Phase, Plan, Read, ReadOrder, Transfer
from kvshare_connector.transfer.device.digests import Digester
from kvshare_connector.transfer.device.nixl import NixlTransport, PeerNotLoaded, TransportError
from kvshare_connector.transfer.device.packing import Packer
from kvshare_connector.transfer.device.probe import Lanes, ProbeBuffer, ProbeError
from kvshare_connector.transfer.device.records import LaneReport, SinkProgress, TransferRecord
from kvshare_connector.transfer.wire import kv_params, protocol
from kvshare_connector.transfer.wire.settings import EngineSettings
from kvshare_connector.transfer.wire.side_channel import (
    destination,
    warn_if_no_secret,
)

logger = get_logger(__name__)

SPIN_S = 0.002  # how long a poll watches READs it just posted (see ``KVSink.poll``)


class ReadFailed(TransportError):
    """NIXL reported a READ failed (the peer died or its memory went away)."""


class KVSink:
    """Decode side: handshakes with prefill engines and reads requests' blocks from them.

    With ``digester`` (``verify_kv``), a request counts as loaded only once decode's digests
    of its blocks, taken after the READ, equal the ones prefill took when it held them.
    """

    def __init__(
        self,
        topology: KVTopology,
        transport: NixlTransport,
        settings: EngineSettings,
        packer: Packer | None = None,
        digester: Digester | None = None,
        pairing: Pairing | None = None,
        probe: ProbeBuffer | None = None,
    ):
        self.settings = settings
        self.engine_id = settings.engine_id
        self.topology = topology
        self.transport = transport
        self.packer = packer  # set: read packed requests into a staging slot, then scatter
        self.digester = digester  # set: verify every read against prefill's digests
        self.probe = probe  # set: measure each new prefill's lane before its first read
        warn_if_no_secret(settings.secret)
        transport.register(topology.regions)
        for extra in (packer.staging.region if packer else None, probe.region if probe else None):
            if extra is not None:
                transport.register([extra])
        self.peers = Peers(topology, transport, settings, pairing=pairing)
        self.claims = Claims(self.peers, settings, packer is not None)
        self.lander = Lander(topology, transport, packer, digester)
        self._reads: dict[str, Read] = {}
        self._done: set[str] = set()  # finished since the last poll
        self._failed: dict[str, str] = {}
        self._draining: dict[str, tuple[Any, str]] = {}  # failed, NIXL not yet let go
        self._stuck: list[tuple[Any, int]] = []  # (handle, slot) of READs we gave up on
        self.lanes = Lanes(transport, probe)
        self.nameplates = Nameplates(transport, settings.handshake_timeout_s)
        self.peers.on_unload = self.nameplates.forget
        self.records: list[TransferRecord] = []  # finished since the last take_progress
        self._created: dict[str, float] = {}  # their reads' start, for the timeline
        self.counters = Counter[str]()  # verify_failures, for stats

    # -- the engine's calls ----------------------------------------------------------------

    def request(
        self,
        request_id: str,
        params: kv_params.RemotePrefillParams,
        local_ids: BlockIds,
        num_tokens: int | None = None,
        num_local_tokens: int | Sequence[int] = 0,
        token: str | None = None,
        readers: int = 1,
    ) -> None:
        """Queue a read of ``params.remote_block_ids`` into ``local_ids`` (per group).

        ``num_tokens`` (decode's prompt length) and ``num_local_tokens`` (cached locally:
        one for every group, or each group's own hit) let the sink check the exact block
        counts (``alignment``); without them, the counts must be equal. TP
        (``transfer.decode.shards``): the decode ranks reading one prefill rank share ``token``
        and say how many ``readers`` they are.
        """
        if request_id in self._reads:
            raise ValueError(f"request {request_id} is already being read")
        local = [list(ids) for ids in local_ids]
        hits = num_local_tokens if isinstance(num_local_tokens, int) else tuple(num_local_tokens)
        order = ReadOrder(request_id, params, local, num_tokens, hits, readers=readers)
        self._reads[request_id] = Read(order if token is None else replace(order, token=token))

    @property
    def in_flight(self) -> set[str]:
        return set(self._reads) | set(self._draining)

    @property
    def reading(self) -> bool:
        """Reads are under way (cheaper than ``in_flight``: asked at every layer)."""
        return bool(self._reads)

    def poll(self, spin_s: float = SPIN_S) -> tuple[set[str], dict[str, str]]:
        """Advance every read: ``(done, {failed request id: reason})``, including what an
        ``advance`` since the last poll finished.

        The engine calls this once per step, so a READ that needs one more look to be seen
        done costs a whole step: a READ posted here is watched for up to ``spin_s``.
        """
        self.transport.progress()  # e.g. the notification of a read abandoned last step
        self.advance(spin_s)
        self._retry_stuck()
        done, failed = self._done, self._failed
        self._done, self._failed = set(), {}
        return done, failed

    def take_progress(self, spin_s: float = SPIN_S) -> SinkProgress:
        """``poll``, with what finished reads and lane probes recorded since the last call."""
        done, failed = self.poll(spin_s)
        now = time.monotonic()
        records = [r.reported(self._created.pop(r.request_id, None), now) for r in self.records]
        counters = dict(self.counters)
        self.records, self.counters = [], Counter()
        return SinkProgress(done, failed, records, self.take_lanes(), counters)

    def take_lanes(self) -> list[LaneReport]:
        """Lanes measured since the last call."""
        return self.lanes.take()

    def advance(self, spin_s: float = 0.0) -> None:
        """Move every read as far as it goes now (handshake, claim, READ, scatter); called
        when requests arrive too, so their claims are under way before the step ends.
        Every READ that can start is posted, then all are watched together for ``spin_s``
        (one by one, a READ could wait that long for the read before it to land)."""
        self.peers.pump()  # claims' answers that came in since the last call
        self.peers.next_round()
        self.lanes.next_round()
        self.nameplates.next_round()
        now = time.monotonic()
        moving = []
        for read in list(self._reads.values()):
            try:
                if read.phase not in (Phase.READ, Phase.LAND):
                    bound = self.settings.handshake_timeout_s + self.settings.transfer_timeout_s
                    if now - read.created > bound:
                        raise HandshakeError("timed out waiting for the prefill handshake")
                    if self._start(read):
                        self._done.add(read.request_id)
                    if read.phase is not Phase.READ:
                        continue
                moving.append(read)
            except Exception as exc:  # every failure ends this request only
                self._fail(read, exc)
        self._watch(moving, now + spin_s, now)  # a READ posted just now is watched too
        for request_id, exc in self.claims.send().items():
            self._fail(self._reads[request_id], exc)
        self._plan_ahead()
        for request_id in self._done | set(self._failed):
            self._reads.pop(request_id, None)

    def _watch(self, reads: list[Read], deadline: float, now: float) -> None:
        """Look at each posted READ in turn until all are finished or ``deadline`` has
        passed (once each at least); a read still moving is checked against its bound."""
        moving = reads
        while moving:
            still = []
            for read in moving:
                try:
                    if not self._look(read):
                        still.append(read)
                except Exception as exc:
                    self._fail(read, exc)
            moving = still
            if time.monotonic() >= deadline:
                break
        for read in moving:
            try:
                what = ("did not finish" if read.phase is Phase.READ
                        else "arrived, but its scatter or digests did not finish")  # fmt: skip
                self._check_time(read, now, what)
            except Exception as exc:
                self._fail(read, exc)

    def _look(self, read: Read) -> bool:
        """One look at a posted READ: once NIXL says done, start what runs on the device
        after it; once the bytes are in place, free the staging slot (the digests read the
        blocks, not the slot); once decode's digests are taken too, check and finish the
        read (True)."""
        transfer = read.transfer
        assert transfer is not None
        if read.phase is Phase.READ:
            state = self.transport.state(transfer.handle)
            if state == "ERR":
                raise ReadFailed(f"NIXL READ from {read.order.params.remote_engine_id} failed")
            if state != "DONE":
                return False
            read.mark("arrived")
            self.lander.land(read)
        assert read.landing is not None
        if transfer.landed is None:
            if not read.landing.placed():
                return False
            transfer.landed = time.monotonic()
            self.lander.landed(read)
            read.mark("landed")
        if not read.landing.ready():
            return False
        self.lander.verify(read)
        if read.verified:
            read.mark("verified")
        failpoint("sink.before_report")
        self._finish(read)
        self._done.add(read.request_id)
        return True

    def _plan_ahead(self) -> None:
        """Plan the landing of each read whose claim is out (``Lander.plan_ahead``)."""
        for read in self._reads.values():
            if read.phase is not Phase.CLAIM or read.request_id in self._failed:
                continue
            try:
                p = read.order.params
                peer = self.peers.get(p.remote_host, p.remote_port, p.remote_engine_id)
                prefill = None if peer is None or peer.sliced else peer.topology  # may pack
                self.lander.plan_ahead(read, prefill)
            except Exception as exc:
                self._fail(read, exc)

    def _check_time(self, read: Read, now: float, what: str) -> None:
        transfer = read.transfer
        assert transfer is not None
        if now - transfer.started > self.settings.transfer_timeout_s:
            if read.landing is not None and read.landing.scatter is not None:
                read.landing.scatter.wait()  # it writes the request's blocks: let it end
            raise TransportError(
                f"NIXL READ from {read.order.params.remote_engine_id} {what} in "
                f"{self.settings.transfer_timeout_s:g} s"
            )

    def _fail(self, read: Read, exc: Exception) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        self._note_failure(read, exc)
        if self._abandon(read, exc):
            self._failed[read.request_id] = reason
        else:  # NIXL may still write into the request's blocks: not vLLM's yet
            assert read.transfer is not None
            self._draining[read.request_id] = (read.transfer.handle, reason)
            self._reads.pop(read.request_id, None)

    # -- phases ------------------------------------------------------------------------------

    def _start(self, read: Read) -> bool:
        """Take the read through PEER and CLAIM up to its READ; True if nothing had to move."""
        p = read.order.params
        if not any(read.order.local_ids):  # e.g. a full local prefix-cache hit: free prefill
            reason = "decode holds the whole prompt already (nothing to read)"
            self._release(read, reason)
            hit, _ = self._token_counts(read.order)
            self.records.append(
                TransferRecord(read.request_id, 0, 0, 0, 0.0, tokens_hit=hit, tokens_loaded=0)
            )
            return True
        peer = self.peers.get(p.remote_host, p.remote_port, p.remote_engine_id)
        if (
            peer is None
            or not self._trusted(peer, p)
            or not self.lanes.ready(peer, p.remote_host, p.remote_port)
        ):
            return False
        if read.plan is None:
            read.plan = self._plan(read.order, peer)
            read.phase = Phase.CLAIM
        if read.grant is None:
            grant = self.claims.grant(read)
            if grant is None:
                return False
            read.grant = grant
            read.mark("claimed")
        self._post(read, peer)
        return False

    def _trusted(self, peer: Peer, p: kv_params.RemotePrefillParams) -> bool:
        """``peer``'s agent names the endpoint decode asked (``transfer.device.nameplate``): its
        claims are answered by the engine whose memory is read. False while being read."""
        ref = peer.nameplate
        return self.nameplates.verified(
            peer.agent,
            None if ref is None else (ref.addr, ref.nbytes),
            destination(p.remote_engine_id, p.remote_host, p.remote_port),
        )

    def _plan(self, order: ReadOrder, peer: Peer) -> Plan:
        p = order.params
        local_ids, remote_ids = align_block_ids(
            order.local_ids,
            p.remote_block_ids,
            self.topology.groups,
            order.num_tokens,
            order.num_local_tokens,
            p.remote_num_tokens,
        )
        rows = transfer_descriptors(
            peer.plan, local_ids, remote_ids, self.topology.num_blocks, peer.topology.num_blocks
        )
        blocks = sum(len(ids) for ids in local_ids)
        # verify_kv digests whole blocks: a TP pairing that reads head slices goes unchecked
        # (``transfer.decode.shards`` refuses it when verify_kv was asked for explicitly)
        verify = self.digester is not None and not peer.sliced
        return Plan(local_ids, remote_ids, rows, blocks, verify)

    def _post(self, read: Read, peer: Peer) -> None:
        """Post the READ: packed (between the two staging slots, then a scatter) when
        prefill packed the request and there is room here, else block by block."""
        assert read.plan is not None and read.grant is not None
        local_rows, remote_rows = read.plan.rows
        local_kind, remote_kind = self.topology.mem_kind, peer.topology.mem_kind
        nbytes = int(local_rows[:, 1].sum())
        slot, packed = None, None
        ref = read.grant.packed
        if ref is not None and self.packer is not None and not peer.sliced:
            ahead = read.packed_ahead
            if ahead is not None and ahead.prefill_nbytes == ref.nbytes:
                packed = ahead.packed  # planned while the claim was out
            else:  # not planned, or for another size: plan now (and name a disagreement)
                read.scatter_plan = None
                packed = packed_read_of(
                    peer.topology, read.order.params.remote_block_ids, ref.nbytes, local_rows,
                    remote_rows,
                )  # fmt: skip
            slot = self.packer.staging.allocate(packed.nbytes)
            if slot is None:  # no room here: read the request's blocks directly
                packed = None
            else:
                staging = self.packer.staging
                local_rows = packed.rows(
                    packed.read_local, staging.addr + slot, staging.region.device_id
                )
                remote_rows = packed.rows(packed.read_remote, ref.addr, ref.device_id)
                local_kind = staging.region.mem_kind
                remote_kind = "DRAM" if ref.device_id < 0 else "VRAM"
        p = read.order.params
        note = protocol.notification(protocol.NOTIF_DONE, p.remote_request_id, read.order.token)
        try:
            handle = self.transport.prepare_read(
                peer.agent, local_rows, local_kind, remote_rows, remote_kind, note
            )
            read.mark("prepared")
            started = time.monotonic()
            self.transport.post(peer.agent, handle)
        except Exception:
            if slot is not None and self.packer is not None:
                self.packer.staging.release(slot)
            raise
        read.transfer = Transfer(handle, started, nbytes, len(local_rows), slot, packed)
        read.phase = Phase.READ
        read.mark("posted")
        self.lander.plan_scatter(read)  # if not planned ahead: while the bytes are on their way
        failpoint("sink.read_posted")

    def _finish(self, read: Read) -> None:
        t, plan, grant = read.transfer, read.plan, read.grant
        assert t is not None and plan is not None and grant is not None
        if t.handle is not None:
            self.transport.release(t.handle)
        self._created[read.request_id] = read.created
        hit, loaded = self._token_counts(read.order)
        self.records.append(
            TransferRecord(
                read.request_id,
                t.nbytes,
                t.descriptors,
                plan.blocks,
                (t.landed or time.monotonic()) - t.started,
                t.packed is not None,
                read.verified,
                grant.held_s,
                dict(read.marks),
                grant.answer_s,
                read.claims,
                dict(read.landing_host),
                tokens_hit=hit,
                tokens_loaded=loaded,
            )
        )

    def _token_counts(self, order: ReadOrder) -> tuple[int | None, int | None]:
        """(tokens decode held, tokens loaded) of an order (None: counts unknown)."""
        return token_counts(order.num_tokens, order.num_local_tokens, self.topology.groups)

    # -- failures ------------------------------------------------------------------------------

    def _note_failure(self, read: Read, error: Exception) -> None:
        """Count verification failures; evict a prefill that stopped answering or whose
        READ failed (its other requests then fail at once instead of each timing out)."""
        p = read.order.params
        if isinstance(error, VerificationError):
            self.counters["verify_failures"] += 1
            logger.error("%s", error)
        elif isinstance(error, PeerIdentityError):
            self.counters["refused_peers"] += 1
            logger.error("%s", error)
            self.peers.evict(p.remote_host, p.remote_port, error)
        elif isinstance(error, PeerNotLoaded):
            self.peers.forget(p.remote_host, p.remote_port)
        elif isinstance(error, ReadFailed | PeerDown | ProbeError):
            self.peers.evict(p.remote_host, p.remote_port, error)

    def _retry_stuck(self) -> None:
        """Staging slots, and requests whose READ into their blocks we gave up on, return
        only once NIXL lets go of the transfer."""
        for request_id, (handle, reason) in list(self._draining.items()):
            if self.transport.state(handle) != "PROC" and self.transport.release(handle):
                del self._draining[request_id]
                self._failed[request_id] = reason
                logger.warning("request %s: the abandoned READ has ended: blocks freed", request_id)
        for handle, slot in list(self._stuck):
            if self.transport.state(handle) != "PROC" and self.transport.release(handle):
                self._stuck.remove((handle, slot))
                assert self.packer is not None
                self.packer.staging.release(slot)

    def _abandon(self, read: Read, error: Exception) -> bool:
        """Release what we hold and tell prefill (if reachable) to free its blocks. False: a
        READ into the request's own blocks could not be released (NIXL may still be writing
        them), so they must not go back to vLLM yet."""
        released = True
        t = read.transfer
        if t is not None and t.slot is not None and self.packer is not None:
            if t.handle is not None and self.transport.state(t.handle) == "PROC":
                self._stuck.append((t.handle, t.slot))  # NIXL may still write into it
                t.handle = None
            else:
                self.packer.staging.release(t.slot)
            t.slot = None
        if t is not None and t.handle is not None:
            released = self.transport.release(t.handle)
        if isinstance(error, ClaimRefused):
            return released  # prefill decided: the blocks are another reader's (or not ours)
        p = read.order.params
        key = (p.remote_host, p.remote_port)
        peer = self.peers.known(key, p.remote_engine_id)
        if t is not None and peer is not None:
            # A READ reached prefill: UCX is wired up, a notification carries the news.
            token = read.order.token
            self.transport.notify(
                peer.agent, protocol.notification(protocol.NOTIF_ABORT, p.remote_request_id, token)
            )
        elif not isinstance(error, HandshakeError):
            # Failed before any READ (layouts or block counts differ, the lane probe
            # failed), maybe at first contact, when no UCX connection exists yet to carry a
            # notification: ask over the side channel, which answers. (A prefill that
            # cannot be reached is left to its lease.)
            self._release(read, f"{type(error).__name__}: {error}")
        return released

    def _release(self, read: Read, reason: str) -> None:
        """Ask prefill, on its own thread, to free the request's blocks (best effort: its
        lease frees them anyway)."""
        p = read.order.params
        key = (p.remote_host, p.remote_port)
        self.peers.submit(key, self.peers.release, key, p, read.order.token, reason)

    def close(self) -> None:
        self.peers.close()
        self.transport.close()
