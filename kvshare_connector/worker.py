"""Worker side of the connector: registration, the pull engine, completions and stats.

Registration builds the topology from what vLLM hands over (the per-layer dict with
sharers aliased, or the cross-layer blocks tensor) and registers owner regions only.
Every step, ``start_load_kv`` queues the scheduler's reads and holds, ``get_finished``
advances them; failures end one request, never the engine.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from kvshare_connector import kvcached, vllm_adapter
from kvshare_connector.log import get_logger
from kvshare_connector.scheduler import KVShareMetadata
from kvshare_connector.stats import KVShareStats
from kvshare_connector.topology import KVTopology
from kvshare_connector.transfer import KVSink, KVSource, TransferRecord
from kvshare_connector.transport.nixl import NixlTransport

logger = get_logger(__name__)

_RELEASE_SUFFIX = "#release"  # internal ids of notify-only requests (nothing to load)


@dataclass
class KVShareWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: requests whose KV could not be loaded, with the reason."""

    failed_loads: dict[str, str] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVShareWorkerMeta:
        if isinstance(other, KVShareWorkerMeta):
            self.failed_loads.update(other.failed_loads)
        return self


def _append_read_log(path: str, records: list[TransferRecord]) -> None:
    with open(path, "a") as log:
        for record in records:
            log.write(json.dumps({"time": time.time(), **dataclasses.asdict(record)}) + "\n")


class KVShareWorker:
    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        engine_id: str,
        role: str,
        side_channel_host: str,
        side_channel_port: int,
        lease_s: float,
        handshake_timeout_s: float,
        transfer_timeout_s: float,
        lmcache_config: Any = None,
        read_log: str | None = None,
    ):
        self.vllm_config = vllm_config
        self.read_log = read_log  # path: one JSON line per finished read (decode)
        self.lmcache_config = lmcache_config  # set: the LMCache backend instead of NIXL
        self.lmcache: Any = None
        self.kv_cache_config = kv_cache_config
        self.engine_id = engine_id
        self.role = role
        self.host, self.port = side_channel_host, side_channel_port
        self.lease_s = lease_s
        self.handshake_timeout_s = handshake_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.topology: KVTopology | None = None
        self.source: KVSource | None = None
        self.sink: KVSink | None = None
        self.stats = KVShareStats()
        self._failed: dict[str, str] = {}
        self._invalid_blocks: set[int] = set()
        self._local_ids: dict[str, Any] = {}
        self._loaded: set[str] = set()  # LMCache loads done this step

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
        layout = kvcached.layout_name(kv_caches.values())
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
        if self.lmcache_config is not None:
            self._start_lmcache(topology, tensors, started)
            return
        agent = f"{self.engine_id}-{self.role}-{uuid.uuid4().hex[:6]}"
        transport = NixlTransport(agent)
        if self.role in ("kv_producer", "kv_both"):
            self.source = KVSource(
                self.engine_id, topology, transport, self.host, self.port, self.lease_s
            )
        if self.role in ("kv_consumer", "kv_both"):
            self.sink = KVSink(
                self.engine_id,
                topology,
                transport,
                self.handshake_timeout_s,
                self.transfer_timeout_s,
            )
        registered = sum(r.nbytes for r in topology.regions)
        logger.info(
            "KVShareConnector %s (%s, %s layout): registered %d owner layer(s) in %d region(s) "
            "(%.1f MiB, %.2f s) from %d tensor(s) handed over; %d sharing layer(s) not "
            "registered (they read their target's KV: %s); %d KV cache group(s)%s",
            self.engine_id,
            self.role,
            topology.layout,
            len(topology.owners),
            len(topology.regions),
            registered / 2**20,
            time.perf_counter() - started,
            handed,
            len(topology.sharers),
            _short_map(topology.sharers),
            len(topology.groups),
            f"; side channel {self.host}:{self.source.port}" if self.source else "",
        )

    def _start_lmcache(self, topology: KVTopology, tensors: Any, started: float) -> None:
        from kvshare_connector.lmcache_backend import LMCacheBackend, default_model_tag

        model = self.vllm_config.model_config
        self.lmcache = LMCacheBackend(
            self.lmcache_config,
            topology,
            tensors,
            model_tag=default_model_tag(model.served_model_name or model.model),
            engine_id=self.engine_id,
        )
        logger.info(
            "KVShareConnector %s (%s, %s layout, LMCache backend): %d owner layer(s) handed "
            "to LMCache, %d sharing layer(s) not (%.2f s)",
            self.engine_id,
            self.role,
            topology.layout,
            len(topology.owners),
            len(topology.sharers),
            time.perf_counter() - started,
        )

    # -- every step ------------------------------------------------------------------------

    def start_load_kv(self, metadata: KVShareMetadata) -> None:
        for load in metadata.to_load:
            self._local_ids[load.request_id] = load.block_ids
            try:
                self.lmcache.load(
                    load.request_id, load.token_ids, load.block_ids, load.num_computed_tokens
                )
                self._loaded.add(load.request_id)
            except Exception as exc:  # one request fails, never the engine
                self._fail(load.request_id, f"{type(exc).__name__}: {exc}")
        for recv in metadata.to_recv:
            nothing_to_load = not any(recv.local_block_ids)
            request_id = recv.request_id + (_RELEASE_SUFFIX if nothing_to_load else "")
            if self.sink is None:
                if not nothing_to_load:
                    self._fail(recv.request_id, f"engine role {self.role} cannot load KV")
                continue
            try:
                self.sink.request(request_id, recv.params, recv.local_block_ids)
            except Exception as exc:
                if not nothing_to_load:
                    self._fail(recv.request_id, f"{type(exc).__name__}: {exc}")
                continue
            if not nothing_to_load:
                self._local_ids[recv.request_id] = recv.local_block_ids
        for request_id, lease_s in metadata.to_hold.items():
            if self.source is None:
                logger.error("request %s: engine role %s cannot serve KV", request_id, self.role)
                continue
            self.source.hold(request_id, lease_s)

    def wait_for_save(self, metadata: KVShareMetadata) -> None:
        """LMCache prefill: copy the KV computed in this step out before blocks move on."""
        for store in metadata.to_store:
            try:
                self.lmcache.store(store.request_id, store.token_ids, store.block_ids)
                self.stats.count("sent")
            except Exception as exc:  # decode will miss and compute the prompt itself
                logger.error("request %s: storing KV in LMCache failed: %s", store.request_id, exc)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        sending: set[str] = set()
        recving, self._loaded = self._loaded, set()
        if self.source is not None:
            read, expired = self.source.poll()
            sending = read | expired
            self.stats.count("sent", len(read))
            self.stats.count("expired_leases", len(expired))
        if self.sink is not None:
            done, failed = self.sink.poll()
            for request_id, reason in failed.items():
                if not request_id.endswith(_RELEASE_SUFFIX):
                    self._fail(request_id, reason)
            recving |= {r for r in done if not r.endswith(_RELEASE_SUFFIX)}
            for record in self.sink.records:
                self.stats.record_read(
                    record.bytes, record.blocks, record.descriptors, record.seconds
                )
            if self.read_log and self.sink.records:
                _append_read_log(self.read_log, self.sink.records)
            self.sink.records.clear()
        recving |= set(self._failed)  # vLLM needs failed loads reported as finished too
        for request_id in recving:
            self._local_ids.pop(request_id, None)
        return sending or None, recving or None

    def _fail(self, request_id: str, reason: str) -> None:
        logger.error("request %s: KV load failed: %s", request_id, reason)
        self._failed[request_id] = reason
        self.stats.count("failed_loads")
        local = self._local_ids.get(request_id)
        if local is not None and len(self.kv_cache_config.kv_cache_groups) == 1:
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
        if self.source is not None:
            self.source.close()
        if self.sink is not None:
            self.sink.close()
        if self.lmcache is not None:
            self.lmcache.close()


def _short_map(sharers: dict[str, str], limit: int = 3) -> str:
    items = [f"{k} -> {v}" for k, v in list(sharers.items())[:limit]]
    more = f", +{len(sharers) - limit} more" if len(sharers) > limit else ""
    return ", ".join(items) + more if items else "none"
