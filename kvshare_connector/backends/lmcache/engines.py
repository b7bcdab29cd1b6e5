"""Plumbing around LMCache's engines: creating one per stream, key lookups, bounded waits.

Everything that touches LMCache's engine, storage manager or remote backends directly, other
than the store/retrieve calls themselves, lives here. Creating an engine overwrites vLLM's
global ``NONE_HASH``; ``vllm_none_hash_kept`` scopes that to the creation (see there).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from kvshare_connector.backends.lmcache.config import MAX_KEY_CHARS, LMCacheBackendConfig
from kvshare_connector.backends.lmcache.errors import LMCacheConfigError
from kvshare_connector.backends.lmcache.gpu_connector import OwnerRowsConnector
from kvshare_connector.backends.lmcache.rows import OwnerRows, Stream


@contextlib.contextmanager
def vllm_none_hash_kept() -> Iterator[None]:
    """Put vLLM's ``kv_cache_utils.NONE_HASH`` back as it was once the block exits.

    ``NONE_HASH`` is the seed of vLLM's prefix-cache block hash chain, a module global. Each
    LMCache ``TokenDatabase`` (built with every ``LMCacheEngine``) seeds its own chunk-hash
    chain by calling vLLM's ``init_none_hash`` with *its* hash function, which overwrites
    that global. When vLLM already seeded it in this process (an engine core in the same
    process: in-process engines, tests running several), its prefix cache would hash new
    blocks from another seed than the blocks it already holds. LMCache keeps its own copy
    of the value (``lmcache.v1.token_database.NONE_HASH``), so restoring vLLM's is invisible
    to LMCache. When vLLM has not seeded it yet (the usual order: ``EngineCore`` calls
    ``init_none_hash`` after the workers registered their KV), it is left as LMCache set
    it: vLLM seeds it itself later. Without vLLM installed this does nothing.
    """
    try:
        from vllm.v1.core import kv_cache_utils
    except ImportError:
        yield
        return
    saved = getattr(kv_cache_utils, "NONE_HASH", None)
    try:
        yield
    finally:
        if saved is not None:
            kv_cache_utils.NONE_HASH = saved


def create_engine(
    config: LMCacheBackendConfig,
    rows: OwnerRows,
    stream: Stream,
    model_name: str,
    width_share: float,
    engine_id: str,
    worker_id: int,
    world_size: int,
) -> tuple[str, Any]:
    """One ``LMCacheEngine`` for one stream, not yet ``post_init``-ed: (instance id, engine).

    ``model_name`` is the first part of its keys; ``width_share`` its share of the local CPU
    budget. The caller owns the instance (``destroy`` it) even if ``post_init`` fails.
    """
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.metadata import LMCacheMetadata

    key_chars = len(f"{model_name}@{world_size}@{worker_id}@{'f' * 16}@uint8")
    if key_chars > MAX_KEY_CHARS:
        raise LMCacheConfigError(
            f"LMCache keys for {model_name!r} would be {key_chars} characters "
            f"(limit {MAX_KEY_CHARS}); use a shorter lmcache.model_tag"
        )
    metadata = LMCacheMetadata(
        model_name=model_name,
        world_size=world_size,
        local_world_size=world_size,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=torch.uint8,
        kv_shape=(1, 1, config.chunk_size, 1, stream.width),
        role="worker",
        chunk_size=config.chunk_size,
    )
    instance = f"kvshare-{engine_id}-{stream.name}-{uuid.uuid4().hex[:8]}"
    engine_config = config.engine_config(width_share)
    with vllm_none_hash_kept():  # the engine's token database re-seeds vLLM's NONE_HASH
        engine = LMCacheEngineBuilder.get_or_create(
            instance,
            engine_config,
            metadata,
            OwnerRowsConnector(rows, stream),
            lambda tensor, src: tensor,
            lambda obj, src: obj,
        )
    return instance, engine


def destroy(instances: list[str]) -> None:
    """Destroy these engines (their event-loop threads would keep the process alive)."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    for instance in instances:
        LMCacheEngineBuilder.destroy(instance)


def remote_backends(engines: Iterator[Any] | list[Any]) -> list[Any]:
    """The remote storage backends of these engines (none: local CPU only)."""
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    return [
        backend
        for engine in engines
        for backend in engine.storage_manager.storage_backends.values()
        if isinstance(backend, RemoteBackend)
    ]


def chunk_keys(engine: Any, tokens: list[int], mask: Any) -> list[Any]:
    """LMCache's keys of the chunks of ``tokens`` under ``mask``."""
    return [key for _, _, key in engine.token_database.process_tokens(tokens, mask=mask)]


def probe_hash(engine: Any, tokens: list[int]) -> int:
    """LMCache's hash of the first chunk (0 for no tokens): equal on both sides only when
    they seed the hash chain alike (``PYTHONHASHSEED``, hash algorithm)."""
    for _, _, chunk_hash in engine.token_database.process_tokens(tokens, make_key=False):
        return int(chunk_hash)
    return 0


def count_present(engine: Any, keys: list[Any]) -> int:
    """How many of ``keys`` some tier of the engine holds."""
    if not keys:
        return 0
    hits, _ = engine.storage_manager.batched_contains(keys)
    return int(hits)


def wait_until(check: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``check`` until it holds (True) or ``timeout_s`` passed (False); checks at least
    once."""
    deadline = time.monotonic() + timeout_s
    while True:
        if check():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
