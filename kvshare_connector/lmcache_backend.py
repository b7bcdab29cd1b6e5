"""LMCache 0.5.6 as a KV store for prefill/decode: owner layers only, any layout, HMA groups.

LMCache's own vLLM connector cannot serve models with cross-layer KV sharing (it stores
sharer aliases as layers, assumes one head size, one KV cache group, and its CUDA ops do
not load with torch 2.11), so this module drives ``LMCacheEngine`` directly with its own
GPU connector. LMCache keys, chunks and stores the KV (local CPU, ``lm://`` server or any
remote backend); which bytes go in and where they land comes from our topology.

Stored format. A memory object holds one chunk of tokens as uint8 rows ``[1, 1, T, W]``:
row ``t`` is token ``t``'s KV of every owner layer of one *stream*, owner after owner in
group order, each owner as ``(head, K|V, head_size)`` elements (vLLM's packed content and
split K/V layouts give the same bytes). Sharers never appear; they read their target.
Rows are gathered and scattered with plain torch index ops on views built from each
owner's block geometry (strides), so per-layer, HMA-overlaid, cross-layer and kvcached
buffers need no special case and no LMCache kernel.

Streams. Groups with the same sliding window form a stream (one ``LMCacheEngine``, one
row width). Full attention is stored for every token; a sliding-window stream only from
the chunk holding the first position decode can still attend to (``num_tokens - window``:
the last prompt token, recomputed by decode, attends to ``[n - window, n)``), because vLLM
frees older blocks and they are never read again. Decode writes a sliding group only where
it holds blocks and from the first position prefill stored; it fails if it holds a needed
position that prefill did not store.

Checks. Data keys carry a model tag and the layout fingerprint, so different layouts never
share bytes. A per-request header (keyed by a sha256 of the tokens under the model tag)
carries prefill's layout, token count, stored ranges and the hash of the first chunk:
decode turns a fingerprint difference into ``matching.LayoutMismatch`` naming what
differs, and a chunk-hash difference into ``HashSeedMismatch`` (``PYTHONHASHSEED``).
"""

from __future__ import annotations

import difflib
import hashlib
import itertools
import math
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import msgspec
import numpy as np

from kvshare_connector import protocol
from kvshare_connector.log import get_logger
from kvshare_connector.matching import LayoutMismatch, differences
from kvshare_connector.topology import (
    CONTENT,
    DIM,
    HEAD,
    KV,
    SUB_BLOCK,
    TOKEN,
    BlockGeometry,
    Dim,
    KVTopology,
)

logger = get_logger(__name__)

HEADER_VERSION = 1
_MODEL_TAG = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_MAX_KEY_CHARS = 150  # lmcache.v1.protocol.MAX_KEY_LENGTH (lm:// wire format)
# Physical dims inside a logical block, in the order rows are written: tokens first
# (kernel sub-blocks, then tokens of a kernel block), then one token's KV.
_CANONICAL = (SUB_BLOCK, TOKEN, HEAD, KV, CONTENT, DIM)


class LMCacheConfigError(ValueError):
    """``kv_connector_extra_config`` does not describe a usable LMCache backend."""


class LMCacheStoreError(RuntimeError):
    """A request's KV could not be stored (nothing is announced as stored)."""


class LMCacheLoadError(RuntimeError):
    """A request's KV could not be loaded; the request must be computed locally."""


class HashSeedMismatch(LMCacheLoadError):
    """Both sides hash the same tokens to different LMCache keys."""


# ---- configuration ------------------------------------------------------------------------


# LMCache options this backend decides itself or cannot honour, with the reason.
_FORBIDDEN = {
    "max_local_cpu_size": "use max_local_cpu_size_gb",
    "save_unfull_chunk": "always on: the last partial chunk of a prompt must be stored",
    "use_layerwise": "layer-wise transfer is not supported by this backend",
    "enable_blending": "CacheBlend needs LMCache's own KV format",
    "enable_pd": "LMCache's PD mode uses its own connector and proxy protocol",
    "enable_p2p": "P2P sharing needs LMCache's controller and own connector",
    "enable_async_loading": "loads are synchronous in this backend",
    "save_only_first_rank": "MLA-only option",
}
_OWN_KEYS = {
    "remote_url",
    "chunk_size",
    "local_cpu",
    "max_local_cpu_size_gb",
    "model_tag",
    "load_timeout_s",
    "store_timeout_s",
    "track_usage",
}


@dataclass(frozen=True)
class LMCacheBackendConfig:
    """The ``"lmcache"`` part of ``kv_connector_extra_config``, validated."""

    remote_url: str | None = None
    chunk_size: int = 256
    local_cpu: bool = True
    max_local_cpu_size_gb: float = 2.0
    model_tag: str | None = None  # default: derived from the served model name
    load_timeout_s: float = 10.0  # decode waits this long for prefill's puts to land
    store_timeout_s: float = 30.0  # prefill waits this long for its puts to land
    track_usage: bool = False  # LMCache's anonymous usage telemetry (HTTP, on by default)
    lmcache: Mapping[str, Any] = field(default_factory=dict)  # other LMCache options

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> LMCacheBackendConfig:
        """Parse ``{"backend": "lmcache", "lmcache": {...}}``; every error names the key."""
        extra = dict(extra or {})
        if extra.get("backend") != "lmcache":
            raise LMCacheConfigError(
                f'kv_connector_extra_config["backend"] is {extra.get("backend")!r}, '
                'expected "lmcache" for the LMCache backend'
            )
        section = extra.get("lmcache", {})
        if not isinstance(section, Mapping):
            raise LMCacheConfigError(
                'kv_connector_extra_config["lmcache"] must be an object, got '
                f"{type(section).__name__}"
            )
        known = _lmcache_option_names()
        passthrough: dict[str, Any] = {}
        for key, value in section.items():
            if key in _OWN_KEYS:
                continue
            if key in _FORBIDDEN:
                raise LMCacheConfigError(f"lmcache.{key}: not allowed here ({_FORBIDDEN[key]})")
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known | _OWN_KEYS), n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise LMCacheConfigError(f"lmcache.{key}: unknown LMCache option{hint}")
            passthrough[key] = value
        passthrough.setdefault("pre_caching_hash_algorithm", "sha256_cbor")

        def typed(key: str, kind: type, default: Any) -> Any:
            value = section.get(key, default)
            ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value, ok = float(value), True
            if not ok and not (value is None and default is None):
                raise LMCacheConfigError(f"lmcache.{key}: expected {kind.__name__}, got {value!r}")
            return value

        config = cls(
            remote_url=typed("remote_url", str, None),
            chunk_size=typed("chunk_size", int, 256),
            local_cpu=typed("local_cpu", bool, True),
            max_local_cpu_size_gb=typed("max_local_cpu_size_gb", float, 2.0),
            model_tag=typed("model_tag", str, None),
            load_timeout_s=typed("load_timeout_s", float, 10.0),
            store_timeout_s=typed("store_timeout_s", float, 30.0),
            track_usage=typed("track_usage", bool, False),
            lmcache=passthrough,
        )
        config.validate()
        return config

    def validate(self) -> None:
        if self.chunk_size <= 0:
            raise LMCacheConfigError(f"lmcache.chunk_size: {self.chunk_size} must be > 0")
        if self.max_local_cpu_size_gb <= 0:
            raise LMCacheConfigError(
                "lmcache.max_local_cpu_size_gb must be > 0 (LMCache stages every chunk "
                "in local CPU memory, also for remote backends)"
            )
        for key in ("load_timeout_s", "store_timeout_s"):
            if getattr(self, key) < 0:
                raise LMCacheConfigError(f"lmcache.{key} must be >= 0")
        if self.remote_url is not None:
            check_remote_url(self.remote_url)
        elif not self.local_cpu:
            raise LMCacheConfigError(
                "lmcache: local_cpu is false and no remote_url is set: nowhere to store KV"
            )
        if self.model_tag is not None and not _MODEL_TAG.match(self.model_tag):
            raise LMCacheConfigError(
                f"lmcache.model_tag {self.model_tag!r}: use 1-64 characters of "
                "[A-Za-z0-9._-] (LMCache splits its keys on '@')"
            )
        serde = self.lmcache.get("remote_serde", "naive")
        if serde != "naive":
            raise LMCacheConfigError(
                f"lmcache.remote_serde: {serde!r}; only 'naive' keeps the byte rows intact"
            )

    def engine_config(self, width_share: float) -> Any:
        """``LMCacheEngineConfig`` for one stream (``width_share`` of the local CPU budget)."""
        from lmcache.v1.config import LMCacheEngineConfig

        options = {
            **self.lmcache,
            "chunk_size": self.chunk_size,
            "local_cpu": self.local_cpu,
            "max_local_cpu_size": self.max_local_cpu_size_gb * width_share,
            "remote_url": self.remote_url,
            "remote_serde": "naive",
            "save_unfull_chunk": True,
        }
        try:
            return LMCacheEngineConfig.from_defaults(**options)
        except Exception as exc:  # LMCache's own validation, with its message
            raise LMCacheConfigError(f"lmcache: LMCache rejected the options: {exc}") from exc


def _lmcache_option_names() -> set[str]:
    from lmcache.v1 import config as lmcache_config

    return set(lmcache_config._CONFIG_DEFINITIONS)


def check_remote_url(url: str) -> None:
    """``lm://host:port`` (checked) or another LMCache remote scheme (``scheme://...``)."""
    parts = urlsplit(url)
    if not parts.scheme or "://" not in url:
        raise LMCacheConfigError(
            f"lmcache.remote_url {url!r}: expected scheme://host:port, e.g. lm://127.0.0.1:65432"
        )
    if parts.scheme == "lm":
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None or not 0 < port < 65536:
            raise LMCacheConfigError(
                f"lmcache.remote_url {url!r}: an lm:// URL needs a host and a port in 1-65535"
            )


def default_model_tag(model: str) -> str:
    """A key-safe tag from a model name or path (its last path component)."""
    base = model.rstrip("/").rsplit("/", 1)[-1] or "model"
    return re.sub(r"[^A-Za-z0-9._-]", "_", base)[:64]


# ---- owner rows: the stored format, with plain torch ops ----------------------------------


@dataclass(frozen=True)
class OwnerColumns:
    """Where one owner layer's bytes sit in a stream's token row."""

    name: str
    group: int
    offset: int
    width: int  # bytes per token: 2 * heads * head_size * itemsize


@dataclass(frozen=True)
class Stream:
    """Groups stored together: same sliding window, so the same token range."""

    name: str  # "full" or "swa<window>"
    window: int | None
    groups: tuple[int, ...]
    owners: tuple[OwnerColumns, ...]
    width: int  # bytes per token row


def streams_of(topology: KVTopology) -> tuple[Stream, ...]:
    """Owners grouped by sliding window, columns in group order (a pure function of the
    logical layout, so both sides agree on it whenever their fingerprints agree)."""
    by_window: dict[int | None, list[int]] = {}
    for group in topology.groups:
        if group.layer_names:
            by_window.setdefault(group.spec.sliding_window, []).append(group.index)
    streams = []
    for window, groups in sorted(by_window.items(), key=lambda kv: (kv[0] is not None, kv[0])):
        owners, offset = [], 0
        for index in groups:
            spec = topology.groups[index].spec
            width = 2 * spec.num_kv_heads * spec.head_size * spec.itemsize
            for name in topology.groups[index].layer_names:
                owners.append(OwnerColumns(name, index, offset, width))
                offset += width
        name = "full" if window is None else f"swa{window}"
        streams.append(Stream(name, window, tuple(groups), tuple(owners), offset))
    return tuple(streams)


def owner_bytes_per_token(topology: KVTopology) -> int:
    """Bytes one token of KV takes when only owner layers are stored."""
    return sum(stream.width for stream in streams_of(topology))


def lmcache_v1_bytes_per_token(model_config: Any, parallel_config: Any) -> int:
    """What LMCache's ``LMCacheConnectorV1`` stores per token: ``[2, L, T, H*D]`` in the
    KV dtype with L, H, D from the model config (every layer, sharers included, one head
    size for all layers; ``vllm_service_factory.py``, ``gpu_connectors.py`` in 0.5.6)."""
    layers = model_config.get_num_layers(parallel_config)
    heads = model_config.get_num_kv_heads(parallel_config)
    head_size = model_config.get_head_size()
    return 2 * layers * heads * head_size * model_config.dtype.itemsize


class OwnerRows:
    """Gather / scatter token rows of owner layers between KV blocks and row tensors.

    One canonical view per owner, ``[num_blocks, (sub_block,) token, (head,) (kv,)
    content|dim]`` in integer dtypes of the KV's element size, built with ``as_strided``
    from the owner's block geometry over the storage vLLM handed us. Rows are the
    views' last dims flattened to bytes.
    """

    def __init__(self, topology: KVTopology, tensors: Mapping[str, Any] | Any):
        import torch

        self.topology = topology
        self.views: dict[str, Any] = {}
        self.device = None
        for name, owner in topology.owners.items():
            tensor = tensors[name] if isinstance(tensors, Mapping) else tensors
            view = _canonical_view(name, tensor, owner.geometry, topology.num_blocks)
            tokens = math.prod(view.shape[1 : 1 + _token_dims(owner.geometry)])
            width = view[0].numel() // tokens * owner.geometry.itemsize
            spec = owner.spec
            if tokens != spec.block_size or width != 2 * spec.num_kv_heads * spec.head_size * (
                spec.itemsize
            ):
                raise LMCacheConfigError(
                    f"layer {name!r}: a block holds {tokens} token(s) of {width} B, the KV "
                    f"spec says {spec.block_size} of "
                    f"{2 * spec.num_kv_heads * spec.head_size * spec.itemsize} B"
                )
            self.views[name] = view
            if self.device is None:
                self.device = view.device
        self._torch = torch

    def gather(
        self,
        stream: Stream,
        tables: Sequence[np.ndarray],
        first: Sequence[int],
        start: int,
        end: int,
        out: Any,
    ) -> None:
        """Rows of tokens ``[start, end)`` into ``out`` (uint8 ``[end - start, width]``).

        ``tables[g]`` is group g's block table from position 0; positions below
        ``first[g]`` are not stored (their columns stay zero).
        """
        torch = self._torch
        rows = torch.zeros((end - start, stream.width), dtype=torch.uint8, device=self.device)
        for lo, i0, ids, owners in self._runs(stream, tables, first, start, end):
            bs = self.topology.groups[owners[0].group].spec.block_size
            for owner in owners:
                got = self.views[owner.name].index_select(0, ids)
                got = got.view(len(ids) * bs, -1).view(torch.uint8)
                rows[lo - start :, owner.offset : owner.offset + owner.width] = got[
                    lo - i0 * bs : end - i0 * bs
                ]
        out.copy_(rows)

    def scatter(
        self,
        stream: Stream,
        tables: Sequence[np.ndarray],
        first: Sequence[int],
        start: int,
        end: int,
        rows: Any,
    ) -> None:
        """Write rows of tokens ``[start, end)`` into the blocks, from ``first[g]`` on.

        Blocks only partly covered are read, patched and written back, so bytes of other
        positions (a locally computed prefix, tokens past the prompt) stay as they were.
        """
        torch = self._torch
        rows = rows.to(self.device)
        for lo, i0, ids, owners in self._runs(stream, tables, first, start, end):
            bs = self.topology.groups[owners[0].group].spec.block_size
            partial = lo % bs or end < (i0 + len(ids)) * bs
            for owner in owners:
                view = self.views[owner.name]
                part = rows[lo - start :, owner.offset : owner.offset + owner.width]
                if partial:
                    block = view.index_select(0, ids)
                    flat = block.view(len(ids) * bs, -1).view(torch.uint8)
                    flat[lo - i0 * bs : end - i0 * bs] = part
                else:
                    block = part.contiguous().view(view.dtype).view(len(ids), *view.shape[1:])
                view.index_copy_(0, ids, block)

    def _runs(
        self,
        stream: Stream,
        tables: Sequence[np.ndarray],
        first: Sequence[int],
        start: int,
        end: int,
    ) -> list[tuple[int, int, Any, list[OwnerColumns]]]:
        """Per group of the stream: first position, first block index, block ids (on the
        KV device) and owners, for the part of ``[start, end)`` from ``first[g]`` on."""
        runs = []
        for group in stream.groups:
            lo = max(start, first[group])
            if lo >= end:
                continue
            bs = self.topology.groups[group].spec.block_size
            i0, i1 = lo // bs, -(-end // bs)
            ids = self._ids(tables[group][i0:i1])
            runs.append((lo, i0, ids, [o for o in stream.owners if o.group == group]))
        return runs

    def _ids(self, table: np.ndarray) -> Any:
        return self._torch.from_numpy(np.ascontiguousarray(table, dtype=np.int64)).to(self.device)


def _token_dims(geometry: BlockGeometry) -> int:
    return sum(1 for d in geometry.dims if d.label in (SUB_BLOCK, TOKEN))


def _canonical_view(name: str, tensor: Any, geometry: BlockGeometry, num_blocks: int) -> Any:
    """``as_strided`` view of one owner's blocks in canonical dim order."""
    import torch

    itemsize = geometry.itemsize
    dtypes = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if tensor.element_size() != itemsize or itemsize not in dtypes:
        raise LMCacheConfigError(
            f"layer {name!r}: tensor element size {tensor.element_size()} B, geometry {itemsize} B"
        )
    storage = tensor.untyped_storage()
    offset = geometry.base - storage.data_ptr()
    end = geometry.span(num_blocks)[1] - storage.data_ptr()
    if offset < 0 or end > storage.nbytes():
        raise LMCacheConfigError(
            f"layer {name!r}: its blocks lie outside the storage of the tensor handed over"
        )
    by_label: dict[str, Dim] = {d.label: d for d in geometry.dims}
    unknown = set(by_label) - set(_CANONICAL)
    if unknown:
        raise LMCacheConfigError(f"layer {name!r}: unexpected dims {sorted(unknown)}")
    dims = [by_label[label] for label in _CANONICAL if label in by_label]
    strides = [geometry.block_stride, *(d.stride for d in dims)]
    if offset % itemsize or any(s % itemsize for s in strides):
        raise LMCacheConfigError(f"layer {name!r}: strides not aligned to the element size")
    typed = tensor.view(dtypes[itemsize])  # the same storage, bits as integers
    return torch.as_strided(
        typed,
        (num_blocks, *(d.size for d in dims)),
        tuple(s // itemsize for s in strides),
        offset // itemsize,
    )


# ---- LMCache GPU connector ----------------------------------------------------------------


@dataclass
class _Transfer:
    """One store or retrieve of one stream, handed through LMCache as a kwarg."""

    tables: Sequence[np.ndarray]
    first: Sequence[int]
    chunks: list[tuple[int, int]] = field(default_factory=list)
    nbytes: int = 0


def _gpu_connector_class() -> type:
    """``GPUConnectorInterface`` subclass, defined lazily (LMCache is an optional extra)."""
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    class OwnerRowsConnector(GPUConnectorInterface):
        """Copies one stream's owner rows between vLLM's KV blocks and LMCache objects."""

        def __init__(self, rows: OwnerRows, stream: Stream):
            self.rows = rows
            self.stream = stream

        def get_shape(self, num_tokens: int) -> Any:
            import torch

            return torch.Size([1, 1, num_tokens, self.stream.width])

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            transfer: _Transfer = kwargs["kvshare"]
            out = memory_obj.tensor.view(-1, self.stream.width)[: end - start]
            self.rows.gather(self.stream, transfer.tables, transfer.first, start, end, out)
            transfer.chunks.append((start, end))
            transfer.nbytes += memory_obj.get_size()

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            transfer: _Transfer = kwargs["kvshare"]
            rows = memory_obj.tensor.view(-1, self.stream.width)[: end - start]
            self.rows.scatter(self.stream, transfer.tables, transfer.first, start, end, rows)
            transfer.chunks.append((start, end))
            transfer.nbytes += memory_obj.get_size()

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> None:
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(obj, start, end, **kwargs)

        def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs: Any):
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(obj, start, end, **kwargs)

    return OwnerRowsConnector


# ---- per-request header -------------------------------------------------------------------


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


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(StoredHeader)


def _tokens_digest(token_ids: Sequence[int]) -> int:
    """A request key of our own (independent of LMCache's hashing and PYTHONHASHSEED)."""
    data = np.asarray(token_ids, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.sha256(b"kvshare-hdr-v1" + data).digest()[:8], "big")


# ---- the backend --------------------------------------------------------------------------


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


class LMCacheBackend:
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
        import torch
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.metadata import LMCacheMetadata

        config.validate()
        tag = config.model_tag or model_tag
        if not _MODEL_TAG.match(tag):
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
        self._worker = (worker_id, world_size)
        self._ids: list[str] = []
        self.engines: dict[str, Any] = {}
        connector_cls = _gpu_connector_class()
        total = sum(s.width for s in self.streams)
        saved_none_hash = _vllm_none_hash()
        try:
            for stream in self.streams:
                model_name = f"{tag}.kvs{self.fingerprint}.{stream.name}"
                key_chars = len(f"{model_name}@{world_size}@{worker_id}@{'f' * 16}@uint8")
                if key_chars > _MAX_KEY_CHARS:
                    raise LMCacheConfigError(
                        f"LMCache keys for {model_name!r} would be {key_chars} characters "
                        f"(limit {_MAX_KEY_CHARS}); use a shorter lmcache.model_tag"
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
                engine = LMCacheEngineBuilder.get_or_create(
                    instance,
                    config.engine_config(stream.width / total),
                    metadata,
                    connector_cls(self.rows, stream),
                    lambda tensor, src: tensor,
                    lambda obj, src: obj,
                )
                self._ids.append(instance)
                engine.post_init()
                self.engines[stream.name] = engine
            self._check_remote_reachable()
        except BaseException:
            self.close()
            raise
        finally:
            _restore_vllm_none_hash(saved_none_hash)
        self._first_engine = self.engines[self.streams[0].name]
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
        import torch

        started = time.perf_counter()
        tokens = [int(t) for t in token_ids]
        n = len(tokens)
        if n == 0:
            raise LMCacheStoreError(f"request {request_id}: no tokens to store")
        tables = self._tables(block_ids, n, LMCacheStoreError)
        stored_from = [self._store_from(g, tables[g], n) for g in range(len(tables))]
        keys: list[Any] = []
        nbytes = 0
        for stream in self.streams:
            begin = min(stored_from[g] for g in stream.groups)
            if begin >= n:
                continue
            skip = begin // self.config.chunk_size * self.config.chunk_size
            mask = torch.ones(n, dtype=torch.bool)
            mask[:skip] = False
            transfer = _Transfer(tables, stored_from)
            engine = self.engines[stream.name]
            engine.store(tokens, mask=mask, kvshare=transfer, req_id=request_id)
            covered = _covered(transfer.chunks)
            if covered != (skip, n):
                raise LMCacheStoreError(
                    f"request {request_id}: LMCache stored tokens {covered} of stream "
                    f"{stream.name}, expected [{skip}, {n}) (local CPU memory full?)"
                )
            nbytes += transfer.nbytes
            keys.extend(self._chunk_keys(engine, tokens, mask))
        header = StoredHeader(
            version=HEADER_VERSION,
            model_tag=self.model_tag,
            request_id=request_id,
            num_tokens=n,
            chunk_size=self.config.chunk_size,
            hash_algorithm=self._hash_algorithm,
            probe_hash=self._probe_hash(tokens),
            stored_from=stored_from,
            layout=self._layout,
        )
        keys.extend(self._put_header(tokens, header))
        receipt = StoreReceipt(
            request_id,
            n,
            nbytes,
            tuple(stored_from),
            tuple(keys),
            time.perf_counter() - started,
        )
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
        remotes = self._remote_backends()
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
        if not _poll(lambda: self.is_stored(receipt), limit):
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
        import torch

        started = time.perf_counter()
        tokens = [int(t) for t in token_ids]
        n = len(tokens)
        if not 0 <= num_computed_tokens <= n:
            raise LMCacheLoadError(
                f"request {request_id}: num_computed_tokens {num_computed_tokens} outside [0, {n}]"
            )
        limit = self.config.load_timeout_s if timeout_s is None else timeout_s
        header = self._get_header(request_id, tokens, limit)
        self._check_header(request_id, header, tokens)
        tables = self._tables(block_ids, n, LMCacheLoadError)
        first = [
            self._load_from(request_id, g, tables[g], n, num_computed_tokens, header)
            for g in range(len(tables))
        ]
        plans = []
        for stream in self.streams:
            begin = min(first[g] for g in stream.groups)
            if begin >= n:
                continue
            skip = begin // self.config.chunk_size * self.config.chunk_size
            mask = torch.ones(n, dtype=torch.bool)
            mask[:skip] = False
            engine = self.engines[stream.name]
            keys = self._chunk_keys(engine, tokens, mask)
            plans.append((stream, engine, mask, skip, keys))
        for stream, engine, _, skip, keys in plans:  # prefill's puts may still be landing
            if not _poll(lambda e=engine, k=keys: _count_present(e, k) == len(k), limit):
                found = _count_present(engine, keys)
                raise LMCacheLoadError(
                    f"request {request_id}: LMCache holds {found} of {len(keys)} chunk(s) "
                    f"of stream {stream.name} (tokens [{skip}, {n})) after {limit} s"
                )
        nbytes = 0
        for stream, engine, mask, skip, _ in plans:
            transfer = _Transfer(tables, first)
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
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        for instance in self._ids:
            LMCacheEngineBuilder.destroy(instance)
        self._ids.clear()
        self.engines.clear()

    # -- helpers ---------------------------------------------------------------------------

    @property
    def _hash_algorithm(self) -> str:
        return str(self.config.lmcache.get("pre_caching_hash_algorithm", "builtin"))

    def _tables(
        self, block_ids: Sequence[Sequence[int]], n: int, error: type[Exception]
    ) -> list[np.ndarray]:
        """Each group's block table cut to the blocks of ``n`` tokens, checked."""
        groups = self.topology.groups
        if len(block_ids) != len(groups):
            raise error(
                f"block ids cover {len(block_ids)} KV cache group(s), the layout has {len(groups)}"
            )
        tables = []
        for group, ids in zip(groups, block_ids, strict=True):
            need = -(-n // group.spec.block_size)
            arr = np.asarray(list(ids), dtype=np.int64)
            if arr.size < need:
                raise error(
                    f"group {group.index} has {arr.size} block(s) for {n} tokens "
                    f"(block size {group.spec.block_size}: {need} needed)"
                )
            arr = arr[:need]
            bad = arr[(arr < 0) | (arr >= self.topology.num_blocks)]
            if bad.size:
                raise error(
                    f"group {group.index}: block id {int(bad[0])} out of range "
                    f"[0, {self.topology.num_blocks})"
                )
            tables.append(arr)
        return tables

    def _held_from(self, group: int, table: np.ndarray, error: type[Exception]) -> int:
        """First position whose block is held (null blocks only before it)."""
        held = table != 0
        first = int(np.argmax(held)) if held.any() else table.size
        if not held[first:].all():
            gap = first + int(np.argmin(held[first:]))
            raise error(f"group {group} has the null block at block #{gap}, after held blocks")
        return first * self.topology.groups[group].spec.block_size

    def _store_from(self, group: int, table: np.ndarray, n: int) -> int:
        """First position of a group to store: 0 for full attention; for a sliding window
        the block holding ``n - window``, the first key the last prompt token attends to.
        vLLM frees only blocks wholly before ``computed - window + 1`` (at most ``n - window``
        in the step that computes the prompt's end), so that block is still held."""
        spec = self.topology.groups[group].spec
        held = self._held_from(group, table, LMCacheStoreError)
        if spec.sliding_window is None:
            if held > 0:
                raise LMCacheStoreError(
                    f"store: full-attention group {group} no longer holds positions < {held}"
                )
            return 0
        needed = max(0, n - spec.sliding_window) // spec.block_size * spec.block_size
        return max(held, needed)

    def _load_from(
        self,
        request_id: str,
        group: int,
        table: np.ndarray,
        n: int,
        num_computed: int,
        header: StoredHeader,
    ) -> int:
        """First position of a group to write: where this engine holds blocks and has not
        computed the tokens itself, but never before what prefill stored; a position this
        engine still attends to that prefill did not store is an error."""
        spec = self.topology.groups[group].spec
        start = max(num_computed, self._held_from(group, table, LMCacheLoadError))
        needed = 0 if spec.sliding_window is None else max(0, n - spec.sliding_window)
        stored = header.stored_from[group]
        if stored > max(start, needed):
            raise LMCacheLoadError(
                f"request {request_id}: prefill stored group {group} from position {stored}, "
                f"this engine needs it from {max(start, needed)}"
            )
        return max(start, stored)

    def _chunk_keys(self, engine: Any, tokens: list[int], mask: Any) -> list[Any]:
        return [key for _, _, key in engine.token_database.process_tokens(tokens, mask=mask)]

    def _probe_hash(self, tokens: list[int]) -> int:
        db = self._first_engine.token_database
        for _, _, chunk_hash in db.process_tokens(tokens, make_key=False):
            return int(chunk_hash)
        return 0

    def _header_keys(self, tokens: list[int]) -> tuple[Any, Any]:
        """Where a request's header is: under our layout (what decode reads) and under
        the model tag alone (found by a decode with another layout, to say why)."""
        import torch
        from lmcache.utils import CacheEngineKey

        worker_id, world_size = self._worker
        digest = _tokens_digest(tokens)
        return tuple(
            CacheEngineKey(name, world_size, worker_id, digest, torch.uint8)
            for name in (f"{self.model_tag}.kvs{self.fingerprint}.hdr", f"{self.model_tag}.hdr")
        )

    def _put_header(self, tokens: list[int], header: StoredHeader) -> list[Any]:
        import torch

        blob = _header_encoder.encode(header)
        payload = torch.frombuffer(
            bytearray(len(blob).to_bytes(8, "little") + blob), dtype=torch.uint8
        )
        engine = self._first_engine
        rows = -(-payload.numel() // self.streams[0].width)
        keys = list(self._header_keys(tokens))
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

    def _get_header(self, request_id: str, tokens: list[int], limit: float) -> StoredHeader:
        """Our layout's header, else any layout's (for the mismatch report), after
        waiting up to ``limit`` seconds for prefill's puts."""
        manager = self._first_engine.storage_manager
        keys = self._header_keys(tokens)
        found: list[Any] = []

        def present() -> bool:
            found[:] = [k for k in keys if manager.contains(k) is not None]
            return bool(found)

        if not _poll(present, limit):
            raise LMCacheLoadError(
                f"request {request_id}: LMCache holds no KV for these {len(tokens)} token(s) "
                f"under model tag {self.model_tag!r} (waited {limit} s; "
                f"{self.config.remote_url or 'local CPU only'})"
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
            return _header_decoder.decode(blob)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise LMCacheLoadError(
                f"request {request_id}: unreadable stored header ({exc}); another kvshare "
                "version stored it?"
            ) from exc

    def _check_header(self, request_id: str, header: StoredHeader, tokens: list[int]) -> None:
        if header.version != HEADER_VERSION:
            raise LMCacheLoadError(
                f"request {request_id}: stored header version {header.version}, this engine "
                f"reads {HEADER_VERSION}"
            )
        if header.layout.fingerprint != self.fingerprint:
            remote = protocol.layout_from_msg(header.layout)
            found = differences(_logical(self.topology), _logical(remote)) or [
                f"layout fingerprint: local {self.fingerprint}, remote {header.layout.fingerprint}"
            ]
            raise LayoutMismatch(found, self.topology.layout, remote.layout)
        if header.num_tokens != len(tokens):
            raise LMCacheLoadError(
                f"request {request_id}: prefill stored {header.num_tokens} token(s), "
                f"{len(tokens)} asked for"
            )
        for what, mine, theirs in (
            ("chunk_size", self.config.chunk_size, header.chunk_size),
            ("pre_caching_hash_algorithm", self._hash_algorithm, header.hash_algorithm),
        ):
            if mine != theirs:
                raise LMCacheLoadError(
                    f"request {request_id}: lmcache.{what} differs: local {mine}, prefill "
                    f"{theirs} (both sides must use the same)"
                )
        probe = self._probe_hash(tokens)
        if probe != header.probe_hash:
            raise HashSeedMismatch(
                f"request {request_id}: the same tokens hash to different LMCache keys here "
                f"({probe:x}) and on the prefill side ({header.probe_hash:x}): export the "
                "same PYTHONHASHSEED for both engines (LMCache starts its hash chain from it)"
            )

    def _remote_backends(self) -> list[Any]:
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        return [
            backend
            for engine in self.engines.values()
            for backend in engine.storage_manager.storage_backends.values()
            if isinstance(backend, RemoteBackend)
        ]

    def _check_remote_reachable(self) -> None:
        if self.config.remote_url is None:
            return
        for backend in self._remote_backends():
            if backend.connection is None:
                raise LMCacheConfigError(
                    f"lmcache.remote_url {self.config.remote_url}: cannot connect (is the "
                    "LMCache server running?)"
                )


def _logical(topology: KVTopology) -> KVTopology:
    """The topology with every owner's physical block order made equal: rows are
    canonical per token, so two engines with different memory layouts interoperate."""
    owners = {
        name: replace(owner, geometry=replace(owner.geometry, dims=(), split=0))
        for name, owner in topology.owners.items()
    }
    return replace(topology, owners=owners)


def _covered(chunks: list[tuple[int, int]]) -> tuple[int, int] | None:
    """``(start, end)`` if the chunks tile one range without gaps."""
    if not chunks:
        return None
    chunks = sorted(chunks)
    for (_, end), (start, _) in itertools.pairwise(chunks):
        if start != end:
            return None
    return chunks[0][0], chunks[-1][1]


def _count_present(engine: Any, keys: list[Any]) -> int:
    if not keys:
        return 0
    hits, _ = engine.storage_manager.batched_contains(keys)
    return int(hits)


def _poll(check: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if check():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


def _vllm_none_hash() -> Any:
    try:
        from vllm.v1.core import kv_cache_utils
    except ImportError:
        return None
    return getattr(kv_cache_utils, "NONE_HASH", None)


def _restore_vllm_none_hash(value: Any) -> None:
    """LMCache's token database re-seeds vLLM's global ``NONE_HASH`` with its own hash
    function; vLLM's prefix cache in this process must keep hashing as before."""
    if value is None:
        return
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.NONE_HASH = value
