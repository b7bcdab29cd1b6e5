"""Layer 3, backends behind one interface (``base.Backend``); ``create_backend`` picks one.

The registry maps the ``backend`` option of ``kv_connector_extra_config`` to a class, imported
only when chosen, so a backend's heavy dependencies (LMCache) load only where it is used.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from kvshare_connector.backends.base import Backend

DEFAULT_BACKEND = "nixl"
_REGISTRY: dict[str, tuple[str, str]] = {
    "nixl": ("kvshare_connector.backends.nixl", "NixlBackend"),
    "lmcache": ("kvshare_connector.backends.lmcache", "LMCacheBackend"),
}


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def create_backend(extra_config: Mapping[str, Any] | None) -> Backend:
    """The backend named by ``extra_config["backend"]`` (default NIXL), its options parsed."""
    extra = dict(extra_config or {})
    name = extra.get("backend", DEFAULT_BACKEND)
    if name not in _REGISTRY:
        raise ValueError(f"KVShareConnector: backend {name!r} not in {backend_names()}")
    module, cls = _REGISTRY[name]
    backend_cls: type[Backend] = getattr(importlib.import_module(module), cls)
    return backend_cls(extra)
