"""Backend ``lmcache``'s two halves: prefill stores each prompt's KV in LMCache, decode loads it.

Prefill (``do_remote_decode``): the scheduler side follows each request's block tables
through the steps and orders a ``StoreKV`` in the step that computes the last prompt token;
the worker stores right after that forward (``save``), so the KV is in LMCache before the
first token returns and prefill holds no blocks for decode (no lease). Decode
(``do_remote_prefill``): a ``LoadKV`` with the full block tables, loaded synchronously by
the worker before the request is scheduled. A failed store only means decode misses and
computes the prompt itself; a failed load takes the connector's failed-load route.

Importing this module does not import LMCache: the worker side imports ``store`` when it
starts, and the options are parsed (with LMCache's option names) in the constructor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvshare_connector.backends.base import (
    Backend,
    DecodeRequest,
    LoadOrder,
    PrefillResult,
    ScheduledRequest,
    SchedulerBackend,
    SchedulerContext,
    StoreOrder,
    WorkerBackend,
    WorkerContext,
    WorkerProgress,
)
from kvshare_connector.backends.lmcache.config import (
    BACKEND_NAME,
    LMCacheBackendConfig,
    default_model_tag,
)
from kvshare_connector.backends.options import ConnectorOptions
from kvshare_connector.common.log import get_logger
from kvshare_connector.layout.topology import BlockIds, KVTopology
from kvshare_connector.transfer.wire.kv_params import RemotePrefillParams

if TYPE_CHECKING:
    from kvshare_connector.backends.lmcache.store import LMCacheStore

logger = get_logger(__name__)


StoreKV = StoreOrder  # prefill: this step computes the prompt's last token; store it after


@dataclass(frozen=True)
class LoadKV(LoadOrder):
    """Decode: load the prompt's KV into ``local_block_ids`` (full tables from position 0,
    null block 0 kept)."""

    token_ids: list[int]
    num_computed_tokens: int  # tokens cached locally before the external ones


@dataclass
class _PendingStore:
    """A prefill request's block tables, followed through the steps until the one that
    computes its last prompt token, and its prompt (sent only in its first step)."""

    tables: list[list[int]] | None = None
    prompt: list[int] = field(default_factory=list)


class LMCacheScheduler(SchedulerBackend):
    """Store orders for prefill requests, load orders for decode requests."""

    def __init__(self, context: SchedulerContext, name: str):
        super().__init__(context)
        self.name = name
        self._pending: dict[str, _PendingStore] = {}

    def prefill_admitted(self, request_id: str) -> None:
        self._pending.setdefault(request_id, _PendingStore())  # tables come with the step

    def needs_steps(self) -> bool:
        return bool(self._pending)

    def stores(self, step: Sequence[ScheduledRequest]) -> list[StoreKV]:
        """Store orders for the requests whose last prompt token this step computes (the
        worker stores right after that forward, before the first token goes out)."""
        orders = []
        for scheduled in step:
            pending = self._pending.get(scheduled.request_id)
            if pending is None:
                continue
            if scheduled.new_block_ids is not None:
                if pending.tables is None or scheduled.restarted:
                    pending.tables = [list(ids) for ids in scheduled.new_block_ids]
                else:
                    for table, ids in zip(pending.tables, scheduled.new_block_ids, strict=True):
                        table.extend(ids)
            if scheduled.prompt_token_ids is not None:
                pending.prompt = list(scheduled.prompt_token_ids)
            end = scheduled.num_computed_tokens + scheduled.num_scheduled_tokens
            if pending.tables is not None and pending.prompt and end >= len(pending.prompt):
                orders.append(StoreKV(scheduled.request_id, pending.prompt, tuple(pending.tables)))
                del self._pending[scheduled.request_id]
        return orders

    def decode_allocated(self, request: DecodeRequest) -> LoadKV | None:
        if request.num_external_tokens <= 0:
            return None  # everything is cached locally; prefill holds nothing to free
        return LoadKV(
            request.request_id,
            tuple(list(ids) for ids in request.block_ids),
            list(request.prompt_token_ids),
            request.num_local_tokens,
        )

    def decode_aborted(self, request_id: str, params: RemotePrefillParams) -> None:
        return None  # prefill holds no blocks for decode: nothing to free

    def prefill_finished(self, request_id: str, block_ids: BlockIds) -> PrefillResult:
        # The KV went to LMCache in the step that computed it: nothing to hold.
        return PrefillResult(
            tuple([] for _ in block_ids), hold=False, extra_params={"kvshare_backend": self.name}
        )

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)  # stored in its last prefill step, or never


class LMCacheWorker(WorkerBackend):
    """Owns the ``LMCacheStore`` over the registered KV; stores and loads synchronously."""

    def __init__(self, context: WorkerContext, config: LMCacheBackendConfig):
        super().__init__(context)
        self.config = config
        self.store: LMCacheStore | None = None
        self._loaded: set[str] = set()  # loads done since the last poll

    def start(self, topology: KVTopology, tensors: Any) -> str:
        from kvshare_connector.backends.lmcache.store import LMCacheStore

        self.store = LMCacheStore(
            self.config,
            topology,
            tensors,
            model_tag=default_model_tag(self.context.model_name),
            engine_id=self.context.engine_id,
        )
        per_token = sum(stream.width for stream in self.store.streams)
        return (
            f"{len(topology.owners)} owner layer(s) handed to LMCache, "
            f"{len(topology.sharers)} sharing layer(s) not; {len(self.store.streams)} "
            f"stream(s), {per_token} B per token"
        )

    def start_loads(self, orders: Sequence[LoadOrder]) -> dict[str, str]:
        """Load synchronously: a loaded request is reported by the next ``poll``."""
        failed: dict[str, str] = {}
        for order in orders:
            assert isinstance(order, LoadKV)
            try:
                if self.store is None:
                    raise RuntimeError("the LMCache store is not started")
                self.store.load(
                    order.request_id,
                    order.token_ids,
                    order.local_block_ids,
                    order.num_computed_tokens,
                )
                self._loaded.add(order.request_id)
            except Exception as exc:  # one request fails, never the engine
                failed[order.request_id] = f"{type(exc).__name__}: {exc}"
        return failed

    def save(self, orders: Sequence[StoreKV]) -> int:
        """Copy the KV computed in this step out before its blocks move on."""
        stored = 0
        for order in orders:
            try:
                if self.store is None:
                    raise RuntimeError("the LMCache store is not started")
                self.store.store(order.request_id, order.token_ids, order.block_ids)
                stored += 1
            except Exception as exc:  # decode will miss and compute the prompt itself
                logger.error("request %s: storing KV in LMCache failed: %s", order.request_id, exc)
        return stored

    def poll(self) -> WorkerProgress:
        loaded, self._loaded = self._loaded, set()
        return WorkerProgress(loaded=loaded)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


class LMCacheBackend(Backend):
    """Options parsed here (both processes): a bad ``lmcache`` section fails at start-up."""

    name = BACKEND_NAME

    def __init__(self, options: ConnectorOptions):
        super().__init__(options)
        self.config = LMCacheBackendConfig.from_extra_config(
            {"backend": options.backend, "lmcache": options.lmcache or {}}
        )
        if options.verify_kv:  # asked for (its default, none, means off here)
            # Not silently off: a user who asked for verified loads must not get unverified.
            raise ValueError(
                "verify_kv is a feature of the nixl backend; the lmcache backend cannot "
                "verify loads (turn verify_kv off or use backend nixl)"
            )

    def scheduler_side(self, context: SchedulerContext) -> LMCacheScheduler:
        return LMCacheScheduler(context, self.name)

    def worker_side(self, context: WorkerContext) -> LMCacheWorker:
        return LMCacheWorker(context, self.config)
