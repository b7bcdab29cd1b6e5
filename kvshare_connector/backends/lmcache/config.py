"""The LMCache backend's options: ``kv_connector_extra_config["lmcache"]``, validated.

Parsed when the connector starts, in the scheduler's and the workers' processes alike, so a
typo or an option this backend cannot honour fails at start-up with the key's name rather
than on the first request. Other LMCache options pass through, their names checked against
LMCache's own definitions (which is why parsing needs LMCache installed).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvshare_connector.backends.lmcache.errors import LMCacheConfigError

BACKEND_NAME = "lmcache"  # the ``backend`` option's value, and the options' section name
MODEL_TAG = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MAX_KEY_CHARS = 150  # lmcache.v1.protocol.MAX_KEY_LENGTH (lm:// wire format)

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
        if extra.get("backend") != BACKEND_NAME:
            raise LMCacheConfigError(
                f'kv_connector_extra_config["backend"] is {extra.get("backend")!r}, '
                f'expected "{BACKEND_NAME}" for the LMCache backend'
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
        if self.model_tag is not None and not MODEL_TAG.match(self.model_tag):
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
