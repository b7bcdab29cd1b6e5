"""The differences between the vLLM releases the connector supports (0.26.0 .. 0.34.0).

Each difference is detected from what vLLM ships (a module, a class, a method), not from its
version string, so a release in between works as far as the features it has. Nothing here
changes vLLM; the connector only chooses which of vLLM's hooks to answer.

* KV memory: 0.26 hands over per-layer tensors shaped by each attention backend's
  ``get_kv_cache_shape`` (or one cross-layer blocks tensor, when the connector prefers it);
  from 0.29 vLLM picks one ``KVCacheLayout`` and hands over strided ``[B, H, N, C]`` views
  into one buffer per KV cache group; a connector may state a layout it wants.
* Load failures: 0.26 takes failed block ids (one KV cache group only); from 0.30 a worker
  reports failed requests in ``KVConnectorTransferResults.failed_recving``, and vLLM's
  ``kv_load_failure_policy`` recomputes or fails them under any number of groups.
* Sleep mode (0.33): ``unregister_kv_caches`` before the KV memory is released,
  ``restore_kv_caches`` after it is mapped again.
* KV memory (0.34): on CUDA vLLM maps the KV cache with driver virtual memory and sizes it
  from the memory free after warm-up (the "extensible KV cache"), unless
  ``--kv-cache-memory-bytes`` is given or a connector's ``kv_cache_access`` rules it out;
  a connector that registers the memory with UCX must say so (``kv_cache_access``).
* Model runner (0.34): V1 is gone, and ``VLLM_USE_V2_MODEL_RUNNER=0`` stops the engine.
* Scheduler output (0.34): a resumed request comes as a new one (whole block table);
  ``CachedRequestData.resumed_req_ids`` and ``ModelRunnerOutput.req_id_to_index`` are gone.
* Block size (0.34): 64 tokens unless ``--block-size`` says otherwise (16 before). Nothing
  to absorb: the topology reads any size, and the handshake names a prefill and a decode
  that differ in it (two releases on their defaults).
* Local prefix lookup: 0.26 calls ``KVCacheManager.get_computed_blocks``; 0.34 calls
  ``get_computed_blocks_for_connector`` for a connector that
  ``supports_divergent_local_hybrid_hits`` (and reconciles a diverged hit when nothing
  loads). ``vllm/prefix_hits.py`` wraps whichever it is (the one exception to "nothing here
  changes vLLM": see there why).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Iterable
from typing import Any

from vllm.config import kv_transfer as _kv_transfer
from vllm.distributed.kv_transfer.kv_connector.v1 import base as _base

from kvshare_connector.common.log import get_logger
from kvshare_connector.layout.topology import BLOCK, CONTENT, HEAD, TOKEN

logger = get_logger(__name__)

# vLLM >= 0.29: one physical layout for the model, per-layer views are [B, H, N, C].
HAS_KV_CACHE_LAYOUT = importlib.util.find_spec("vllm.v1.kv_cache_layout") is not None
# vLLM <= 0.28: the connector may ask for, and receive, one cross-layer blocks tensor.
HAS_CROSS_LAYER_TENSOR = hasattr(_base.KVConnectorBase_V1, "register_cross_layers_kv_cache")
# vLLM >= 0.30: failed loads are reported per request.
TransferResults: Any = getattr(_base, "KVConnectorTransferResults", None)
HAS_FAILED_RECVING = TransferResults is not None
# vLLM >= 0.33: sleep mode tells the connector before the KV memory goes away.
HAS_SLEEP_HOOKS = hasattr(_base.KVConnectorBase_V1, "unregister_kv_caches")

# vLLM >= 0.34: connectors state how they reach the KV memory (KVCacheAccess flags).
KVCacheAccess: Any = getattr(_kv_transfer, "KVCacheAccess", None)
# vLLM <= 0.33: the V1 model runner (kvcached 0.1.6's) still ships.
HAS_V1_MODEL_RUNNER = importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None

# Dim labels of the per-layer view every vLLM >= 0.29 connector receives: logical
# [blocks, kv heads, tokens, K|V content]; the physical order lives in its strides.
LAYER_VIEW_LABELS = (BLOCK, HEAD, TOKEN, CONTENT)

# The block-major layout that replaced the cross-layer blocks tensor (NHD inside a block,
# FlashAttention's and Triton's order): one block of every layer of a group is one run.
BLOCK_MAJOR_LAYOUT = "BLNHC"


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def layer_view_labels(backend: Any) -> tuple[str, ...] | None:
    """The labels of a per-layer KV view when vLLM fixes them, else None (probe the backend).

    From 0.29 vLLM builds every attention view as ``[B, H, N, C]`` itself and attention
    backends no longer describe a shape.
    """
    if HAS_KV_CACHE_LAYOUT and not hasattr(backend, "get_kv_cache_shape"):
        return LAYER_VIEW_LABELS
    return None


def required_kv_cache_layout(cross_layer_blocks: bool) -> str | None:
    """What ``get_required_kvcache_layout`` answers: a preference, or None for vLLM's pick.

    The topology reads any layout off the strides, so only the block-major wish of the
    ``cross_layer_blocks`` option is passed on (vLLM 0.33 drops a wish its attention
    backends cannot use, with a warning). On 0.26 the option works through
    ``prefer_cross_layer_blocks`` instead.
    """
    if HAS_KV_CACHE_LAYOUT and cross_layer_blocks:
        return BLOCK_MAJOR_LAYOUT
    return None


def cross_layer_blocks_default(kvcached_on: bool) -> bool:
    """Default of the ``cross_layer_blocks`` option.

    0.26 uses the cross-layer tensor only where every layer has one KV shape, so asking
    is harmless. vLLM 0.33 honours a block-major wish for any model but then cannot start
    a model whose layers have different KV shapes and share KV (Gemma-4 E2B), so there
    the option is off unless set.
    """
    return HAS_CROSS_LAYER_TENSOR and not kvcached_on


def layout_name(vllm_config: Any, default: str = "per_layer") -> str:
    """A name for the KV memory layout vLLM chose (0.33: its ``KVCacheLayout``, e.g.
    ``LBNHC``), for logs and mismatch messages."""
    if not HAS_KV_CACHE_LAYOUT:
        return default
    chosen = getattr(getattr(vllm_config, "cache_config", None), "kv_cache_layout", None)
    return str(chosen) if chosen else default


def transfer_results(
    sending: Iterable[str] | None, recving: Iterable[str] | None, failed: Iterable[str]
) -> Any:
    """``get_transfer_results``' answer: failed loads count as finished receiving, as vLLM
    needs, and are named in ``failed_recving`` so its failure policy applies to them."""
    if TransferResults is None:
        raise RuntimeError(f"vLLM {vllm_version()} has no KVConnectorTransferResults")
    failed = set(failed)
    return TransferResults(
        finished_sending=set(sending or ()),
        finished_recving=set(recving or ()) | failed,
        failed_recving=failed,
    )


def kv_cache_tensor_layers(tensor: Any) -> list[str]:
    """The layers one ``KVCacheTensor`` places (0.26: ``shared_by``; 0.33: ``layers``)."""
    layers = getattr(tensor, "layers", None)
    return list(layers if layers is not None else tensor.shared_by)


def transfer_group_ids(kv_cache_config: Any) -> tuple[int, ...]:
    """The KV cache groups a load restores: all that take part in transfers."""
    ids = getattr(kv_cache_config, "transfer_group_ids", None)
    if ids is not None:
        return tuple(ids)
    return tuple(range(len(kv_cache_config.kv_cache_groups)))


def p2p_cache_hit_source() -> Any:
    """vLLM >= 0.32 labels external cache hits by tier; ours come from a peer engine."""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        return None
    return getattr(CacheHitSource, "P2P", None)


def kv_cache_access(backend: str) -> Any:
    """``kv_cache_access``'s answer (vLLM >= 0.34; None before): how the workers reach the KV.

    The NIXL backend registers the device KV with UCX, and a decode on the same host maps
    it through cuda_ipc: ``REGISTERS | EXPORTS_FABRIC``, as vLLM's NixlConnector answers.
    vLLM then keeps its extensible KV cache (driver-mapped memory) off unless the host has
    an IMEX channel for FABRIC handles, so the cuda_ipc zero-copy lane stays; the default
    (in-process) would get driver-mapped memory that UCX cannot export to the peer. LMCache
    copies the KV with torch inside the engine's process: in-process.
    """
    if KVCacheAccess is None:
        return None
    if backend == "nixl":
        return KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FABRIC
    return KVCacheAccess.IN_PROCESS


def resumed_request_ids(cached_requests: Any) -> set[str]:
    """Cached (already running) requests whose block table vLLM sent whole again.

    vLLM <= 0.33 names resumed requests in ``resumed_req_ids``; from 0.34 a resumed
    request comes among the new ones, so no cached request is resumed."""
    return set(getattr(cached_requests, "resumed_req_ids", ()))


def model_runner_output(req_ids: list[str], sampled: list[list[int]], kv_output: Any) -> Any:
    """The ``ModelRunnerOutput`` of a step (the fields vLLM's scheduler reads); vLLM <= 0.33
    also wants ``req_id_to_index``."""
    from vllm.v1.outputs import ModelRunnerOutput

    extra: dict[str, Any] = {}
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        extra["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=sampled, kv_connector_output=kv_output, **extra
    )


def prefix_lookup() -> tuple[type, str, int] | None:
    """vLLM's local prefix-cache lookup of a request it schedules, which decode's per-group
    hits wrap: (class, method, length of its answer); None without a per-group lookup."""
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    if not hasattr(HybridKVCacheCoordinator, "find_longest_cache_hit_per_group"):
        return None
    if hasattr(KVCacheManager, "get_computed_blocks_for_connector"):
        return KVCacheManager, "get_computed_blocks_for_connector", 4
    return KVCacheManager, "get_computed_blocks", 3


def full_attention_group_ids(coordinator: Any) -> list[int]:
    """The full-attention KV cache groups of a hybrid coordinator (none of another)."""
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if not isinstance(coordinator, HybridKVCacheCoordinator):
        return []
    return [
        g
        for group in coordinator.attention_groups
        if isinstance(group.spec, FullAttentionSpec)
        and not getattr(group.spec, "sliding_window", None)
        for g in group.group_ids
    ]


def max_cache_hit_length(request: Any, bound: int | None = None, **_: Any) -> int:
    """The longest local hit vLLM allows ``request`` (0.34: also its own limit, ``bound``)."""
    get = getattr(request, "get_max_cache_hit_length", None)
    if get is not None:
        return int(get(bound))
    return int(request.num_tokens) - 1
