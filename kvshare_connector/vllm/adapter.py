"""Thin translation from vLLM's objects (0.26 .. 0.33) to the plain inputs of ``topology``.

Everything vLLM-specific about KV memory lives here: reading KV cache specs and groups,
the sharing map, dim labels of a backend's KV shape (or vLLM's own ``[B, H, N, C]`` views
from 0.29, see ``compat``), and the per-layer views inside 0.26's cross-layer blocks
tensor. The rest of the package never looks at vLLM classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvshare_connector.layout.matching import EngineIdentity, config_digest
from kvshare_connector.layout.topology import (
    BLOCK,
    CONTENT,
    DIM,
    HEAD,
    KV,
    TOKEN,
    GroupSpec,
    KVTopology,
    LayerSpec,
    TensorView,
    TopologyError,
    build_topology,
)
from kvshare_connector.vllm import compat

_SPEC_KINDS = {"FullAttentionSpec": "full", "SlidingWindowSpec": "sliding"}


def layer_spec(spec: Any) -> LayerSpec:
    """A vLLM ``AttentionSpec`` as a ``LayerSpec`` (attention specs only)."""
    for attr in ("block_size", "num_kv_heads", "head_size", "dtype"):
        if not hasattr(spec, attr):
            raise TopologyError(
                f"KV cache spec {type(spec).__name__} is not an attention spec (no {attr}); "
                "only attention KV can be transferred"
            )
    dtype = spec.dtype
    return LayerSpec(
        block_size=int(spec.block_size),
        num_kv_heads=int(spec.num_kv_heads),
        head_size=int(spec.head_size),
        dtype=str(dtype).removeprefix("torch."),
        itemsize=int(dtype.itemsize),
        kind=_SPEC_KINDS.get(type(spec).__name__, type(spec).__name__),
        sliding_window=getattr(spec, "sliding_window", None),
    )


def groups_of(kv_cache_config: Any) -> tuple[GroupSpec, ...]:
    """The KV cache groups of a ``KVCacheConfig`` (sharers may be in ``layer_names``)."""
    return tuple(
        GroupSpec(index, layer_spec(group.kv_cache_spec), tuple(group.layer_names))
        for index, group in enumerate(kv_cache_config.kv_cache_groups)
    )


def sharing_map(static_forward_context: Mapping[str, Any]) -> dict[str, str]:
    """``{sharer: target}`` from each attention layer's ``kv_sharing_target_layer_name``."""
    return {
        name: target
        for name, layer in static_forward_context.items()
        if (target := getattr(layer, "kv_sharing_target_layer_name", None))
    }


def dim_labels(backend: Any, spec: LayerSpec, block_size: int) -> tuple[str, ...]:
    """Name each dim of ``backend.get_kv_cache_shape`` by probing which argument moves it.

    Only positions matter, so any block size the backend accepts will do.

    Backends differ in where they put blocks, heads, tokens and K/V; asking the backend
    beats a table of backends that goes stale with every vLLM release. From vLLM 0.29 the
    views are vLLM's own and their dims are fixed.
    """
    fixed = compat.layer_view_labels(backend)
    if fixed is not None:
        return fixed

    def shape(blocks: int, tokens: int, heads: int, head_size: int) -> tuple[int, ...]:
        return tuple(backend.get_kv_cache_shape(blocks, tokens, heads, head_size))

    base_args = (7919, block_size, spec.num_kv_heads, spec.head_size)
    base = shape(*base_args)
    moved: list[set[int]] = [set() for _ in base]
    for arg in range(4):
        args = list(base_args)
        args[arg] *= 2
        try:
            probe = shape(*args)
        except Exception as exc:  # a backend may reject the doubled size
            raise TopologyError(
                f"cannot probe the KV shape of {getattr(backend, '__name__', backend)}: {exc}"
            ) from exc
        if len(probe) != len(base):
            raise TopologyError(f"{backend} changes KV rank with its arguments")
        for axis, (a, b) in enumerate(zip(base, probe, strict=True)):
            if a != b:
                moved[axis].add(arg)
    labels = []
    for axis, args in enumerate(moved):
        if args == {0}:
            labels.append(BLOCK)
        elif args == {1}:
            labels.append(TOKEN)
        elif args == {2}:
            labels.append(HEAD)
        elif args == {3}:
            labels.append(CONTENT if base[axis] == 2 * spec.head_size else DIM)
        elif not args and base[axis] == 2:
            labels.append(KV)
        elif not args and base[axis] == 1:
            labels.append(HEAD if spec.num_kv_heads == 1 else KV)
        else:
            raise TopologyError(
                f"{getattr(backend, '__name__', backend)} KV shape {base}: dim {axis} depends "
                f"on arguments {sorted(args)}; cannot name it"
            )
    return tuple(labels)


def topology_from_kv_caches(
    kv_cache_config: Any,
    kv_caches: Mapping[str, Any],
    backends: Mapping[str, Any],
    sharing: Mapping[str, str],
    layout: str = "per_layer",
) -> KVTopology:
    """Topology of the dict vLLM hands to ``register_kv_caches`` (sharers are aliases).

    ``backends`` maps each owner layer to its attention backend class.
    """
    groups = groups_of(kv_cache_config)
    views = {name: TensorView.of(t) for name, t in kv_caches.items()}
    labels = {}
    for group in groups:
        for name in group.layer_names:
            if name in sharing:
                continue
            if name not in backends:
                raise TopologyError(f"no attention backend known for owner layer {name!r}")
            if name not in views:
                raise TopologyError(f"no KV tensor for owner layer {name!r}")
            labels[name] = dim_labels(backends[name], group.spec, group.spec.block_size)
    return build_topology(
        groups, views, labels, sharing, int(kv_cache_config.num_blocks), layout=layout
    )


def cross_layer_views(
    kv_cache_config: Any, kv_cache: Any, backend: Any, vllm_config: Any
) -> tuple[dict[str, Any], str]:
    """Per-owner logical views into vLLM's cross-layer blocks tensor.

    vLLM allocates it in the backend's physical order with a layers dim; undoing that
    permutation (as vLLM does for the model's own views) gives each owner's logical view.
    Returns the views and the physical order, for logs.
    """
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        order = tuple(backend.get_kv_cache_stride_order(include_num_layers_dimension=True))
    if len(order) != kv_cache.dim():
        raise TopologyError(
            f"cross-layer KV tensor of shape {tuple(kv_cache.shape)} does not match the "
            f"backend's stride order {order}"
        )
    inverse = [order.index(i) for i in range(len(order))]
    logical = kv_cache.permute(*inverse)
    tensors = kv_cache_config.kv_cache_tensors
    if logical.shape[0] != len(tensors):
        raise TopologyError(
            f"cross-layer KV tensor holds {logical.shape[0]} layers, the KV cache config "
            f"{len(tensors)}"
        )
    views = {}
    for index, tensor in enumerate(tensors):
        for name in compat.kv_cache_tensor_layers(tensor):
            views[name] = logical[index]
    return views, f"cross_layer{order}"


def topology_from_cross_layer(
    kv_cache_config: Any,
    kv_cache: Any,
    backend: Any,
    sharing: Mapping[str, str],
    vllm_config: Any,
) -> KVTopology:
    """Topology of the single tensor vLLM hands to ``register_cross_layers_kv_cache``."""
    views, _ = cross_layer_views(kv_cache_config, kv_cache, backend, vllm_config)
    backends = {name: backend for name in views}
    return topology_from_kv_caches(kv_cache_config, views, backends, sharing, layout="cross_layer")


def engine_identity(vllm_config: Any) -> EngineIdentity:
    """What this engine computes KV with, for the handshake to compare.

    The model is named by its last path part: two hosts that load the same model from
    different directories agree, and its config digest tells real differences apart.
    """
    import vllm

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    hf_config = getattr(model, "hf_config", None)
    return EngineIdentity(
        model=str(model.model).rstrip("/").rsplit("/", 1)[-1],
        model_config_hash=config_digest(hf_config.to_dict()) if hf_config is not None else None,
        dtype=str(model.dtype).removeprefix("torch."),
        cache_dtype=str(cache.cache_dtype),
        block_size=int(cache.block_size) if cache.block_size else None,
        vllm_version=vllm.__version__,
    )
