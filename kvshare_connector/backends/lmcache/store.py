"""``LMCacheStore``: store (prefill) and load (decode) owner-layer KV through LMCache engines.

LMCache's own vLLM connector cannot serve models with cross-layer KV sharing (it stores
sharer aliases as layers, assumes one head size, one KV cache group, and its CUDA ops do
not load with torch 2.11), so this drives ``LMCacheEngine`` directly with its own GPU
connector (``gpu_connector``): LMCache keys, chunks and stores the KV (local CPU, ``lm://``
server or any remote backend); which bytes go in (``rows``) and where they land
(``tables``) comes from our topology. Data keys carry a model tag and the layout
fingerprint, so different layouts never share bytes; a per-request header (``header``) lets
decode say why a load cannot work (layout, ``PYTHONHASHSEED``, options).

This module imports LMCache; the backend imports it only when a worker starts.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvshare_connector.backends.lmcache import engines as lm
from kvshare_connector.backends.lmcache.config import MODEL_TAG, LMCacheBackendConfig
from kvshare_connector.backends.lmcache.errors import (
    LMCacheConfigError,
    LMCacheLoadError,
    LMCacheStoreError,
)
from kvshare_connector.backends.lmcache.gpu_connector import Transfer
from kvshare_connector.backends.lmcache.header import (
    HEADER_VERSION,
    HeaderSlots,
    StoredHeader,
    check_header,
)
from kvshare_connector.backends.lmcache.rows import OwnerRows, Stream, streams_of
from kvshare_connector.backends.lmcache.tables import cut_tables, load_from, store_from
from kvshare_connector.common.log import get_logger
from kvshare_connector.layout.topology import KVTopology
from kvshare_connector.transfer.wire import protocol

logger = get_logger(__name__)


@dataclass(frozen=True)
class StoreReceipt:
    """A stored request: keys to watch until the remote holds them."""

    request_id: str
    num_tokens: int
    nbytes: int  # bytes of the memory objects handed to LMCache (header excluded)
    stored_from: tuple[int, ...]
    keys: tuple[Any, ...]  # CacheEngineKeys: data chunks, then the headers
    seconds: float


@dataclass(frozen=True)
class LoadReceipt:
    request_id: str
    num_tokens: int  # tokens of the prompt whose KV is now in the blocks
    nbytes: int
    seconds: float


class LMCacheStore:
    """Store (prefill) and load (decode) owner-layer KV through LMCache engines.

    ``tensors``: the dict vLLM hands to ``register_kv_caches`` (sharer aliases are
    ignored), or the single cross-layer blocks tensor. ``topology`` is the one built from
    the same tensors. Synchronous: ``store`` copies the KV out before it returns (remote
    puts continue in LMCache's thread; see ``is_stored``), ``load`` copies it in.
    """

    def __init__(
        self,
        config: LMCacheBackendConfig,
        topology: KVTopology,
        tensors: Mapping[str, Any] | Any,
        model_tag: str,
        engine_id: str = "kvshare",
        worker_id: int = 0,
        world_size: int = 1,
    ):
        config.validate()
        tag = config.model_tag or model_tag
        if not MODEL_TAG.match(tag):
            raise LMCacheConfigError(
                f"model tag {tag!r}: use 1-64 characters of [A-Za-z0-9._-] "
                "(set lmcache.model_tag, or use default_model_tag())"
            )
        remote = config.remote_url or config.lmcache.get("remote_storage_plugins")
        if remote and os.environ.get("PYTHONHASHSEED") is None:
            raise LMCacheConfigError(
                "PYTHONHASHSEED is not set: LMCache starts its chunk-hash chain from vLLM's "
                "NONE_HASH, which is random without it, so decode would never find what "
                "prefill stored. Export the same PYTHONHASHSEED for prefill and decode."
            )
        if not config.track_usage:  # LMCache's only switch; an explicit env var wins
            os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
        self.config = config
        self.topology = topology
        self.model_tag = tag
        self.fingerprint = topology.logical_fingerprint()
        self.streams = streams_of(topology)
        self.rows = OwnerRows(topology, tensors)
        self._layout = protocol.layout_to_msg(topology)
        self._ids: list[str] = []
        self.engines: dict[str, Any] = {}
        total = sum(s.width for s in self.streams)
        try:
            for stream in self.streams:
                instance, engine = lm.create_engine(
                    config,
                    self.rows,
                    stream,
                    f"{tag}.kvs{self.fingerprint}.{stream.name}",
                    stream.width / total,
                    engine_id,
                    worker_id,
                    world_size,
                )
                self._ids.append(instance)
                engine.post_init()
                self.engines[stream.name] = engine
            self._check_remote_reachable()
        except BaseException:
            self.close()
            raise
        self._first_engine = self.engines[self.streams[0].name]
        self._headers = HeaderSlots(
            self._first_engine,
            tag,
            self.fingerprint,
            worker_id,
            world_size,
            self.streams[0].width,
            config.remote_url or "local CPU only",
        )
        logger.info(
            "LMCache backend %s: %d stream(s) %s, %d B per token (owner layers only: %d "
            "of %d layers own KV), chunk %d, %s",
            tag,
            len(self.streams),
            [f"{s.name}:{s.width}B" for s in self.streams],
            total,
            len(topology.owners),
            len(topology.owners) + len(topology.sharers),
            config.chunk_size,
            config.remote_url or "local CPU only",
        )

    # -- prefill ---------------------------------------------------------------------------

    def store(
        self, request_id: str, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]]
    ) -> StoreReceipt:
        """Copy the KV of ``token_ids`` out of the blocks into LMCache.

        ``block_ids``: one block table per KV cache group from position 0, as vLLM hands
        them to ``request_finished`` (null block 0 where a sliding window dropped one).
        """
        started = time.perf_counter()
        tokens = [int(t) for t in token_ids]
        n = len(tokens)
        if n == 0:
            raise LMCacheStoreError(f"request {request_id}: no tokens to store")
        tables = cut_tables(self.topology, block_ids, n, LMCacheStoreError)
        stored_from = [store_from(self.topology, g, tables[g], n) for g in range(len(tables))]
        keys: list[Any] = []
        nbytes = 0
        for stream, engine, mask, skip in self._stream_masks(stored_from, n):
            transfer = Transfer(tables, stored_from)
            engine.store(tokens, mask=mask, kvshare=transfer, req_id=request_id)
            covered = _covered(transfer.chunks)
            if covered != (skip, n):
                raise LMCacheStoreError(
                    f"request {request_id}: LMCache stored tokens {covered} of stream "
                    f"{stream.name}, expected [{skip}, {n}) (local CPU memory full?)"
                )
            nbytes += transfer.nbytes
            keys.extend(lm.chunk_keys(engine, tokens, mask))
        header = StoredHeader(
            version=HEADER_VERSION,
            model_tag=self.model_tag,
            request_id=request_id,
            num_tokens=n,
            chunk_size=self.config.chunk_size,
            hash_algorithm=self._hash_algorithm,
            probe_hash=lm.probe_hash(self._first_engine, tokens),
            stored_from=stored_from,
            layout=self._layout,
        )
        keys.extend(self._headers.put(tokens, header))
        seconds = time.perf_counter() - started
        receipt = StoreReceipt(request_id, n, nbytes, tuple(stored_from), tuple(keys), seconds)
        logger.debug(
            "request %s: stored %d token(s), %d B (%.1f B/token) in %.3f s",
            request_id,
            n,
            nbytes,
            nbytes / n,
            receipt.seconds,
        )
        return receipt

    def is_stored(self, receipt: StoreReceipt) -> bool:
        """Whether every key of the request reached the remote backend(s) (at once without
        one). The blocks need not wait for it: ``store`` copied the KV out already."""
        remotes = lm.remote_backends(list(self.engines.values()))
        if not remotes:
            return True
        for backend in remotes:
            if any(backend.exists_in_put_tasks(k) for k in receipt.keys):
                return False
            if not all(backend.contains(k) for k in receipt.keys):
                return False
        return True

    def wait_stored(self, receipt: StoreReceipt, timeout_s: float | None = None) -> None:
        """Block until ``is_stored`` (bounded); ``LMCacheStoreError`` on timeout."""
        limit = self.config.store_timeout_s if timeout_s is None else timeout_s
        if not lm.wait_until(lambda: self.is_stored(receipt), limit):
            raise LMCacheStoreError(
                f"request {receipt.request_id}: the remote backend did not confirm "
                f"{len(receipt.keys)} key(s) within {limit} s ({self.config.remote_url})"
            )

    # -- decode ----------------------------------------------------------------------------

    def load(
        self,
        request_id: str,
        token_ids: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        num_computed_tokens: int = 0,
        timeout_s: float | None = None,
    ) -> LoadReceipt:
        """Copy the stored KV of ``token_ids`` into this engine's blocks.

        ``block_ids``: block tables per group from position 0 (``KVCacheBlocks.
        get_block_ids()``, null block 0 where vLLM skipped a sliding-window block);
        positions below ``num_computed_tokens`` (a local prefix-cache hit) are left
        alone. Waits up to ``timeout_s`` for prefill's puts to arrive. Raises
        ``LMCacheLoadError`` (miss, partial, seed), ``LayoutMismatch`` (layouts differ).
        """
        started = time.perf_counter()
        tokens = [int(t) for t in token_ids]
        n = len(tokens)
        if not 0 <= num_computed_tokens <= n:
            raise LMCacheLoadError(
                f"request {request_id}: num_computed_tokens {num_computed_tokens} outside [0, {n}]"
            )
        limit = self.config.load_timeout_s if timeout_s is None else timeout_s
        header = self._headers.get(request_id, tokens, limit)
        check_header(
            request_id,
            header,
            tokens,
            self.topology,
            self.fingerprint,
            self.config.chunk_size,
            self._hash_algorithm,
            lambda: lm.probe_hash(self._first_engine, tokens),
        )
        tables = cut_tables(self.topology, block_ids, n, LMCacheLoadError)
        first = [
            load_from(
                self.topology,
                request_id,
                g,
                tables[g],
                n,
                num_computed_tokens,
                header.stored_from[g],
            )
            for g in range(len(tables))
        ]
        plans = [
            (stream, engine, mask, skip, lm.chunk_keys(engine, tokens, mask))
            for stream, engine, mask, skip in self._stream_masks(first, n)
        ]
        for stream, engine, _, skip, keys in plans:  # prefill's puts may still be landing
            if not lm.wait_until(lambda e=engine, k=keys: lm.count_present(e, k) == len(k), limit):
                found = lm.count_present(engine, keys)
                raise LMCacheLoadError(
                    f"request {request_id}: LMCache holds {found} of {len(keys)} chunk(s) "
                    f"of stream {stream.name} (tokens [{skip}, {n})) after {limit} s"
                )
        nbytes = 0
        for stream, engine, mask, skip, _ in plans:
            transfer = Transfer(tables, first)
            got = engine.retrieve(tokens, mask=mask, kvshare=transfer, req_id=request_id)
            if int(got[skip:].sum()) != n - skip:
                raise LMCacheLoadError(
                    f"request {request_id}: LMCache returned {int(got[skip:].sum())} of "
                    f"{n - skip} token(s) of stream {stream.name}"
                )
            nbytes += transfer.nbytes
        return LoadReceipt(request_id, n, nbytes, time.perf_counter() - started)

    # -- shutdown --------------------------------------------------------------------------

    def close(self) -> None:
        lm.destroy(self._ids)
        self._ids.clear()
        self.engines.clear()

    # -- helpers ---------------------------------------------------------------------------

    def _stream_masks(
        self, first: Sequence[int], n: int
    ) -> list[tuple[Stream, Any, torch.Tensor, int]]:
        """``(stream, engine, mask, skip)`` of each stream with tokens to copy: LMCache keys
        whole chunks, so the mask starts at the chunk holding the stream's first position
        (``first[g]`` per group) and the chunks before it are skipped."""
        chunk = self.config.chunk_size
        found = []
        for stream in self.streams:
            begin = min(first[g] for g in stream.groups)
            if begin >= n:
                continue
            skip = begin // chunk * chunk
            mask = torch.ones(n, dtype=torch.bool)
            mask[:skip] = False
            found.append((stream, self.engines[stream.name], mask, skip))
        return found

    @property
    def _hash_algorithm(self) -> str:
        return str(self.config.lmcache.get("pre_caching_hash_algorithm", "builtin"))

    def _check_remote_reachable(self) -> None:
        if self.config.remote_url is None:
            return
        for backend in lm.remote_backends(list(self.engines.values())):
            if backend.connection is None:
                raise LMCacheConfigError(
                    f"lmcache.remote_url {self.config.remote_url}: cannot connect (is the "
                    "LMCache server running?)"
                )


def _covered(chunks: list[tuple[int, int]]) -> tuple[int, int] | None:
    """``(start, end)`` if the chunks tile one range without gaps."""
    if not chunks:
        return None
    chunks = sorted(chunks)
    for (_, end), (start, _) in itertools.pairwise(chunks):
        if start != end:
            return None
    return chunks[0][0], chunks[-1][1]
