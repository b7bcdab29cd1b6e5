"""What the scheduler hands the workers each step, and what the workers hand back."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvshare_connector.backends.base import LoadOrder, StoreOrder
from kvshare_connector.layout.topology import BlockIds


@dataclass
class KVShareMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one engine step: the backend's work orders."""

    to_load: list[LoadOrder] = field(default_factory=list)
    to_hold: dict[str, BlockIds] = field(default_factory=dict)  # prefill: id -> held blocks
    to_store: list[StoreOrder] = field(default_factory=list)


@dataclass
class KVShareWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: requests whose KV could not be loaded, with the reason."""

    failed_loads: dict[str, str] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVShareWorkerMeta:
        if isinstance(other, KVShareWorkerMeta):
            self.failed_loads.update(other.failed_loads)
        return self
