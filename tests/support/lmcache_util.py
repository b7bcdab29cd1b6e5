"""Helpers for the LMCache backend tests and their child process (``support/lmcache_peer.py``).

Block tables mimic vLLM's: one list per KV cache group from position 0, ids unique
across groups (HMA groups may overlay one buffer), null block 0 for sliding-window
blocks vLLM no longer holds. ``token_bytes`` reads a token's KV through the owner's
*logical* tensor view (its dim labels), independently of the backend's stride-based
views, so comparing the two checks the stored format itself.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvshare_connector.layout.topology import BLOCK, CONTENT, DIM, HEAD, KV, TOKEN, KVTopology
from kvshare_connector.toolkit.procs import pick_free_port

from .blockutil import disjoint_block_ids

QUIET_ENV = {"LMCACHE_LOG_LEVEL": "WARNING", "LMCACHE_TRACK_USAGE": "false"}


def quiet_lmcache() -> None:
    """Before LMCache is imported: warnings only, no usage telemetry."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)


@contextlib.contextmanager
def running_lm_server() -> Iterator[str]:
    """LMCache's own ``lm://`` server on 127.0.0.1 in a child process: its URL, once it
    accepts connections; stopped on exit."""
    from kvshare_connector.common.child_process import Child, wait_for_port

    port = pick_free_port()
    server = Child(
        ["-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
        env=QUIET_ENV,
        cwd=str(Path(__file__).resolve().parents[2]),
    )
    try:
        try:
            wait_for_port("127.0.0.1", port, 60, alive=lambda: server.process.poll() is None)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(
                f"lm server did not start ({exc}):\n" + "".join(server.log)
            ) from None
        yield f"lm://127.0.0.1:{port}"
    finally:
        server.kill()


def build(model: str, layout: str, kv_mib: int = 32) -> tuple[Any, KVTopology, Any]:
    """A CPU KV stack, its topology and what the worker would hand the backend (one per
    model, layout and size in a process)."""
    return _build(model, layout, kv_mib)


@functools.cache
def _build(model: str, layout: str, kv_mib: int) -> tuple[Any, KVTopology, Any]:
    from kvshare_connector.demo.cpu_stack import build_cpu_stack, topology_of

    stack = build_cpu_stack(model, layout, kv_bytes=kv_mib << 20, max_model_len=1024)
    # vLLM 0.33's block-major "cross_layer" is per-layer views again, not one tensor.
    cross = stack.cross_layer_tensor
    tensors = cross if cross is not None else stack.kv_caches
    return stack, topology_of(stack), tensors


def full_tables(topology: KVTopology, n: int, seed: int) -> list[list[int]]:
    """Block tables covering ``n`` tokens in every group (all blocks held)."""
    counts = [-(-n // g.spec.block_size) for g in topology.groups]
    return disjoint_block_ids(topology.num_blocks, counts, seed)


def window_first_block(topology: KVTopology, group: int, n: int) -> int:
    """Index of the first block a sliding-window group still needs after ``n`` tokens."""
    spec = topology.groups[group].spec
    if spec.sliding_window is None:
        return 0
    return max(0, n - spec.sliding_window) // spec.block_size


def drop_outside_windows(topology: KVTopology, tables: list[list[int]], n: int) -> list[list[int]]:
    """What vLLM leaves in a finished request's tables: null blocks before the window."""
    out = []
    for group, ids in enumerate(tables):
        first = window_first_block(topology, group, n)
        out.append([0] * first + list(ids[first:]))
    return out


def held(tables: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Non-null blocks per group and the position (block index) of the first one."""
    ids, firsts = [], []
    for table in tables:
        first = next((i for i, b in enumerate(table) if b != 0), len(table))
        ids.append(list(table[first:]))
        firsts.append(first)
    return ids, firsts


def token_bytes(
    kv_caches: Any, topology: KVTopology, name: str, table: list[int], positions: np.ndarray
) -> Any:
    """uint8 ``[len(positions), 2 * heads * head_size * itemsize]``: each token's K and V
    per head, read through the owner's logical tensor (vLLM's dim labels)."""
    import torch

    owner = topology.owners[name]
    tensor, labels = kv_caches[name], owner.labels
    kernel_tokens = tensor.shape[labels.index(TOKEN)]
    per_block = owner.spec.block_size // kernel_tokens
    order = [BLOCK, TOKEN] + [x for x in (HEAD, KV, CONTENT, DIM) if x in labels]
    view = tensor.permute(*[labels.index(x) for x in order])
    bs = owner.spec.block_size
    blocks = np.asarray(table, dtype=np.int64)[positions // bs]
    offsets = positions % bs
    kernel_blocks = torch.from_numpy(blocks * per_block + offsets // kernel_tokens)
    tokens = torch.from_numpy(offsets % kernel_tokens)
    picked = view[kernel_blocks, tokens].reshape(len(positions), -1).contiguous()
    return picked.view(torch.uint8)


def config(remote_url: str | None = None, **extra: Any) -> Any:
    from kvshare_connector.backends.lmcache.config import LMCacheBackendConfig

    section = {"max_local_cpu_size_gb": 0.05, "load_timeout_s": 5.0, **extra}
    if remote_url is not None:
        section["remote_url"] = remote_url
    return LMCacheBackendConfig.from_extra_config({"backend": "lmcache", "lmcache": section})


def prompt(n: int, first: int) -> list[int]:
    """Token ids of a prompt (distinct prompts for distinct ``first``)."""
    return [(first + 7 * i) % 50_000 + 1 for i in range(n)]
