"""Backend ``lmcache``: prefill and decode exchange owner-layer KV through LMCache 0.5.6.

Modules by job: ``config`` (options), ``rows`` (the stored format), ``tables`` (which
positions each group stores and loads), ``gpu_connector`` (LMCache's callbacks into the KV
blocks), ``engines`` (LMCache engine plumbing), ``header`` (per-request checks), ``store``
(``LMCacheStore``: store/load one request) and ``backend`` (the ``Backend`` the connector
drives). Importing the package does not import LMCache; ``store`` and ``gpu_connector`` do.
See docs/lmcache.md.
"""

from kvshare_connector.backends.lmcache.backend import LMCacheBackend
from kvshare_connector.backends.lmcache.config import LMCacheBackendConfig, default_model_tag
from kvshare_connector.backends.lmcache.errors import (
    HashSeedMismatch,
    LMCacheConfigError,
    LMCacheLoadError,
    LMCacheStoreError,
)

__all__ = [
    "HashSeedMismatch",
    "LMCacheBackend",
    "LMCacheBackendConfig",
    "LMCacheConfigError",
    "LMCacheLoadError",
    "LMCacheStoreError",
    "default_model_tag",
]
