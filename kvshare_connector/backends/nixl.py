"""Backend ``nixl`` (the default): decode READs the request's blocks straight from prefill.

Prefill holds a finished request's blocks (clipped to each sliding window) under a lease and
serves its layout on the side channel (``transfer.source.KVSource``); decode handshakes,
claims the request and READs into the blocks vLLM allocated (``transfer.sink.KVSink``), then
notifies prefill, which frees them.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvshare_connector.backends.base import (
    Backend,
    BlockIds,
    DecodeRequest,
    Hold,
    PrefillResult,
    SchedulerBackend,
    SchedulerContext,
    WorkerBackend,
    WorkerContext,
    WorkerProgress,
    empty_block_ids,
)
from kvshare_connector.common.log import get_logger
from kvshare_connector.layout.topology import KVTopology
from kvshare_connector.transfer.digests import Digester
from kvshare_connector.transfer.nixl import NixlTransport
from kvshare_connector.transfer.packing import MemoryMap, Packer, StagingArea
from kvshare_connector.transfer.protocol import RemotePrefillParams
from kvshare_connector.transfer.shards import ShardedSink, rank_shard
from kvshare_connector.transfer.source import KVSource

logger = get_logger(__name__)

_RELEASE_SUFFIX = "#release"  # internal ids of notify-only reads (nothing to load)


@dataclass
class RecvRequest:
    """Decode: read ``params.remote_block_ids`` into ``local_block_ids`` (empty: only tell
    prefill to free the request's blocks)."""

    request_id: str
    params: RemotePrefillParams
    local_block_ids: BlockIds
    num_tokens: int | None = None  # decode's prompt length: the sink checks block counts
    num_local_tokens: int = 0  # of which cached locally


class NixlScheduler(SchedulerBackend):
    def decode_allocated(self, request: DecodeRequest) -> RecvRequest:
        if request.num_external_tokens > 0:
            local = self.context.clip_to_windows(request.new_block_ids)
        else:  # everything is cached locally: only let prefill free its blocks
            local = empty_block_ids(self.context.num_groups)
        return RecvRequest(
            request.request_id,
            request.params,
            local,
            len(request.prompt_token_ids),
            request.num_local_tokens,
        )

    def decode_aborted(self, request_id: str, params: RemotePrefillParams) -> RecvRequest:
        # Aborted before blocks were allocated: prefill still holds blocks for it.
        return RecvRequest(request_id, params, empty_block_ids(self.context.num_groups))

    def prefill_finished(self, request_id: str, block_ids: BlockIds) -> PrefillResult:
        clipped = self.context.clip_to_windows(block_ids)
        return PrefillResult(clipped, hold=any(clipped))


class NixlWorker(WorkerBackend):
    def __init__(self, context: WorkerContext):
        super().__init__(context)
        self.source: KVSource | None = None
        self.sink: ShardedSink | None = None

    def start(self, topology: KVTopology, tensors: Any) -> str:
        c = self.context
        transport = NixlTransport(
            f"{c.engine_id}-{c.role}-{uuid.uuid4().hex[:6]}",
            progress_thread=c.nixl_progress_thread,
        )
        secret, identity = c.side_channel_secret, c.engine_identity
        values = list(tensors.values()) if isinstance(tensors, Mapping) else [tensors]
        memory = MemoryMap(values)  # torch views of the KV storages: packing and digests
        digester = Digester(memory, values[0].device) if c.verify_kv else None
        shard = rank_shard(topology, c.tp_size, c.tp_rank, c.model_kv_heads)  # TP: our heads
        if c.produces:
            self.source = KVSource(
                c.engine_id,
                topology,
                transport,
                c.host,
                c.port,
                c.lease_s,
                identity,
                secret,
                packer=self._packer(memory, values[0].device),
                digester=digester,
                shard=shard,
            )
        if c.consumes:
            self.sink = ShardedSink(
                shard,
                topology,
                engine_id=c.engine_id,
                transport=transport,
                handshake_timeout_s=c.handshake_timeout_s,
                transfer_timeout_s=c.transfer_timeout_s,
                identity=identity,
                secret=secret,
                packer=self._packer(memory, values[0].device),
                digester=digester,
            )
        registered = sum(r.nbytes for r in topology.regions)
        line = f"TP rank {c.tp_rank}/{c.tp_size}: " if c.tp_size > 1 else ""
        line += f"registered {len(topology.owners)} owner layer(s) in {len(topology.regions)} "
        line += f"region(s) ({registered / 2**20:.1f} MiB)"
        if self.source is not None:
            line += f"; side channel {c.host}:{self.source.port}"
        packers = [s.packer for s in (self.source, self.sink) if s is not None and s.packer]
        line += f"; packed transfer {'on' if packers else 'off'}"
        if packers:
            line += f" ({sum(p.staging.nbytes for p in packers) / 2**20:.0f} MiB staging)"
        return line + f"; verify_kv {'on' if digester else 'off'}"

    def _packer(self, memory: MemoryMap, device: Any) -> Packer | None:
        """A staging area on the KV's device (None: packing off, or no room for it:
        transfers go block by block)."""
        if self.context.staging_bytes <= 0:
            return None
        try:
            return Packer(memory, StagingArea(self.context.staging_bytes, device))
        except Exception as exc:  # e.g. no room on the device: slower, still correct
            logger.warning("packed transfer off: %s: %s", type(exc).__name__, exc)
            return None

    def start_loads(self, orders: Sequence[RecvRequest]) -> dict[str, str]:
        failed: dict[str, str] = {}
        for order in orders:
            nothing_to_load = not any(order.local_block_ids)
            if self.sink is None:
                if not nothing_to_load:
                    failed[order.request_id] = f"engine role {self.context.role} cannot load KV"
                continue
            read_id = order.request_id + (_RELEASE_SUFFIX if nothing_to_load else "")
            try:
                self.sink.request(
                    read_id,
                    order.params,
                    order.local_block_ids,
                    order.num_tokens,
                    order.num_local_tokens,
                )
            except Exception as exc:  # one request fails, never the engine
                if not nothing_to_load:
                    failed[order.request_id] = f"{type(exc).__name__}: {exc}"
        if orders and self.sink is not None:
            self.sink.advance()  # claims under way now, not when the step ends
        return failed

    def hold(self, holds: Mapping[str, Hold]) -> None:
        """Claims that name blocks other than the held ones are refused."""
        for request_id, value in holds.items():
            if self.source is None:
                logger.error(
                    "request %s: engine role %s cannot serve KV", request_id, self.context.role
                )
                continue
            lease_s, block_ids = value
            self.source.hold(request_id, lease_s, block_ids)

    def poll(self) -> WorkerProgress:
        progress = WorkerProgress()
        if self.source is not None:
            progress.sent, progress.expired = self.source.poll()
            progress.counters = self.source.take_refused()
        if self.sink is not None:
            done, failed = self.sink.poll()
            progress.failed = {
                r: reason for r, reason in failed.items() if not r.endswith(_RELEASE_SUFFIX)
            }
            progress.loaded = {r for r in done if not r.endswith(_RELEASE_SUFFIX)}
            progress.records, self.sink.records = self.sink.records, []
            for counter, n in self.sink.counters.items():
                progress.counters[counter] = progress.counters.get(counter, 0) + n
            self.sink.counters.clear()
        return progress

    def in_flight(self) -> set[str]:
        return self.sink.in_flight if self.sink is not None else set()

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
        if self.sink is not None:
            self.sink.close()


class NixlBackend(Backend):
    name = "nixl"

    def scheduler_side(self, context: SchedulerContext) -> NixlScheduler:
        return NixlScheduler(context)

    def worker_side(self, context: WorkerContext) -> NixlWorker:
        return NixlWorker(context)
