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
    from kvshare_connector.cpu_stack import topology_of

    stack = cpu_stack(model, layout, kv_mib)
    return stack, topology_of(stack)


@pytest.fixture(scope="session")
def stack_topology():
    return cpu_topology
