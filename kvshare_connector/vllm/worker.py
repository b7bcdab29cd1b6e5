"""Worker side of the connector: registration, the backend each step, completions and stats.

Registration builds the topology from what vLLM hands over (the per-layer dict with
sharers aliased, or 0.26's cross-layer blocks tensor) and hands the owners' memory to the
backend; sleep mode (vLLM 0.33) takes it back from the backend and hands it over again.
Every step, ``start_load_kv`` passes the scheduler's orders to the backend and
``get_finished`` advances them; failures end one request, never the engine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence
from typing import Any

from kvshare_connector.backends.base import Backend, WorkerContext, WorkerProgress
from kvshare_connector.common.log import get_logger
from kvshare_connector.layout import kvcached
from kvshare_connector.layout.topology import BlockIds, KVTopology
from kvshare_connector.transfer.device.records import TransferRecord
from kvshare_connector.vllm import adapter as vllm_adapter
from kvshare_connector.vllm import compat
from kvshare_connector.vllm.metadata import KVShareMetadata, KVShareWorkerMeta
from kvshare_connector.vllm.stats import KVShareStats

logger = get_logger(__name__)


def _append_read_log(path: str, records: Sequence[TransferRecord]) -> None:
    with open(path, "a") as log:
        for record in records:
            log.write(json.dumps({"time": time.time(), **dataclasses.asdict(record)}) + "\n")


class KVShareWorker:
    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        backend: Backend,
        context: WorkerContext,
    ):
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.context = context
        self._backend_factory = backend
        self.backend = backend.worker_side(context)
        self.read_log = context.options.read_log  # path: one JSON line per finished read
        self.topology: KVTopology | None = None
        self.stats = KVShareStats()
        self._failed: dict[str, str] = {}
        self._invalid_blocks: set[int] = set()
        self._local_ids: dict[str, BlockIds] = {}
        self._tensors: Any = None  # what was registered, to register again after sleep
        self._asleep = False
        self._held: set[str] = set()  # prefill: requests whose blocks decode may still read
        self._dropped: set[str] = set()  # held when the engine slept: their KV is gone

    # -- registration ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        started = time.perf_counter()
        context = self.vllm_config.compilation_config.static_forward_context
        sharing = vllm_adapter.sharing_map(context)
        backends = {
            name: context[name].get_attn_backend()
            for name in kv_caches
            if name not in sharing and name in context
        }
        layout = kvcached.layout_name(kv_caches.values(), compat.layout_name(self.vllm_config))
        topology = vllm_adapter.topology_from_kv_caches(
            self.kv_cache_config, kv_caches, backends, sharing, layout
        )
        self._start(topology, len(kv_caches), started, kv_caches)

    def register_cross_layers_kv_cache(self, kv_cache: Any, attn_backend: Any) -> None:
        started = time.perf_counter()
        context = self.vllm_config.compilation_config.static_forward_context
        topology = vllm_adapter.topology_from_cross_layer(
            self.kv_cache_config,
            kv_cache,
            attn_backend,
            vllm_adapter.sharing_map(context),
            self.vllm_config,
        )
        self._start(topology, 1, started, kv_cache)

    def _start(self, topology: KVTopology, handed: int, started: float, tensors: Any) -> None:
        self.topology = topology
        self._tensors = tensors
        what = self.backend.start(topology, tensors)
        logger.info(
            "KVShareConnector %s (%s, %s layout, backend %s): %s in %.2f s from %d tensor(s) "
            "handed over; %d sharing layer(s) not registered (they read their target's KV: "
            "%s); %d KV cache group(s); code from %s",
            self.context.engine_id,
            self.context.role,
            topology.layout,
            type(self.backend).__name__,
            what,
            time.perf_counter() - started,
            handed,
            len(topology.sharers),
            _short_map(topology.sharers),
            len(topology.groups),
            _PACKAGE_DIR,  # which tree runs (a side-by-side "before" must say so)
        )

    # -- every step ------------------------------------------------------------------------

    def start_load_kv(self, metadata: KVShareMetadata) -> None:
        if self._asleep:  # nothing registered: loads fail, holds are given back
            for order in metadata.to_load:
                if any(order.local_block_ids):
                    self._fail(order.request_id, "the engine is asleep (sleep mode)")
            self._dropped.update(metadata.to_hold)
            return
        for order in metadata.to_load:
            if any(order.local_block_ids):
                self._local_ids[order.request_id] = order.local_block_ids
        for request_id, reason in self.backend.start_loads(metadata.to_load).items():
            self._fail(request_id, reason)
        if metadata.to_hold:
            self._held.update(metadata.to_hold)
            self.backend.hold(metadata.to_hold)

    def wait_for_save(self, metadata: KVShareMetadata) -> None:
        """Store orders (backends that push KV out): right after the step's forward."""
        if metadata.to_store:
            self.stats.count("sent", self.backend.save(metadata.to_store))

    def nudge(self) -> None:
        """From inside the forward (``KVShareConnector.wait_for_layer_load``)."""
        if not self._asleep:
            self.backend.nudge()

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        progress = WorkerProgress() if self._asleep else self.backend.poll()
        self.stats.count("sent", len(progress.sent))
        self.stats.count("expired_leases", len(progress.expired))
        for counter, n in progress.counters.items():
            self.stats.count(counter, n)
        for request_id, reason in progress.failed.items():
            self._fail(request_id, reason)
        for record in progress.records:
            self.stats.record_read(record)
            if record.bytes:
                self.stats.count("packed_reads" if record.packed else "direct_reads")
            if record.verified:
                self.stats.count("verified_loads")
        for lane in progress.lanes:
            self.stats.record_lane(lane.peer, lane.lane, lane.gbps, lane.slow)
        if self.read_log and progress.records:
            _append_read_log(self.read_log, progress.records)
        recving = progress.loaded | set(self._failed)  # vLLM needs failed loads as finished
        for request_id in recving:
            self._local_ids.pop(request_id, None)
        sending = progress.sent | progress.expired | self._dropped
        self._held -= sending
        self._dropped = set()
        return sending or None, recving or None

    def transfer_results(self) -> Any:
        """vLLM >= 0.30: the same completions, failed loads also named as failed."""
        sending, recving = self.get_finished()
        return compat.transfer_results(sending, recving, set(self._failed))

    # -- sleep mode (vLLM >= 0.33) ---------------------------------------------------------

    def unregister(self) -> None:
        """The KV memory is about to be released: nothing may stay registered with it.

        The backend goes whole (NIXL deregisters the memory with its agent, prefill's side
        channel closes): a peer that reads meanwhile fails that read and computes locally.
        Requests held for decode and loads under way lose their KV with the memory.
        """
        if self._asleep or self.topology is None:
            return
        for request_id in self.backend.in_flight():
            self._fail(request_id, "the engine went to sleep during the load")
        self._dropped |= self._held
        self.backend.close()
        self._asleep = True
        logger.info(
            "KVShareConnector %s: KV memory unregistered for sleep (%d held request(s) dropped)",
            self.context.engine_id,
            len(self._held),
        )

    def restore(self) -> None:
        """The KV memory is mapped again at the same addresses: register it again."""
        if not self._asleep or self.topology is None:
            return
        self.backend = self._backend_factory.worker_side(self.context)
        self._asleep = False
        self._start(self.topology, 0, time.perf_counter(), self._tensors)

    def _fail(self, request_id: str, reason: str) -> None:
        logger.error("request %s: KV load failed: %s", request_id, reason)
        self._failed[request_id] = reason
        self.stats.count("failed_loads")
        local = self._local_ids.get(request_id)
        if (
            local is not None
            and not compat.HAS_FAILED_RECVING
            and len(self.kv_cache_config.kv_cache_groups) == 1
        ):
            # Single group: vLLM's own invalid-block path (honours kv_load_failure_policy).
            self._invalid_blocks.update(local[0])

    def block_ids_with_load_errors(self) -> set[int]:
        blocks, self._invalid_blocks = self._invalid_blocks, set()
        return blocks

    def worker_meta(self) -> KVShareWorkerMeta | None:
        if not self._failed:
            return None
        meta, self._failed = KVShareWorkerMeta(dict(self._failed)), {}
        return meta

    def take_stats(self) -> KVShareStats | None:
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, KVShareStats()
        return stats

    def shutdown(self) -> None:
        if not self._asleep:
            self.backend.close()


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _short_map(sharers: dict[str, str], limit: int = 3) -> str:
    items = [f"{k} -> {v}" for k, v in list(sharers.items())[:limit]]
    more = f", +{len(sharers) - limit} more" if len(sharers) > limit else ""
    return ", ".join(items) + more if items else "none"
