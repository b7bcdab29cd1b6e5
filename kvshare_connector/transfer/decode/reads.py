"""A decode read's explicit phases and the record each phase adds.

PEER: waiting for prefill's handshake and lane probe. CLAIM: the ``Plan`` is made (which
blocks pair, the descriptors) and prefill is asked to keep the blocks for this reader (the
step's claims to one prefill go in one message: ``claim_batches``); its answer is the
``Grant``; while it is out, decode plans the landing (``PackedAhead``, the scatter's and the
digests' index plans). READ: the ``Transfer`` is posted to NIXL. LAND: the bytes arrived;
the scatter (packed) and decode's digests (``verify_kv``) run on the device, watched
without blocking; then the digests are compared and the read ends done, or failed at any
phase.
"""

from __future__ import annotations

import enum
import secrets
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvshare_connector.layout.staging import PackedRead
from kvshare_connector.layout.topology import BlockIds
from kvshare_connector.transfer.device.digests import DigestPlan, PendingDigests
from kvshare_connector.transfer.device.packing import Copy, CopyPlan
from kvshare_connector.transfer.wire import kv_params, protocol


class Phase(enum.Enum):
    PEER = "peer"  # waiting for prefill's handshake and lane probe
    CLAIM = "claim"  # asked prefill to keep the blocks for this reader
    READ = "read"  # READ posted to NIXL
    LAND = "land"  # the READ is done: scatter and digests running on the device


@dataclass(frozen=True)
class ReadOrder:
    """Read ``params.remote_block_ids`` into ``local_ids`` (per group)."""

    request_id: str
    params: kv_params.RemotePrefillParams
    local_ids: BlockIds
    num_tokens: int | None = None  # decode's prompt length (None: a tool, counts unknown)
    # of which decode had cached locally: one for every KV cache group, or one per group
    num_local_tokens: int | tuple[int, ...] = 0
    token: str = field(default_factory=lambda: secrets.token_hex(16))  # claim token
    readers: int = 1  # TP: decode ranks that read this request from this prefill rank


@dataclass(frozen=True)
class Plan:
    """What the read moves, decided once the peer is known (before the claim: block ids
    out of range fail here, not at prefill)."""

    local_ids: list[list[int]]  # decode's blocks, paired with ``remote_ids``
    remote_ids: list[list[int]]
    rows: tuple[np.ndarray, np.ndarray]  # (local, remote) block-by-block descriptors
    blocks: int
    verify: bool = False  # verify_kv applies (whole blocks: not a TP head-slice pairing)


@dataclass(frozen=True)
class Grant:
    """Prefill's answer to the claim."""

    packed: protocol.PackedRef | None  # where prefill packed the request, if it did
    digests: protocol.KVDigests | None  # prefill's, when verifying
    held_s: float | None  # how long prefill held it before the claim came
    answer_s: float | None = None  # how long prefill took to answer the claim


@dataclass(frozen=True)
class PackedAhead:
    """A packed READ planned while the claim was out, in case prefill packs the request;
    it holds if prefill's grant reports ``prefill_nbytes`` (else the post plans again and
    names the disagreement)."""

    prefill_nbytes: int  # the size of prefill's packed request this plan expects
    packed: PackedRead


@dataclass
class Transfer:
    """The READ in flight."""

    handle: Any
    started: float
    nbytes: int
    descriptors: int
    slot: int | None = None  # our staging slot, while a packed read uses it
    packed: PackedRead | None = None  # packed: what to READ and then copy out of the slot
    landed: float | None = None  # when its bytes were seen in place (monotonic)


@dataclass(frozen=True)
class Landing:
    """What runs on the device once the READ is done: each ``None`` when not needed."""

    scatter: Copy | None  # packed: the staging slot into the request's blocks
    digests: PendingDigests | None  # verify_kv: decode's digests of its blocks

    def placed(self) -> bool:
        """The bytes are in the request's blocks (the scatter, when packed, is done)."""
        return self.scatter is None or self.scatter.done()

    def ready(self) -> bool:
        """Placed, and decode's digests of the blocks taken."""
        return self.placed() and (self.digests is None or self.digests.ready())


@dataclass
class Read:
    order: ReadOrder
    phase: Phase = Phase.PEER
    created: float = field(default_factory=time.monotonic)
    plan: Plan | None = None
    claim: Future[protocol.ClaimReply] | None = None  # the claim's answer, while asked
    next_claim: float = 0.0  # "not held yet": ask again from then
    claims: int = 0  # claims sent for it (a "not held yet" answer, or a busy peer: again)
    grant: Grant | None = None
    transfer: Transfer | None = None
    landing: Landing | None = None
    digest_plan: DigestPlan | None = None  # verify_kv: planned while the claim is out
    packed_ahead: PackedAhead | None = None  # packed: planned while the claim is out
    scatter_plan: CopyPlan | None = None  # packed: its scatter's (offsets in the slot)
    verified: int = 0
    marks: dict[str, float] = field(default_factory=dict)  # phase -> s since created
    landing_host: dict[str, float] = field(default_factory=dict)  # TransferRecord's

    @property
    def request_id(self) -> str:
        return self.order.request_id

    @property
    def local_read(self) -> list[list[int]] | None:
        return self.plan.local_ids if self.plan is not None else None

    def mark(self, phase: str) -> None:
        self.marks[phase] = round(time.monotonic() - self.created, 6)

    def lap(self, part: str, since: float) -> float:
        """Note the host seconds ``part`` of the landing took since ``since`` (a
        ``perf_counter`` reading); the clock now."""
        now = time.perf_counter()
        self.note(part, now - since)
        return now

    def note(self, part: str, seconds: float) -> None:
        """Note the host seconds of ``part`` of the landing (the read log's ``landing_host``)."""
        self.landing_host[part] = round(seconds, 6)


def claim_batches(reads: list[Read]) -> list[list[Read]]:
    """``reads`` cut into claims: one per prefill (same address, engine, TP readers and
    verification), each within the per-message caps and naming a remote request id once."""
    done: list[list[Read]] = []
    open_: dict[tuple[Any, ...], tuple[list[Read], set[str], int]] = {}
    for read in reads:
        p = read.order.params
        verify = read.plan is not None and read.plan.verify
        key = (p.remote_host, p.remote_port, p.remote_engine_id, read.order.readers, verify)
        blocks = sum(len(ids) for ids in p.remote_block_ids)
        batch, named, total = open_.get(key, ([], set(), 0))
        if batch and (
            len(batch) >= protocol.MAX_IDS_PER_MESSAGE
            or total + blocks > protocol.MAX_BLOCK_IDS_PER_MESSAGE
            or p.remote_request_id in named
        ):
            done.append(batch)
            batch, named, total = [], set(), 0
        batch.append(read)
        named.add(p.remote_request_id)
        open_[key] = (batch, named, total + blocks)
    return done + [batch for batch, _, _ in open_.values()]
