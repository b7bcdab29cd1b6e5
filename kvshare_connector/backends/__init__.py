"""Layer 3, backends behind one interface (``base.Backend``); ``create_backend`` picks one.

The registry maps the ``backend`` option of ``kv_connector_extra_config`` to a class, imported
only when chosen, so a backend's heavy dependencies (LMCache) load only where it is used.
"""

from __future__ import annotations

import importlib

from kvshare_connector.backends.base import Backend
from kvshare_connector.backends.options import ConnectorOptions

_REGISTRY: dict[str, tuple[str, str]] = {
    "nixl": ("kvshare_connector.backends.nixl", "NixlBackend"),
    "lmcache": ("kvshare_connector.backends.lmcache", "LMCacheBackend"),
}


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def create_backend(options: ConnectorOptions) -> Backend:
    """The backend the ``backend`` option names (default NIXL), its options checked."""
    if options.backend not in _REGISTRY:
        raise ValueError(f"KVShareConnector: backend {options.backend!r} not in {backend_names()}")
    module, cls = _REGISTRY[options.backend]
    backend_cls: type[Backend] = getattr(importlib.import_module(module), cls)
    return backend_cls(options)
