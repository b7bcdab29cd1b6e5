"""What the transfer layer reports upward: finished reads with their timeline, measured
lanes, and one poll's progress. Plain frozen records: the backend and the vLLM layer read
them, stats and the read log serialise them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# A read's phases, in order (``TransferRecord.timeline``: seconds since the order came):
# asked: the first claim left (the handshake and lane probe before it, when new);
# claimed: prefill answered the claim (lease extended, packed slot and digests named);
# prepared: NIXL's request for the READ is made (descriptor lists and the backend's
# preparation: claimed -> prepared includes them), and the post begins; posted: the post
# returned (prepared -> posted: NIXL's post call, which over shared memory moves bytes);
# arrived: NIXL said it is done; launched: the
# scatter and decode's digests are queued on the device (arrived -> launched is the host's
# share of the landing, launched -> landed the device's and the wait until decode looks);
# landed: its bytes are in decode's blocks (after the scatter, when packed; the staging
# slot is free again); verified: decode's digests of the blocks were taken and matched
# prefill's (verify_kv); reported: the engine learned the load is done (the poll that
# returned it).
PHASES = (
    "asked",
    "claimed",
    "prepared",
    "posted",
    "arrived",
    "launched",
    "landed",
    "verified",
    "reported",
)


@dataclass(frozen=True)
class TransferRecord:
    """One finished read, for stats and the read log."""

    request_id: str
    bytes: int
    descriptors: int
    blocks: int
    # the post's start (NIXL's post call, after its request was prepared) -> bytes in place,
    # the scatter included when packed
    seconds: float
    packed: bool = False  # moved as a few large runs through the staging areas
    verified: int = 0  # layer-blocks whose digest matched prefill's (``verify_kv``)
    # prefill held the request this long before decode's claim reached it (None: unknown)
    prefill_held_s: float | None = None
    timeline: dict[str, float] = field(default_factory=dict)  # phase -> s since the order
    # prefill's own share of the claim: from its arrival to the answer (None: unknown)
    prefill_answer_s: float | None = None
    claims: int = 1  # claims sent before prefill held the request for this reader
    # decode's host seconds of the landing (arrived -> launched), by part: "release" (NIXL's
    # handle), "scatter" and "digests" (verify_kv) launched; and, off the load's path,
    # "digest_plan" and "scatter_plan" (made while the claim was out; the scatter's at the
    # post when prefill packed another size than planned)
    landing_host: dict[str, float] = field(default_factory=dict)
    # the prompt's tokens decode's prefix cache held (its full-attention hit: not read) and
    # the tokens this load brought (None: a tool that gave no token counts)
    tokens_hit: int | None = None
    tokens_loaded: int | None = None

    def reported(self, created: float | None, now: float) -> TransferRecord:
        """This record with the moment the engine learned of it (``now``, monotonic) on its
        timeline, counted from the read's creation."""
        if created is None:
            return self
        return replace(self, timeline={**self.timeline, "reported": round(now - created, 6)})


@dataclass(frozen=True)
class LaneReport:
    """One prefill's lane probe: what a READ of ``nbytes`` took, and the lane that took it."""

    peer: str  # prefill engine id
    address: str  # host:port of its side channel
    nbytes: int
    seconds: float  # the fastest timed READ, posted -> seen done
    gbps: float
    lane: str  # tcp, rdma, cuda_ipc, shm/cma (``lanes.verdict``)
    slow: bool
    fix: str | None
    reads: int = 1  # timed READs made (more than ``TIMED_READS`` when the lane read slow)
    spread_s: float = 0.0  # from the first timed READ to the verdict
    where: str = ""  # what carried the bytes: interface and socket ends, RDMA port, machine
    ucx: dict[str, str] = field(default_factory=dict)  # decode's UCX_* settings in force
    peer_ucx: dict[str, str] = field(default_factory=dict)  # prefill's, from its handshake


@dataclass(frozen=True)
class SinkProgress:
    """What decode's reads did since the last poll."""

    done: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> reason
    records: list[TransferRecord] = field(default_factory=list)
    lanes: list[LaneReport] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)  # verify_failures
