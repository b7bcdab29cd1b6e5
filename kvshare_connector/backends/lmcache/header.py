"""The per-request header: what prefill stored, for decode to check before it loads.

Next to the data, prefill stores a small msgpack header under a key of its own (a sha256 of
the tokens, independent of LMCache's hashing and ``PYTHONHASHSEED``), twice: under the model
tag and layout fingerprint (what a decode with the same layout reads) and under the model tag
alone (found by a decode with another layout, to say what differs). It carries prefill's
layout, token count, stored ranges, chunk size, hash algorithm and LMCache's hash of the
first chunk, so a load fails with the reason instead of silently missing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import msgspec
import numpy as np

from kvshare_connector.backends.lmcache.engines import wait_until
from kvshare_connector.backends.lmcache.errors import (
    HashSeedMismatch,
    LMCacheLoadError,
    LMCacheStoreError,
)
from kvshare_connector.layout.matching import LayoutMismatch, differences
from kvshare_connector.layout.topology import KVTopology
from kvshare_connector.transfer.wire import protocol

HEADER_VERSION = 1


class StoredHeader(msgspec.Struct, forbid_unknown_fields=True):
    """What prefill stored for one request, for decode to check before it loads."""

    version: int
    model_tag: str
    request_id: str
    num_tokens: int
    chunk_size: int
    hash_algorithm: str
    probe_hash: int  # LMCache's key hash of the first chunk on the storing side
    stored_from: list[int]  # per KV cache group: first position stored
    layout: protocol.LayoutMsg


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StoredHeader)


def tokens_digest(token_ids: Sequence[int]) -> int:
    """A request key of our own (independent of LMCache's hashing and PYTHONHASHSEED)."""
    data = np.asarray(token_ids, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.sha256(b"kvshare-hdr-v1" + data).digest()[:8], "big")


class HeaderSlots:
    """Puts and gets headers through one LMCache engine's storage manager (all tiers)."""

    def __init__(
        self,
        engine: Any,
        model_tag: str,
        fingerprint: str,
        worker_id: int,
        world_size: int,
        row_width: int,
        where: str,
    ):
        self.engine = engine
        self.model_tag = model_tag
        self.fingerprint = fingerprint
        self.worker = (worker_id, world_size)
        self.row_width = row_width  # the engine's row width: headers are stored as rows
        self.where = where  # for miss messages: the remote URL or "local CPU only"

    def keys(self, tokens: list[int]) -> tuple[Any, Any]:
        """Under our layout (what decode reads) and under the model tag alone."""
        import torch
        from lmcache.utils import CacheEngineKey

        worker_id, world_size = self.worker
        digest = tokens_digest(tokens)
        return tuple(
            CacheEngineKey(name, world_size, worker_id, digest, torch.uint8)
            for name in (f"{self.model_tag}.kvs{self.fingerprint}.hdr", f"{self.model_tag}.hdr")
        )

    def put(self, tokens: list[int], header: StoredHeader) -> list[Any]:
        """Store ``header`` under both keys; return them."""
        import torch

        blob = _encoder.encode(header)
        payload = torch.frombuffer(
            bytearray(len(blob).to_bytes(8, "little") + blob), dtype=torch.uint8
        )
        engine = self.engine
        rows = -(-payload.numel() // self.row_width)
        keys = list(self.keys(tokens))
        objs = []
        for _ in keys:
            obj = engine.storage_manager.allocate(
                engine.metadata.get_shapes(rows), [torch.uint8], busy_loop=False
            )
            if obj is None:
                raise LMCacheStoreError(
                    f"request {header.request_id}: no LMCache memory left for its header"
                )
            flat = obj.tensor.view(-1)
            flat.zero_()
            flat[: payload.numel()] = payload
            objs.append(obj)
        engine.storage_manager.batched_put(keys, objs)
        return keys

    def get(self, request_id: str, tokens: list[int], limit: float) -> StoredHeader:
        """Our layout's header, else any layout's (for the mismatch report), after
        waiting up to ``limit`` seconds for prefill's puts."""
        manager = self.engine.storage_manager
        keys = self.keys(tokens)
        found: list[Any] = []

        def present() -> bool:
            found[:] = [k for k in keys if manager.contains(k) is not None]
            return bool(found)

        if not wait_until(present, limit):
            raise LMCacheLoadError(
                f"request {request_id}: LMCache holds no KV for these {len(tokens)} token(s) "
                f"under model tag {self.model_tag!r} (waited {limit} s; {self.where})"
            )
        obj = manager.get(found[0])
        if obj is None:
            raise LMCacheLoadError(f"request {request_id}: the stored header vanished")
        try:
            flat = obj.tensor.view(-1).cpu()
            size = int.from_bytes(flat[:8].numpy().tobytes(), "little")
            blob = flat[8 : 8 + size].numpy().tobytes()
        finally:
            obj.ref_count_down()
        try:
            return _decoder.decode(blob)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise LMCacheLoadError(
                f"request {request_id}: unreadable stored header ({exc}); another kvshare "
                "version stored it?"
            ) from exc


def check_header(
    request_id: str,
    header: StoredHeader,
    tokens: list[int],
    topology: KVTopology,
    fingerprint: str,
    chunk_size: int,
    hash_algorithm: str,
    probe_hash: Callable[[], int],
) -> None:
    """Raise why this engine cannot load what prefill stored: header version,
    ``LayoutMismatch`` (naming every difference; ``fingerprint``: the topology's logical
    fingerprint), token count, chunk size or hash algorithm,
    ``HashSeedMismatch`` (``probe_hash``: this engine's hash of the first chunk)."""
    if header.version != HEADER_VERSION:
        raise LMCacheLoadError(
            f"request {request_id}: stored header version {header.version}, this engine "
            f"reads {HEADER_VERSION}"
        )
    if header.layout.fingerprint != fingerprint:
        remote = protocol.layout_from_msg(header.layout)
        found = differences(logical(topology), logical(remote)) or [
            f"layout fingerprint: local {fingerprint}, remote {header.layout.fingerprint}"
        ]
        raise LayoutMismatch(found, topology.layout, remote.layout)
    if header.num_tokens != len(tokens):
        raise LMCacheLoadError(
            f"request {request_id}: prefill stored {header.num_tokens} token(s), "
            f"{len(tokens)} asked for"
        )
    for what, mine, theirs in (
        ("chunk_size", chunk_size, header.chunk_size),
        ("pre_caching_hash_algorithm", hash_algorithm, header.hash_algorithm),
    ):
        if mine != theirs:
            raise LMCacheLoadError(
                f"request {request_id}: lmcache.{what} differs: local {mine}, prefill "
                f"{theirs} (both sides must use the same)"
            )
    probe = probe_hash()
    if probe != header.probe_hash:
        raise HashSeedMismatch(
            f"request {request_id}: the same tokens hash to different LMCache keys here "
            f"({probe:x}) and on the prefill side ({header.probe_hash:x}): export the "
            "same PYTHONHASHSEED for both engines (LMCache starts its hash chain from it)"
        )


def logical(topology: KVTopology) -> KVTopology:
    """The topology with every owner's physical block order made equal: rows are
    canonical per token, so two engines with different memory layouts interoperate."""
    owners = {
        name: replace(owner, geometry=replace(owner.geometry, dims=(), split=0))
        for name, owner in topology.owners.items()
    }
    return replace(topology, owners=owners)
