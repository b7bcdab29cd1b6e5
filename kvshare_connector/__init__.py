"""kvshare-connector: a sharing-aware vLLM KV connector for prefill/decode disaggregation.

The package root stays import-light: the pure core (``topology``, ``descriptors``,
``protocol``) must import without vLLM or NIXL, so ``KVShareConnector`` is resolved lazily.
That lazy attribute is also what vLLM's ``kv_connector_module_path="kvshare_connector"``
form looks up.
"""

from typing import Any

__version__ = "0.1.0"
CONNECTOR_NAME = "KVShareConnector"

__all__ = ["CONNECTOR_NAME", "KVShareConnector", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "KVShareConnector":
        from kvshare_connector.connector import KVShareConnector

        return KVShareConnector
    raise AttributeError(f"module 'kvshare_connector' has no attribute {name!r}")
