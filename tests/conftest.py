"""Shared fixtures: vLLM's real KV objects for Gemma-4 shaped models, built once per session."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def cpu_stack(model: str, layout: str, kv_mib: int = 64):
    """Cached ``build_cpu_stack`` (vLLM import and model build cost seconds)."""
    from kvshare_connector.cpu_stack import build_cpu_stack

    return build_cpu_stack(model, layout, kv_bytes=kv_mib << 20)


@functools.cache
def cpu_topology(model: str, layout: str, kv_mib: int = 64):
    from kvshare_connector import vllm_adapter

    stack = cpu_stack(model, layout, kv_mib)
    if layout == "cross_layer":
        return stack, vllm_adapter.topology_from_cross_layer(
            stack.kv_cache_config,
            stack.cross_layer_tensor,
            stack.cross_layer_backend,
            stack.sharing,
            stack.vllm_config,
        )
    return stack, vllm_adapter.topology_from_kv_caches(
        stack.kv_cache_config, stack.kv_caches, stack.backends, stack.sharing, layout=layout
    )


@pytest.fixture(scope="session")
def stack_topology():
    return cpu_topology
