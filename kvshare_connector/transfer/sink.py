"""Decode side of the pull transfer: handshake with prefill, claim a request, READ its blocks.

No vLLM here: the connector's worker drives ``KVSink``. All NIXL calls happen on the caller's
thread (NIXL agents are not thread-safe by default); only the side-channel ask runs in a
helper thread so a slow or dead prefill never blocks the engine loop.
"""

import secrets
import time
from collections import Counter
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field

import numpy as np

from kvshare_connector.common.log import get_logger
from kvshare_connector.layout.descriptors import BlockIds, transfer_descriptors
from kvshare_connector.layout.matching import EngineIdentity, LayoutMismatch
from kvshare_connector.layout.staging import PackedRead, packed_read_of
from kvshare_connector.layout.topology import KVTopology
from kvshare_connector.layout.verification import VerificationError, compare
from kvshare_connector.transfer import protocol
from kvshare_connector.transfer.alignment import align_block_ids
from kvshare_connector.transfer.digests import Digester
from kvshare_connector.transfer.nixl import NixlTransport, TransportError
from kvshare_connector.transfer.packing import Packer
from kvshare_connector.transfer.peers import HandshakeError, Pairing, Peer, Peers
from kvshare_connector.transfer.side_channel import SideChannelError, warn_if_no_secret

logger = get_logger(__name__)

SPIN_S = 0.002  # how long a poll watches READs it just posted (see ``KVSink.poll``)


class ReadFailed(TransportError):
    """NIXL reported a READ failed (the peer died or its memory went away)."""


class PeerDown(HandshakeError):
    """Prefill did not answer a claim (dead, or unreachable)."""


class ClaimRefused(HandshakeError):
    """Prefill refused this decode's claim (another reader, or blocks it does not hold)."""


@dataclass(frozen=True)
class TransferRecord:
    """One finished read, for stats."""

    request_id: str
    bytes: int
    descriptors: int
    blocks: int
    seconds: float  # posted -> bytes in place (the scatter included when packed)
    packed: bool = False  # moved as a few large runs through the staging areas
    verified: int = 0  # layer-blocks whose digest matched prefill's (``verify_kv``)


@dataclass
class _Read:
    request_id: str
    params: protocol.RemotePrefillParams
    local_ids: BlockIds
    num_tokens: int | None = None  # decode's prompt length (None: a tool, counts unknown)
    num_local_tokens: int = 0  # of which decode had cached locally
    token: str = field(default_factory=lambda: secrets.token_hex(16))  # claim token
    rows: tuple[np.ndarray, np.ndarray] | None = None  # (local, remote) READ descriptors
    remote_ids: list[list[int]] | None = None  # the remote blocks it will read
    created: float = field(default_factory=time.monotonic)
    handle: object | None = None
    started: float = 0.0
    nbytes: int = 0
    descriptors: int = 0
    blocks: int = 0
    claim: Future[protocol.ClaimReply] | None = None
    claimed: bool = False
    next_claim: float = 0.0
    packed_ref: protocol.PackedRef | None = None  # where prefill packed it, if it did
    slot: int | None = None  # our staging slot, while a packed read uses it
    plan: PackedRead | None = None  # packed: what to READ and then copy out of the slot
    local_read: list[list[int]] | None = None  # local blocks paired with ``remote_ids``
    digests: protocol.KVDigests | None = None  # prefill's, when verifying
    verified: int = 0
    readers: int = 1  # TP: decode ranks that read this request from this prefill rank


class KVSink:
    """Decode side: handshakes with prefill engines and reads requests' blocks from them.

    With ``verify`` (``verify_kv``), a request counts as loaded only once decode's digests
    of its blocks, taken after the READ, equal the ones prefill took when it held them.
    """

    def __init__(
        self,
        engine_id: str,
        topology: KVTopology,
        transport: NixlTransport,
        handshake_timeout_s: float = 10.0,
        transfer_timeout_s: float = 60.0,
        identity: EngineIdentity | None = None,
        secret: bytes | None = None,
        packer: Packer | None = None,
        digester: Digester | None = None,
        pairing: Pairing | None = None,
    ):
        self.engine_id = engine_id
        self.topology = topology
        self.transport = transport
        self.packer = packer  # set: read packed requests into a staging slot, then scatter
        self.digester = digester  # set: verify every read against prefill's digests
        self._stuck: list[tuple[object, int]] = []  # (handle, slot) of READs we gave up on
        self.handshake_timeout_s = handshake_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        warn_if_no_secret(secret)
        transport.register(topology.regions)
        if packer is not None:
            transport.register([packer.staging.region])
        self.peers = Peers(
            engine_id, topology, transport, handshake_timeout_s, identity, secret, pairing=pairing
        )
        self._reads: dict[str, _Read] = {}
        self._done: set[str] = set()  # finished since the last poll
        self._failed: dict[str, str] = {}
        self._draining: dict[str, tuple[object, str]] = {}  # failed, NIXL not yet let go
        self.records: list[TransferRecord] = []
        self.counters = Counter[str]()  # verify_failures, for stats

    # -- claims --------------------------------------------------------------------------

    def _ask_claim(self, read: _Read) -> protocol.ClaimReply:
        p = read.params
        host, port, request_id = p.remote_host, p.remote_port, p.remote_request_id
        claim = protocol.Claim(
            protocol.PROTOCOL_VERSION,
            self.engine_id,
            [request_id],
            self.transfer_timeout_s + 5,
            token=read.token,
            block_ids={request_id: read.remote_ids or []},
            packed=self.packer is not None,
            verify=self.digester is not None,
            readers=read.readers,
        )
        try:
            reply = self.peers.ask((host, port), claim)
        except SideChannelError as exc:
            raise PeerDown(f"claiming {request_id} at {host}:{port}: {exc}") from exc
        except protocol.ProtocolError as exc:
            raise ClaimRefused(
                f"prefill at {host}:{port} answered a claim with garbage: {exc}"
            ) from exc
        if isinstance(reply, protocol.ErrorReply):
            raise ClaimRefused(f"prefill at {host}:{port} refused the claim: {reply.message}")
        if not isinstance(reply, protocol.ClaimReply):
            raise ClaimRefused(f"prefill at {host}:{port} answered a claim with {reply}")
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
                key = (p.remote_host, p.remote_port)
                read.claim = self.peers.submit(key, self._ask_claim, read)
            return False
        if not read.claim.done():
            return False
        future, read.claim = read.claim, None
        try:
            reply = future.result()
        except CancelledError:
            raise HandshakeError(
                f"prefill {p.remote_engine_id} was evicted before the claim of request "
                f"{p.remote_request_id} could be asked"
            ) from None
        rid = p.remote_request_id
        if rid in reply.refused:
            raise ClaimRefused(
                f"prefill {p.remote_engine_id} refused the claim of request {rid}: "
                f"{reply.refused[rid]}"
            )
        if rid in reply.held:
            if self.digester is not None and rid not in reply.digests:
                raise VerificationError(
                    f"prefill {p.remote_engine_id} sent no KV digests for request {rid}: "
                    "verify_kv must be on for prefill too"
                )
            read.claimed = True
            read.packed_ref = reply.packed.get(rid)
            read.digests = reply.digests.get(rid)
            return True
        if rid in reply.gone:
            raise TransportError(
                f"prefill {p.remote_engine_id} no longer holds request {rid}'s blocks (read "
                "already, or its lease expired)"
            )
        if time.monotonic() - read.created > self.handshake_timeout_s:
            raise HandshakeError(
                f"prefill {p.remote_engine_id} never held request {rid} within "
                f"{self.handshake_timeout_s:g} s"
            )
        read.next_claim = time.monotonic() + 0.01
        return False

    # -- reads ---------------------------------------------------------------------------

    def request(
        self,
        request_id: str,
        params: protocol.RemotePrefillParams,
        local_ids: BlockIds,
        num_tokens: int | None = None,
        num_local_tokens: int = 0,
        token: str | None = None,
        readers: int = 1,
    ) -> None:
        """Queue a read of ``params.remote_block_ids`` into ``local_ids`` (per group).

        ``num_tokens`` (decode's prompt length) and ``num_local_tokens`` (cached locally)
        let the sink check the exact block counts (``alignment``); without them, the
        counts must be equal. TP (``transfer.shards``): the decode ranks reading one
        prefill rank share ``token`` and say how many ``readers`` they are.
        """
        if request_id in self._reads:
            raise ValueError(f"request {request_id} is already being read")
        read = _Read(
            request_id, params, [list(ids) for ids in local_ids], num_tokens, num_local_tokens
        )
        read.token, read.readers = token or read.token, readers
        self._reads[request_id] = read

    @property
    def in_flight(self) -> set[str]:
        return set(self._reads) | set(self._draining)

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

    def advance(self, spin_s: float = 0.0) -> None:
        """Move every read as far as it goes now (handshake, claim, READ, scatter); called
        when requests arrive too, so their claims are under way before the step ends."""
        now = time.monotonic()
        deadline = now + spin_s
        for read in list(self._reads.values()):
            try:
                if read.handle is None:
                    if now - read.created > self.handshake_timeout_s + self.transfer_timeout_s:
                        raise HandshakeError("timed out waiting for the prefill handshake")
                    if self._start(read):
                        self._done.add(read.request_id)
                        continue
                    if read.handle is None:
                        continue
                state = self.transport.state(read.handle)
                while state == "PROC" and time.monotonic() < deadline:
                    state = self.transport.state(read.handle)
                if state == "DONE":
                    self._landed(read)
                    self._verify(read)
                    self._finish(read)
                    self._done.add(read.request_id)
                elif state == "ERR":
                    raise ReadFailed(f"NIXL READ from {read.params.remote_engine_id} failed")
                elif now - read.started > self.transfer_timeout_s:
                    raise TransportError(
                        f"NIXL READ from {read.params.remote_engine_id} did not finish in "
                        f"{self.transfer_timeout_s:g} s"
                    )
            except Exception as exc:  # every failure ends this request only
                reason = f"{type(exc).__name__}: {exc}"
                self._note_failure(read, exc)
                if self._abandon(read, exc):
                    self._failed[read.request_id] = reason
                else:  # NIXL may still write into the request's blocks: not vLLM's yet
                    self._draining[read.request_id] = (read.handle, reason)
                    self._reads.pop(read.request_id, None)
        for request_id in self._done | set(self._failed):
            self._reads.pop(request_id, None)

    def _start(self, read: _Read) -> bool:
        """Start the READ once the peer is known; True if nothing had to move."""
        p = read.params
        peer = self.peers.get(p.remote_host, p.remote_port, p.remote_engine_id)
        if peer is None:
            return False
        if read.rows is None:
            if not any(read.local_ids):  # e.g. a full local prefix-cache hit: free prefill
                note = protocol.notification(protocol.NOTIF_DONE, p.remote_request_id)
                self.transport.notify(peer.agent, note)
                self.records.append(TransferRecord(read.request_id, 0, 0, 0, 0.0))
                return True
            local_ids, read.remote_ids = align_block_ids(
                read.local_ids,
                p.remote_block_ids,
                self.topology.groups,
                read.num_tokens,
                read.num_local_tokens,
                p.remote_num_tokens,
            )
            read.blocks = sum(len(ids) for ids in local_ids)
            read.local_read = local_ids
            # Before the claim: block ids out of range fail here, not at prefill.
            read.rows = transfer_descriptors(
                peer.plan,
                local_ids,
                read.remote_ids,
                self.topology.num_blocks,
                peer.topology.num_blocks,
            )
        if not self._claimed(read):
            return False
        local_rows, remote_rows = read.rows
        local_kind, remote_kind = _kind(self.topology), _kind(peer.topology)
        read.nbytes = int(local_rows[:, 1].sum())
        if read.packed_ref is not None and self.packer is not None and not peer.sliced:
            packed = self._packed_rows(read, peer, local_rows, remote_rows)
            if packed is not None:
                local_rows, remote_rows = packed
                local_kind = self.packer.staging.region.mem_kind
                remote_kind = "DRAM" if read.packed_ref.device_id < 0 else "VRAM"
        note = protocol.notification(protocol.NOTIF_DONE, p.remote_request_id, read.token)
        read.descriptors = len(local_rows)
        read.started = time.monotonic()
        read.handle = self.transport.read(
            peer.agent, local_rows, local_kind, remote_rows, remote_kind, note
        )
        return False

    def _packed_rows(
        self, read: _Read, peer: Peer, local_rows: np.ndarray, remote_rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """READ rows between the two staging slots (None: no room here, read directly)."""
        assert self.packer is not None and read.packed_ref is not None
        ref = read.packed_ref
        plan = packed_read_of(
            peer.topology, read.params.remote_block_ids, ref.nbytes, local_rows, remote_rows
        )
        slot = self.packer.staging.allocate(plan.nbytes)
        if slot is None:
            return None
        read.slot, read.plan = slot, plan
        local = plan.rows(
            plan.read_local, self.packer.staging.addr + slot, self.packer.staging.region.device_id
        )
        return local, plan.rows(plan.read_remote, ref.addr, ref.device_id)

    def _landed(self, read: _Read) -> None:
        """After the READ: a packed request is scattered into its blocks (a few copy
        kernels, waited for here: reporting it one step later would cost a whole step)."""
        if read.plan is not None and self.packer is not None and read.slot is not None:
            self.transport.release(read.handle)
            read.handle = None
            s = read.plan.scatter
            self.packer.scatter(s[:, 0], s[:, 2], read.slot + s[:, 1]).wait()
            self.packer.staging.release(read.slot)
            read.slot = None

    def _verify(self, read: _Read) -> None:
        """``verify_kv``: decode's blocks, as vLLM will read them, against prefill's digests."""
        if self.digester is None:
            return
        assert read.digests is not None and read.local_read is not None
        local = self.digester.start(self.topology, read.local_read).result()
        remote = {n: np.frombuffer(v, dtype="<u8") for n, v in read.digests.layers.items()}
        compared, found = compare(
            self.topology,
            read.local_read,
            read.remote_ids or [],
            local,
            read.digests.block_ids,
            remote,
        )
        if found:
            raise VerificationError(
                f"request {read.request_id}: its KV differs from what prefill "
                f"{read.params.remote_engine_id} computed: " + "; ".join(found)
            )
        read.verified = compared

    def _note_failure(self, read: _Read, error: Exception) -> None:
        """Count verification failures; evict a prefill that stopped answering or whose
        READ failed (its other requests then fail at once instead of each timing out)."""
        p = read.params
        if isinstance(error, VerificationError):
            self.counters["verify_failures"] += 1
            logger.error("%s", error)
        elif isinstance(error, ReadFailed | PeerDown):
            self.peers.evict(p.remote_host, p.remote_port, error)

    def _finish(self, read: _Read) -> None:
        if read.handle is not None:
            self.transport.release(read.handle)
        self.records.append(
            TransferRecord(
                read.request_id,
                read.nbytes,
                read.descriptors,
                read.blocks,
                time.monotonic() - read.started,
                read.plan is not None,
                read.verified,
            )
        )

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
                self.packer.staging.release(slot)

    def _abandon(self, read: _Read, error: Exception) -> bool:
        """Release what we hold and tell prefill (if reachable) to free its blocks. False: a
        READ into the request's own blocks could not be released (NIXL may still be writing
        them), so they must not go back to vLLM yet."""
        released = True
        if read.slot is not None and self.packer is not None:
            if read.handle is not None and self.transport.state(read.handle) == "PROC":
                self._stuck.append((read.handle, read.slot))  # NIXL may still write into it
                read.handle = None
            else:
                self.packer.staging.release(read.slot)
        if read.handle is not None:
            released = self.transport.release(read.handle)
        p = read.params
        key = (p.remote_host, p.remote_port)
        peer = self.peers.known(key, p.remote_engine_id)
        if isinstance(error, ClaimRefused):
            return released  # prefill decided: the blocks are another reader's (or not ours)
        if peer is not None:
            token = read.token if read.rows is not None else ""
            note = protocol.notification(protocol.NOTIF_ABORT, p.remote_request_id, token)
            self.transport.notify(peer.agent, note)
        elif isinstance(error, LayoutMismatch):  # prefill answers, but is no NIXL peer
            reason = "KV layouts do not match: " + "; ".join(error.differences[:3])
            self.peers.submit(key, self._ask_release, p, reason)
        return released

    def _ask_release(self, p: protocol.RemotePrefillParams, reason: str) -> None:
        """Best effort: prefill's lease frees the blocks anyway if this does not arrive."""
        release = protocol.Release(
            protocol.PROTOCOL_VERSION, self.engine_id, [p.remote_request_id], reason
        )
        try:
            self.peers.ask((p.remote_host, p.remote_port), release)
        except (SideChannelError, protocol.ProtocolError) as exc:
            logger.warning(
                "could not ask prefill %s to free request %s: %s",
                p.remote_engine_id,
                p.remote_request_id,
                exc,
            )

    def close(self) -> None:
        self.peers.close()
        self.transport.close()


def _kind(topology: KVTopology) -> str:
    kinds = {r.mem_kind for r in topology.regions}
    if len(kinds) != 1:
        raise TransportError(f"KV regions span memory kinds {sorted(kinds)}")
    return kinds.pop()
