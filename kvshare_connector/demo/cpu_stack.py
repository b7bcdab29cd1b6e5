"""vLLM's real KV cache objects for a Gemma-4 model, built on a host without a GPU.

Used by the demo and the tests, on vLLM 0.26 to 0.34. Everything comes from vLLM itself
(0.26's functions named here; 0.33's below): the model
(``Gemma4ForCausalLM`` on the meta device, so its ``Attention`` layers carry the real
sharing map and specs), ``get_kv_cache_configs`` (groups, HMA block sizes, shared
tensors), the V2 runner's ``init_attn_backend``/``init_kv_cache`` (the per-layer views and
sharer aliases handed to ``register_kv_caches``) and ``allocate_uniform_kv_caches`` (the
cross-layer blocks tensor). Two things stand in for the CUDA platform, which cannot run
here: the attention backend choice (the configured one, else FlashAttention, as on an H200) and the
HMA platform gate. kvcached's layouts are reproduced with kvcached 0.1.6's geometry
(its allocator needs a CUDA driver): one reservation larger than what vLLM uses, with
per-layer ``as_strided`` views that interleave layers per block in its default
contiguous layout.

On vLLM 0.33 the same model goes through 0.33's own steps: ``resolve_kv_cache_layout``
(the layouts its attention backends support, the connector's wish, or the one named),
``get_global_kv_cache_groups`` / ``get_kv_cache_configs`` (the per-group tensors with their
layer and block strides) and the runner's ``init_kv_cache`` (one buffer, strided
``[B, H, N, C]`` views). ``per_layer`` is vLLM's own pick, ``cross_layer`` the block-major
``BLNHC``, and any ``KVCacheLayout`` name can be asked for.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any
from unittest import mock

from kvshare_connector.common.files import write_atomic
from kvshare_connector.toolkit.procs import pick_free_port

MODELS = ("gemma4_e2b_shape", "g4tiny", "g4uniform", "gemma4_e2b_kv4")  # kv4: 4 KV heads (TP)
# Tokens per block unless told: vLLM's default up to 0.33 (0.34's is 64). One geometry on every
# release keeps the tests' block counts and the demo's the same; ``block_size=None`` builds
# with the release's own default.
BLOCK_SIZE = 16
LAYOUTS = ("per_layer", "cross_layer", "kvcached_contiguous", "kvcached_per_layer")
# vLLM >= 0.29: its KVCacheLayout names (logical [L, B, H, N, C] in physical order).
VLLM_LAYOUTS = ("LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC")
FLASH_ATTN = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"


@dataclass
class CpuKVStack:
    """What a vLLM worker would hold after ``initialize_kv_cache``, on CPU tensors."""

    model: str
    layout: str
    vllm_config: Any
    kv_cache_config: Any  # as the connector receives it (no sharers in groups)
    kv_caches: dict[str, Any]  # as ``register_kv_caches`` receives it (sharers aliased)
    sharing: dict[str, str]
    backends: dict[str, Any]  # owner layer -> attention backend class
    cross_layer_tensor: Any = None
    cross_layer_backend: Any = None
    keepalive: list[Any] = field(default_factory=list)  # raw buffers behind the views


def topology_of(stack: CpuKVStack) -> Any:
    """The topology the connector's worker builds from what vLLM hands it for this stack."""
    from kvshare_connector.vllm import adapter as vllm_adapter

    if stack.cross_layer_tensor is not None:
        return vllm_adapter.topology_from_cross_layer(
            stack.kv_cache_config,
            stack.cross_layer_tensor,
            stack.cross_layer_backend,
            stack.sharing,
            stack.vllm_config,
        )
    return vllm_adapter.topology_from_kv_caches(
        stack.kv_cache_config, stack.kv_caches, stack.backends, stack.sharing, stack.layout
    )


def model_dir(model: str, root: Path) -> Path:
    """Write the packaged config of ``model`` into ``root/model`` (vLLM reads a directory)."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {MODELS}")
    target = root / model
    target.mkdir(parents=True, exist_ok=True)
    models = resources.files("kvshare_connector").joinpath("demo", "models")
    text = models.joinpath(f"{model}.json").read_text()
    config = target / "config.json"
    if not config.exists() or config.read_text() != text:
        # Processes that build the same model at once never read half a file.
        write_atomic(config, text)
    return target


def _models_root() -> Path:
    """One directory per user for the packaged configs, reused by every build (a fresh
    temporary directory per build would leave one behind each time)."""
    return Path(tempfile.gettempdir()) / f"kvshare-models-{os.getuid()}"


def hf_overrides_for(config_path: Path) -> dict[str, Any]:
    """transformers >= 5.17 folds ``global_head_dim`` into per-layer overrides that
    vLLM 0.26 does not read; hand it back so full-attention layers get their head size."""
    config = json.loads(config_path.read_text())
    return {"global_head_dim": config["global_head_dim"]} if "global_head_dim" in config else {}


def _cuda_backend_choice(cls: Any, selected_backend: Any, *args: Any, **kwargs: Any) -> str:
    """What the CUDA platform answers on an H200: the configured backend, else FlashAttention
    (vLLM itself configures Triton for Gemma-4 with mixed head sizes)."""
    return selected_backend.get_path() if selected_backend is not None else FLASH_ATTN


def on_a_free_port(listen: Callable[[int], None], attempts: int = 5) -> None:
    """``listen(port)`` on a port free a moment ago, again on another while the port was
    taken in between (EADDRINUSE): a free port is free only until someone binds it, and
    the tests start engines and side channels side by side (torch's rendezvous store once
    lost its port that way)."""
    for attempt in range(attempts):
        try:
            listen(pick_free_port())
            return
        except RuntimeError as exc:  # torch's DistNetworkError is one
            if "EADDRINUSE" not in str(exc) or attempt == attempts - 1:
                raise


def _ensure_distributed(vllm_config: Any) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    if parallel_state._TP is not None:
        return

    def init(port: int) -> None:
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=0,
            backend="gloo",
        )

    with set_current_vllm_config(vllm_config):
        on_a_free_port(init)
        parallel_state.initialize_model_parallel(1, 1)


def build_cpu_stack(
    model: str,
    layout: str = "per_layer",
    kv_bytes: int = 64 << 20,
    workdir: Path | None = None,
    kv_transfer_config: Any = None,
    kvcached_spare_blocks: int = 64,
    max_model_len: int = 2048,
    kv_heads: int | None = None,
    block_size: int | None = BLOCK_SIZE,
) -> CpuKVStack:
    """Build the KV memory of ``model`` in ``layout`` from vLLM's own functions.

    ``kv_heads``: override the model's KV head count, to build what one TP rank holds
    (a rank of TP ``t`` over ``H`` split heads holds ``H / t``). ``block_size``: tokens per
    block as ``--block-size`` sets it (None: the release's default)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu import attn_utils

    from kvshare_connector.vllm import compat

    known = LAYOUTS + (VLLM_LAYOUTS if compat.HAS_KV_CACHE_LAYOUT else ())
    if layout not in known:
        raise ValueError(f"unknown layout {layout!r}; choose from {known}")
    root = Path(workdir) if workdir is not None else _models_root()
    vllm_config = _cpu_vllm_config(
        model_dir(model, root), kv_transfer_config, max_model_len, kv_heads, block_size
    )
    sharing, specs = _build_model(vllm_config)
    if compat.HAS_KV_CACHE_LAYOUT:
        kv_cache_config = _kv_cache_config_v033(vllm_config, specs, kv_bytes, layout)
    else:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        kv_cache_config = get_kv_cache_configs(vllm_config, [specs], [kv_bytes])[0]
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks  # as EngineCore does
    worker_config = copy.deepcopy(kv_cache_config)
    with set_current_vllm_config(vllm_config):
        attn_groups, _, kernel_block_sizes = attn_utils.init_attn_backend(
            worker_config, vllm_config, torch.device("cpu")
        )
    backends = {
        name: group.backend
        for groups in attn_groups
        for group in groups
        for name in group.layer_names
        if name not in sharing
    }
    stack = CpuKVStack(model, layout, vllm_config, kv_cache_config, {}, sharing, backends)
    _allocate(stack, worker_config, attn_groups, kernel_block_sizes, kvcached_spare_blocks)
    return stack


def _cpu_vllm_config(
    path: Path,
    kv_transfer_config: Any,
    max_model_len: int,
    kv_heads: int | None,
    block_size: int | None,
) -> Any:
    """vLLM's config of the model at ``path`` on the CPU, with HMA on as on CUDA."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as EngineArgs does: registers KVShareConnector by name
    model_config = ModelConfig(
        model=str(path),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=max_model_len,
        hf_overrides={
            **hf_overrides_for(path / "config.json"),
            **({"num_key_value_heads": kv_heads} if kv_heads else {}),
        },
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=block_size) if block_size else CacheConfig(),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=kv_transfer_config,
    )
    # HMA is on for CUDA platforms; the CPU-only build of the platform turns it off.
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    _ensure_distributed(vllm_config)
    return vllm_config


def _build_model(vllm_config: Any) -> tuple[dict[str, str], Any]:
    """Instantiate Gemma-4 on the meta device (its attention layers register themselves):
    the sharing map and vLLM's KV cache specs."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.gemma4 import Gemma4ForCausalLM
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu import attn_utils

    from kvshare_connector.vllm.adapter import sharing_map

    platform_cls = type(current_platform)
    with (
        mock.patch.object(platform_cls, "get_attn_backend_cls", classmethod(_cuda_backend_choice)),
        set_current_vllm_config(vllm_config),
        torch.device("meta"),
    ):
        Gemma4ForCausalLM(vllm_config=vllm_config, prefix="")
    forward_context = vllm_config.compilation_config.static_forward_context
    return sharing_map(forward_context), attn_utils.get_kv_cache_spec(vllm_config)


def _allocate(
    stack: CpuKVStack,
    worker_config: Any,
    attn_groups: Any,
    kernel_block_sizes: Any,
    kvcached_spare_blocks: int,
) -> None:
    """The KV tensors of ``stack.layout``, allocated as vLLM (or kvcached) does it."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu import attn_utils

    from kvshare_connector.vllm import compat

    vllm_config, layout = stack.vllm_config, stack.layout
    forward_context = vllm_config.compilation_config.static_forward_context
    cpu = torch.device("cpu")
    if compat.HAS_KV_CACHE_LAYOUT and not layout.startswith("kvcached"):
        with set_current_vllm_config(vllm_config):
            stack.kv_caches = attn_utils.init_kv_cache(
                forward_context,
                worker_config,
                cpu,
                kernel_block_sizes,
                vllm_config,
                attn_groups=[group for groups in attn_groups for group in groups],
            )
    elif layout == "per_layer":
        with set_current_vllm_config(vllm_config):
            stack.kv_caches = attn_utils.init_kv_cache(
                [], forward_context, worker_config, attn_groups, cpu, "auto",
                kernel_block_sizes, vllm_config,
            )  # fmt: skip
    elif layout == "cross_layer":
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        with set_current_vllm_config(vllm_config):
            kv_caches, tensor, backend = KVConnectorModelRunnerMixin.allocate_uniform_kv_caches(
                worker_config, attn_groups, "auto", cpu, kernel_block_sizes
            )
        for sharer, target in stack.sharing.items():  # what the runner does after allocating
            kv_caches[sharer] = kv_caches[target]
        stack.kv_caches = kv_caches
        stack.cross_layer_tensor, stack.cross_layer_backend = tensor, backend
    else:
        stack.kv_caches, stack.keepalive = kvcached_views(
            stack.kv_cache_config,
            stack.sharing,
            contiguous=layout == "kvcached_contiguous",
            capacity_blocks=stack.kv_cache_config.num_blocks + kvcached_spare_blocks,
        )


def _kv_cache_config_v033(vllm_config: Any, specs: Any, kv_bytes: int, layout: str) -> Any:
    """vLLM 0.33's engine-core steps: resolve the layout, group the layers, size the KV.

    ``per_layer`` and kvcached's layouts leave the choice to vLLM (the connector's wish
    included, as in an engine); ``cross_layer`` or a ``KVCacheLayout`` name is asked for
    the way a user would, with ``VLLM_KV_CACHE_LAYOUT``.
    """
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    from kvshare_connector.vllm.compat import BLOCK_MAJOR_LAYOUT

    wanted = BLOCK_MAJOR_LAYOUT if layout == "cross_layer" else layout
    env = {"VLLM_KV_CACHE_LAYOUT": wanted} if wanted in VLLM_LAYOUTS else {}
    with set_current_vllm_config(vllm_config), mock.patch.dict(os.environ, env):
        supported = get_supported_kv_cache_layouts(get_current_attn_backends(vllm_config))
        resolve_kv_cache_layout(vllm_config, [[x.name for x in supported]], specs.values())
        groups = get_global_kv_cache_groups(vllm_config, [specs])
        config = get_kv_cache_configs(vllm_config, [specs], [kv_bytes], groups)[0]
    config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout  # as EngineCore does
    return config


def kvcached_views(
    kv_cache_config: Any,
    sharing: dict[str, str],
    contiguous: bool,
    capacity_blocks: int,
) -> tuple[dict[str, Any], list[Any]]:
    """kvcached 0.1.6's packed-KV views (vLLM >= 0.26), on CPU buffers.

    Pools: pool ``i`` is shared by the ``i``-th owner of every group; ``L`` pools. Each
    layer view has shape ``(N, H, kbs, 2D)`` (NHD strides) over a reservation of ``N``
    blocks, ``N`` larger than vLLM's ``num_blocks`` (kvcached reserves the whole GPU).
    Contiguous: one reservation, block ``b`` of pool ``i`` at ``(b * L + i) * page``.
    Per-layer: one reservation per pool, block ``b`` at ``b * page``.
    """
    import torch

    owners_per_group = [
        [n for n in g.layer_names if n not in sharing] for g in kv_cache_config.kv_cache_groups
    ]
    num_pools = max(len(names) for names in owners_per_group)
    page = {g.kv_cache_spec.page_size_bytes for g in kv_cache_config.kv_cache_groups}
    if len(page) != 1:
        raise ValueError(f"kvcached needs one block byte size across groups, got {page}")
    page_bytes = page.pop()
    if contiguous:
        raw = [torch.zeros(capacity_blocks * num_pools * page_bytes, dtype=torch.int8)]
    else:
        raw = [
            torch.zeros(capacity_blocks * page_bytes, dtype=torch.int8) for _ in range(num_pools)
        ]
    views: dict[str, Any] = {}
    for group, names in zip(kv_cache_config.kv_cache_groups, owners_per_group, strict=True):
        spec = group.kv_cache_spec
        heads, tokens, width = spec.num_kv_heads, spec.block_size, 2 * spec.head_size
        elements = heads * tokens * width
        for pool, name in enumerate(names):
            buffer = raw[0] if contiguous else raw[pool]
            typed = buffer.view(spec.dtype)
            views[name] = torch.as_strided(
                typed,
                (capacity_blocks, heads, tokens, width),
                (elements * (num_pools if contiguous else 1), width, heads * width, 1),
                storage_offset=pool * elements if contiguous else 0,
            )
    for sharer, target in sharing.items():
        views[sharer] = views[target]
    return views, raw
