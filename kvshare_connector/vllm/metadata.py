"""What the scheduler hands the workers each step, and what the workers hand back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class KVShareMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one engine step: the backend's work orders.

    Each load order has ``request_id`` and ``local_block_ids`` (empty lists: nothing to load,
    only let prefill free its blocks); store orders are the backend's own.
    """

    to_load: list[Any] = field(default_factory=list)
    to_hold: dict[str, tuple[float, Any]] = field(default_factory=dict)  # id -> (lease, ids)
    to_store: list[Any] = field(default_factory=list)


@dataclass
class KVShareWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: requests whose KV could not be loaded, with the reason."""

    failed_loads: dict[str, str] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVShareWorkerMeta:
        if isinstance(other, KVShareWorkerMeta):
            self.failed_loads.update(other.failed_loads)
        return self
