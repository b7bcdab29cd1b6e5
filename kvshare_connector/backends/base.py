"""The interface every backend implements; the vLLM layer calls only this.

A backend is one way of getting a request's KV from prefill to decode (direct NIXL reads,
LMCache, ...). It has two halves, as the connector has: a scheduler side that decides, per
request, what the workers must do (hold blocks, load, store) and a worker side that does it
on the registered KV memory. Neither half sees a vLLM object: the vLLM layer
(``kvshare_connector.vllm``) turns vLLM's requests and scheduler output into the plain
values below, so a backend can be driven (and tested) without an engine.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from kvshare_connector.backends.options import ConnectorOptions
from kvshare_connector.layout.matching import EngineIdentity
from kvshare_connector.layout.topology import BlockIds, KVTopology
from kvshare_connector.transfer.device.records import LaneReport, TransferRecord
from kvshare_connector.transfer.wire.kv_params import RemotePrefillParams
from kvshare_connector.transfer.wire.settings import EngineSettings

if TYPE_CHECKING:
    import torch

    KVTensors = Mapping[str, torch.Tensor] | torch.Tensor  # per layer, or 0.26's cross-layer


def empty_block_ids(num_groups: int) -> BlockIds:
    return tuple([] for _ in range(num_groups))


@dataclass(frozen=True)
class SchedulerContext:
    """What a backend's scheduler side knows of its engine."""

    engine_id: str
    host: str  # side channel prefill serves on
    port: int
    tp_size: int
    block_sizes: Sequence[int]  # per KV cache group
    sliding_windows: Sequence[int | None]  # per KV cache group, None for full attention
    options: ConnectorOptions = field(default_factory=ConnectorOptions)

    @property
    def num_groups(self) -> int:
        return len(self.block_sizes)

    @property
    def window_blocks(self) -> list[int]:
        """Blocks of a sliding-window group that can still matter: the window, +1 for a
        window that straddles a block boundary (vLLM frees the rest before finishing)."""
        return [
            math.ceil(window / size) + 1 if window else 0
            for window, size in zip(self.sliding_windows, self.block_sizes, strict=True)
        ]

    def clip_to_windows(self, block_ids: BlockIds) -> BlockIds:
        """Keep only the blocks a sliding-window group still needs (the tail)."""
        return tuple(
            list(ids[-keep:]) if keep and len(ids) > keep else list(ids)
            for ids, keep in zip(block_ids, self.window_blocks, strict=True)
        )


@dataclass(frozen=True)
class DecodeRequest:
    """A decode request whose prompt KV comes from prefill, after vLLM allocated its blocks."""

    request_id: str
    params: RemotePrefillParams
    prompt_token_ids: Sequence[int]
    block_ids: BlockIds  # full tables from position 0, one per group
    new_block_ids: BlockIds  # the blocks not already filled from the local prefix cache
    num_external_tokens: int  # tokens to load (0: everything is cached locally)
    num_local_tokens: int  # tokens cached locally before the external ones


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's part of a scheduler step (the fields a store decision needs)."""

    request_id: str
    new_block_ids: BlockIds | None  # blocks added this step (all of them when resumed/new)
    restarted: bool  # new or resumed: new_block_ids are the whole tables
    num_computed_tokens: int
    num_scheduled_tokens: int
    prompt_token_ids: Sequence[int] | None  # given for new requests only


@dataclass(frozen=True)
class LoadOrder:
    """Scheduler -> worker: bring ``request_id``'s KV into ``local_block_ids``. Each backend
    adds what its workers need (``backends.nixl.RecvRequest``, ``backends.lmcache.LoadKV``)."""

    request_id: str
    local_block_ids: BlockIds


@dataclass(frozen=True)
class StoreOrder:
    """Scheduler -> worker, for backends that push KV out as it is computed: store the
    prompt ``token_ids``' KV from ``block_ids`` right after this step's forward."""

    request_id: str
    token_ids: list[int]
    block_ids: BlockIds  # full tables from position 0, one per group


@dataclass(frozen=True)
class PrefillResult:
    """What prefill keeps of a finished request and adds to ``kv_transfer_params``."""

    remote_block_ids: BlockIds
    hold: bool  # keep the blocks until decode reads them or the lease ends
    extra_params: Mapping[str, Any] = field(default_factory=dict)


class SchedulerBackend(ABC):
    """Scheduler side: per-request decisions, collected into each step's work orders."""

    # Decode loads into each KV cache group's blocks past that group's own prefix hit
    # (``DecodeRequest.new_block_ids``), so vLLM may give the groups different hits
    # (``vllm/prefix_hits.py``); a backend that loads tokens from one position in every
    # group (LMCache) says False.
    group_hits: ClassVar[bool] = False

    def __init__(self, context: SchedulerContext):
        self.context = context

    def prefill_admitted(self, request_id: str) -> None:
        """A prefill request (``do_remote_decode``) got its blocks (default: nothing to do)."""
        return None

    @abstractmethod
    def decode_allocated(self, request: DecodeRequest) -> LoadOrder | None:
        """Return the load order to hand the worker (None: nothing to do)."""

    def decode_aborted(self, request_id: str, params: RemotePrefillParams) -> LoadOrder | None:
        """Decode dropped a request before loading it: an order that frees prefill's blocks."""
        return None

    @abstractmethod
    def prefill_finished(self, request_id: str, block_ids: BlockIds) -> PrefillResult:
        """A prefill request finished normally: what to hold and what decode needs."""

    def needs_steps(self) -> bool:
        return False

    def stores(self, step: Sequence[ScheduledRequest]) -> list[StoreOrder]:
        """Store orders for this step (backends that push KV somewhere as it is computed)."""
        return []

    def forget(self, request_id: str) -> None:
        """The request left the engine (default: nothing to forget)."""
        return None


@dataclass
class WorkerProgress:
    """What the worker side finished since the last poll."""

    sent: set[str] = field(default_factory=set)  # prefill: decode has the KV, blocks freed
    expired: set[str] = field(default_factory=set)  # prefill: lease ran out, blocks freed
    loaded: set[str] = field(default_factory=set)  # decode: KV is in place
    failed: dict[str, str] = field(default_factory=dict)  # decode: request id -> reason
    records: list[TransferRecord] = field(default_factory=list)  # finished reads, for stats
    lanes: list[LaneReport] = field(default_factory=list)  # lane probes measured, for stats
    counters: dict[str, int] = field(default_factory=dict)  # stats counters to add


@dataclass(frozen=True)
class WorkerContext:
    """What a backend's worker side knows of its engine, and the options it runs with."""

    engine_id: str
    role: str  # kv_producer / kv_consumer / kv_both
    host: str
    port: int  # this worker's side channel (TP: the base port + its rank)
    model_name: str
    options: ConnectorOptions = field(default_factory=ConnectorOptions)
    engine_identity: EngineIdentity | None = None  # model, dtypes, block size, vLLM version
    tp_size: int = 1  # TP: this engine's size and this worker's rank
    tp_rank: int = 0
    model_kv_heads: int = 0  # the model's KV heads before the TP split (0: unknown)
    bind_host: str | None = None  # prefill: where its side channel listens, if not ``host``

    @property
    def produces(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    def settings(self) -> EngineSettings:
        """What the transfer layer needs of this engine and its options."""
        o = self.options
        return EngineSettings(
            engine_id=self.engine_id,
            host=self.host,
            bind_host=self.bind_host,
            port=self.port,
            lease_s=o.kv_lease_duration,
            handshake_timeout_s=o.handshake_timeout_s,
            transfer_timeout_s=o.transfer_timeout_s,
            secret=o.secret,
            insecure=o.side_channel_insecure,
            identity=self.engine_identity,
            allowed_prefills=frozenset(o.allowed_prefills) if o.allowed_prefills else None,
            verify_required=o.verify_kv is True,
        )


class WorkerBackend(ABC):
    """Worker side: owns the transfer machinery for the registered KV memory."""

    def __init__(self, context: WorkerContext):
        self.context = context

    @abstractmethod
    def start(self, topology: KVTopology, tensors: KVTensors) -> str:
        """Register the owners' KV memory; return a line describing it for the log."""

    @abstractmethod
    def start_loads(self, orders: Sequence[LoadOrder]) -> dict[str, str]:
        """Begin these load orders; return the requests that failed at once, with reasons."""

    def hold(self, holds: Mapping[str, BlockIds]) -> None:
        """Keep these requests' blocks for decode (request id -> block ids per group, under
        the engine's lease); backends that hold nothing on prefill ignore it."""
        return None

    def save(self, orders: Sequence[StoreOrder]) -> int:
        """Carry out this step's store orders (after the forward); return how many."""
        return 0

    @abstractmethod
    def poll(self) -> WorkerProgress:
        """Advance transfers; called every step."""

    def in_flight(self) -> set[str]:
        """Requests still being loaded."""
        return set()

    def nudge(self) -> None:
        """Called inside the forward, at every attention layer: take transfers in flight
        further if that is cheap (never waits, never raises). Default: nothing."""
        return None

    @abstractmethod
    def close(self) -> None: ...


class Backend(ABC):
    """A backend's options and its two halves; the factory maps the ``backend`` option to one.

    Options are checked in the constructor, in both the scheduler's and the workers'
    processes, so bad options fail at engine start rather than on the first request.
    """

    name: ClassVar[str]

    def __init__(self, options: ConnectorOptions):
        self.options = options

    @abstractmethod
    def scheduler_side(self, context: SchedulerContext) -> SchedulerBackend: ...

    @abstractmethod
    def worker_side(self, context: WorkerContext) -> WorkerBackend: ...
