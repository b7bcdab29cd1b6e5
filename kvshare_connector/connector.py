"""``KVShareConnector``: the KV connector for vLLM 0.26.0 .. 0.34.0, role dispatch only.

What differs between those releases is answered in ``kvshare_connector.vllm.compat``; each
hook here exists for the releases that call it and is inert on the others.

Enable with ``--kv-transfer-config '{"kv_connector":"KVShareConnector","kv_role":...}'``.
Options in ``kv_connector_extra_config``: ``kvshare_connector.backends.options``
(``ConnectorOptions``, one field each, with its default and help; README's table).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm import envs
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvshare_connector.backends import create_backend
from kvshare_connector.backends.base import WorkerContext
from kvshare_connector.backends.options import ConnectorOptions
from kvshare_connector.common.log import get_logger
from kvshare_connector.layout import kvcached
from kvshare_connector.transfer.wire.addresses import advertised_host
from kvshare_connector.vllm import compat, prefix_hits
from kvshare_connector.vllm.adapter import engine_identity
from kvshare_connector.vllm.metadata import KVShareMetadata, KVShareWorkerMeta
from kvshare_connector.vllm.parallel import model_kv_heads, tensor_parallel
from kvshare_connector.vllm.prometheus import KVSharePromMetrics
from kvshare_connector.vllm.scheduler import KVShareScheduler, scheduler_context
from kvshare_connector.vllm.stats import KVShareStats
from kvshare_connector.vllm.worker import KVShareWorker

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionBackend, AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)

ROLES = ("kv_producer", "kv_consumer", "kv_both")


class KVShareConnector(KVConnectorBase_V1, SupportsHMA):
    # vLLM >= 0.32 labels external cache hits by tier: ours come from a peer engine
    # (None on releases that do not label them).
    _cache_hit_source = compat.p2p_cache_hit_source()

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        config = self._kv_transfer_config
        if config.kv_role not in ROLES:
            raise ValueError(f"KVShareConnector: kv_role {config.kv_role!r} not in {ROLES}")
        # TP (issue 16): one worker per rank; rank r serves on port + r, the base port goes
        # into kv_transfer_params with tp_size (kvshare_connector.transfer.decode.shards).
        tp_size, tp_rank = tensor_parallel(vllm_config, role != KVConnectorRole.SCHEDULER)
        options = ConnectorOptions.parse(config.kv_connector_extra_config)
        self.engine_id = config.engine_id or "kvshare"
        # Prefill listens on VLLM_NIXL_SIDE_CHANNEL_HOST and advertises (kv_transfer_params'
        # remote_host, what decode dials and signs for) that host, or on every interface
        # (0.0.0.0) its routable address; worked out alike in every process of the engine.
        bind = envs.VLLM_NIXL_SIDE_CHANNEL_HOST
        host = bind
        if config.kv_role != "kv_consumer":
            advertised = advertised_host(bind, options.advertise_host)
            host = advertised.host
            if host != bind and role == KVConnectorRole.SCHEDULER:
                logger.info(
                    "KV side channel listens on %s and advertises %s (%s)",
                    bind, host, advertised.why,
                )  # fmt: skip
        port = (
            envs.VLLM_NIXL_SIDE_CHANNEL_PORT
            + vllm_config.parallel_config.data_parallel_index * tp_size
        )
        backend = create_backend(options)  # in both roles: bad options fail at start-up
        self._cross_layer = (
            options.cross_layer_blocks
            if options.cross_layer_blocks is not None
            else compat.cross_layer_blocks_default(kvcached.kvcached_enabled())
        )
        self.scheduler: KVShareScheduler | None = None
        self.worker: KVShareWorker | None = None
        self._group_hits = False  # decode: each KV cache group keeps its own prefix hit
        if role == KVConnectorRole.SCHEDULER:
            context = scheduler_context(
                vllm_config, kv_cache_config, self.engine_id, host, port, options
            )
            self.scheduler = KVShareScheduler(context, backend)
            if config.kv_role != "kv_producer" and self.scheduler.backend.group_hits:
                self._group_hits = prefix_hits.install(kv_cache_config, self.scheduler)
        else:
            model = vllm_config.model_config
            worker_context = WorkerContext(
                engine_id=self.engine_id,
                role=config.kv_role,
                host=host,
                port=port + tp_rank,  # TP: this rank's own side channel
                model_name=model.served_model_name or model.model,
                options=options,
                engine_identity=engine_identity(vllm_config),
                tp_size=tp_size,
                tp_rank=tp_rank,
                model_kv_heads=model_kv_heads(vllm_config),
                bind_host=bind,
            )
            self.worker = KVShareWorker(vllm_config, kv_cache_config, backend, worker_context)

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return self._cross_layer

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """vLLM >= 0.34: a decode load completes a full-attention prefix hit deeper than
        the sliding-window groups' (``vllm/prefix_hits.py``)."""
        return self._group_hits

    # ---- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def register_cross_layers_kv_cache(
        self, kv_cache: Any, attn_backend: type[AttentionBackend]
    ) -> None:
        assert self.worker is not None
        self.worker.register_cross_layers_kv_cache(kv_cache, attn_backend)

    def unregister_kv_caches(self) -> None:
        """vLLM >= 0.33 sleep mode: the KV memory is about to be released."""
        if self.worker is not None:
            self.worker.unregister()

    def restore_kv_caches(self) -> None:
        """vLLM >= 0.33 wake-up: the KV memory is back at the same addresses."""
        if self.worker is not None:
            self.worker.restore()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVShareMetadata)
        self.worker.start_load_kv(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish before a request is scheduled (async pull), not per layer. vLLM
        calls this at every attention layer of an eager or piecewise-graph forward: the
        reads in flight are taken further meanwhile (a claim answered or a READ done during
        the forward is not left for the step's end)."""
        if self.worker is not None:
            self.worker.nudge()

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Nothing to save: decode pulls from prefill's own KV blocks."""

    def wait_for_save(self) -> None:
        """LMCache backend: store the prompts finished in this step (NIXL: nothing)."""
        if self.worker is not None and self.has_connector_metadata():
            metadata = self._get_connector_metadata()
            assert isinstance(metadata, KVShareMetadata)
            self.worker.wait_for_save(metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        return self.worker.get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM >= 0.30: completions, with failed loads named in ``failed_recving``."""
        assert self.worker is not None
        return self.worker.transfer_results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self.worker is not None
        return self.worker.worker_meta()

    def get_kv_connector_stats(self) -> KVShareStats | None:
        if self.worker is not None:
            return self.worker.take_stats()
        return self.scheduler.take_stats() if self.scheduler is not None else None

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVSharePromMetrics:
        return KVSharePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVShareStats:
        return KVShareStats(data=dict(data)) if data is not None else KVShareStats()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    # ---- scheduler side -----------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """vLLM >= 0.32: a load brings the request's own blocks of every transferred group
        (sliding-window ones too), so vLLM must not zero any of them."""
        return compat.transfer_group_ids(self._kv_cache_config)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVShareWorkerMeta) and meta.failed_loads:
            self.scheduler.failed_loads(meta.failed_loads)
        self.scheduler.finished_loads(set(connector_output.finished_recving or ()))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: KVTransferConfig) -> Any:
        """vLLM >= 0.34: how the workers reach the KV memory, which decides whether vLLM
        maps it with driver virtual memory (see ``compat.kv_cache_access``)."""
        options = ConnectorOptions.parse(kv_transfer_config.kv_connector_extra_config)
        return compat.kv_cache_access(options.backend)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Any layout works (geometry is read off the strides); vLLM 0.33 is asked for the
        block-major one only when ``cross_layer_blocks`` is set."""
        config = vllm_config.kv_transfer_config
        options = ConnectorOptions.parse(config.kv_connector_extra_config if config else None)
        return compat.required_kv_cache_layout(bool(options.cross_layer_blocks))
