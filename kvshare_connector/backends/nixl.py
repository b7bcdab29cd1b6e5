"""Backend ``nixl`` (the default): decode READs the request's blocks straight from prefill.

Prefill holds a finished request's blocks (clipped to each sliding window) under a lease and
serves its layout on the side channel (``transfer.prefill.source.KVSource``); decode handshakes,
measures the lane, claims the request and READs into the blocks vLLM allocated
(``transfer.decode.sink.KVSink``), then notifies prefill, which frees them.
"""

from __future__ import annotations

import secrets
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvshare_connector.backends.base import (
    Backend,
    DecodeRequest,
    LoadOrder,
    PrefillResult,
    SchedulerBackend,
    SchedulerContext,
    WorkerBackend,
    WorkerContext,
    WorkerProgress,
    empty_block_ids,
)
from kvshare_connector.common.log import LogBudget, get_logger
from kvshare_connector.layout.topology import BlockIds, KVTopology
from kvshare_connector.transfer.decode.shards import ShardedSink, rank_shard
from kvshare_connector.transfer.device import lanes
from kvshare_connector.transfer.device.digests import Digester
from kvshare_connector.transfer.device.nixl import NixlTransport
from kvshare_connector.transfer.device.packing import MemoryMap, Packer, StagingArea
from kvshare_connector.transfer.device.probe import ProbeBuffer
from kvshare_connector.transfer.prefill.source import KVSource
from kvshare_connector.transfer.wire.kv_params import RemotePrefillParams

if TYPE_CHECKING:
    from kvshare_connector.backends.base import KVTensors

logger = get_logger(__name__)


@dataclass(frozen=True)
class RecvRequest(LoadOrder):
    """Decode: read ``params.remote_block_ids`` into ``local_block_ids``; with
    ``release_only``, read nothing and only tell prefill to free the request's blocks."""

    params: RemotePrefillParams
    num_tokens: int | None = None  # decode's prompt length: the sink checks block counts
    # cached locally, per KV cache group (each group's blocks before ``local_block_ids``)
    num_local_tokens: tuple[int, ...] = ()
    release_only: bool = False


class NixlScheduler(SchedulerBackend):
    group_hits = True

    def decode_allocated(self, request: DecodeRequest) -> RecvRequest:
        nothing = request.num_external_tokens <= 0  # all cached locally: only free prefill
        return RecvRequest(
            request.request_id,
            empty_block_ids(self.context.num_groups)
            if nothing
            else self.context.clip_to_windows(request.new_block_ids),
            request.params,
            len(request.prompt_token_ids),
            self._local_tokens(request),
            release_only=nothing,
        )

    def _local_tokens(self, request: DecodeRequest) -> tuple[int, ...]:
        """Each group's own hit, in tokens: where its blocks allocated for the load start
        (the hit's blocks and a window's null ones come first). The request's hit for every
        group where the new blocks are not the table's tail (the sink then refuses)."""
        out = []
        sizes = self.context.block_sizes
        for ids, new, size in zip(request.block_ids, request.new_block_ids, sizes, strict=True):
            first = len(ids) - len(new)
            if list(ids[first:]) != list(new):
                return (request.num_local_tokens,) * len(sizes)
            out.append(first * size)
        return tuple(out)

    def decode_aborted(self, request_id: str, params: RemotePrefillParams) -> RecvRequest:
        # Aborted before blocks were allocated: prefill still holds blocks for it.
        empty = empty_block_ids(self.context.num_groups)
        return RecvRequest(request_id, empty, params, release_only=True)

    def prefill_finished(self, request_id: str, block_ids: BlockIds) -> PrefillResult:
        clipped = self.context.clip_to_windows(block_ids)
        return PrefillResult(clipped, hold=any(clipped))


class NixlWorker(WorkerBackend):
    def __init__(self, context: WorkerContext):
        super().__init__(context)
        self.source: KVSource | None = None
        self.sink: ShardedSink | None = None
        self._releasing: set[str] = set()  # release-only orders still under way
        self._nudged = 0.0
        self._nudge_log = LogBudget(5, 60.0, subject="layer nudge", logger=logger)

    def start(self, topology: KVTopology, tensors: KVTensors) -> str:
        c, o = self.context, self.context.options
        # UCX reads its settings when the agent starts: the lane is chosen before that.
        kinds = {r.mem_kind for r in topology.regions}
        ipc = [lanes.legacy_ipc_capable(r.addr) for r in topology.regions if r.mem_kind == "VRAM"]
        kv_ipc_capable = None if not ipc or None in ipc else all(ipc)
        # UCX listens no further than the side channels reach (loopback: loopback only).
        reach = lanes.side_channel_reach(
            c.host if c.produces else None, c.settings().allowed_hosts() if c.consumes else ()
        )
        plan = lanes.plan_lane(kinds, vmm=False in ipc, mode=o.ucx_lane, reach=reach)
        lanes.apply(plan)
        transport = NixlTransport(
            f"{c.engine_id}-{c.role}-{uuid.uuid4().hex[:6]}",
            **o.nixl_progress,
        )
        settings = c.settings()
        values = list(tensors.values()) if isinstance(tensors, Mapping) else [tensors]
        memory = MemoryMap(values)  # torch views of the KV storages: packing and digests
        device = values[0].device
        digester = Digester(memory, device) if o.verifies else None
        shard = rank_shard(topology, c.tp_size, c.tp_rank, c.model_kv_heads)  # TP: our heads
        packers = []
        if c.produces:
            packers.append(self._packer(memory, device))
            self.source = KVSource(
                topology,
                transport,
                settings,
                packer=packers[-1],
                digester=digester,
                shard=shard,
                probe=self._probe(device, seed=secrets.randbits(62)),
                lane=lanes.LaneInfo(lanes.effective(), kv_ipc_capable),
            )
        if c.consumes:
            packers.append(self._packer(memory, device))
            self.sink = ShardedSink(
                shard,
                topology,
                transport,
                settings,
                packer=packers[-1],
                digester=digester,
                probe=self._probe(device),
            )
        if self.source is not None:
            _shorten_switch_interval(o.switch_interval_ms)
        registered = sum(r.nbytes for r in topology.regions)
        line = f"TP rank {c.tp_rank}/{c.tp_size}: " if c.tp_size > 1 else ""
        line += f"registered {len(topology.owners)} owner layer(s) in {len(topology.regions)} "
        line += f"region(s) ({registered / 2**20:.1f} MiB)"
        if self.source is not None:
            line += f"; side channel {c.host}:{self.source.port}"
        staging = sum(p.staging.nbytes for p in packers if p is not None)
        packing = f"on ({staging / 2**20:.0f} MiB staging)" if staging else "off"
        line += f"; packed transfer {packing}"
        line += f"; verify_kv {'on' if digester else 'off'}"
        line += f"; thread switch interval {sys.getswitchinterval() * 1e3:g} ms"
        line += f"; NIXL progress thread {transport.progress_mode}"
        return line + f"; UCX lane: {plan.describe()}"

    def _packer(self, memory: MemoryMap, device: Any) -> Packer | None:
        """A staging area on the KV's device (None: packing off, or no room for it:
        transfers go block by block)."""
        if self.context.options.staging_bytes <= 0:
            return None
        try:
            return Packer(memory, StagingArea(self.context.options.staging_bytes, device))
        except Exception as exc:  # e.g. no room on the device: slower, still correct
            logger.warning("packed transfer off: %s: %s", type(exc).__name__, exc)
            return None

    def _probe(self, device: Any, seed: int | None = None) -> ProbeBuffer | None:
        """The lane probe buffer (prefill: holding the pattern of ``seed``), or None."""
        nbytes = self.context.options.lane_probe_bytes
        if nbytes <= 0:
            return None
        try:
            return ProbeBuffer(nbytes, device, seed)
        except Exception as exc:  # e.g. no room on the device: the lane goes unmeasured
            logger.warning("lane probe off: %s: %s", type(exc).__name__, exc)
            return None

    def start_loads(self, orders: Sequence[LoadOrder]) -> dict[str, str]:
        failed: dict[str, str] = {}
        for order in orders:
            assert isinstance(order, RecvRequest)
            if self.sink is None:
                if not order.release_only:
                    failed[order.request_id] = f"engine role {self.context.role} cannot load KV"
                continue
            try:
                self.sink.request(
                    order.request_id,
                    order.params,
                    order.local_block_ids,
                    order.num_tokens,
                    order.num_local_tokens or 0,
                )
            except Exception as exc:  # one request fails, never the engine
                if not order.release_only:
                    failed[order.request_id] = f"{type(exc).__name__}: {exc}"
                continue
            if order.release_only:
                self._releasing.add(order.request_id)
        if self.sink is not None and (orders or self.sink.in_flight):
            # Claims asked, and READs whose claim came back during the last step posted,
            # now (before this step's forward), not when the step ends.
            self.sink.advance()
        return failed

    def hold(self, holds: Mapping[str, BlockIds]) -> None:
        """Claims that name other blocks than the held ones are refused."""
        for request_id, block_ids in holds.items():
            if self.source is None:
                logger.error(
                    "request %s: engine role %s cannot serve KV", request_id, self.context.role
                )
                continue
            self.source.hold(request_id, block_ids=block_ids)

    def poll(self) -> WorkerProgress:
        progress = WorkerProgress()
        if self.source is not None:
            progress.sent, progress.expired = self.source.poll()
            progress.counters = self.source.take_refused()
        if self.sink is not None:
            taken = self.sink.take_progress()
            ended = taken.done | set(taken.failed)
            releases, self._releasing = self._releasing & ended, self._releasing - ended
            progress.loaded = taken.done - releases  # a release-only order loads nothing
            progress.failed = {r: why for r, why in taken.failed.items() if r not in releases}
            progress.records, progress.lanes = taken.records, taken.lanes
            for counter, n in taken.counters.items():
                progress.counters[counter] = progress.counters.get(counter, 0) + n
        return progress

    def in_flight(self) -> set[str]:
        return self.sink.in_flight - self._releasing if self.sink is not None else set()

    def nudge(self) -> None:
        """Advance the reads in flight from inside the forward, at most every
        ``layer_nudge_ms``: a claim answered or a READ done mid-step is taken further
        now, so its request can be reported at this step's end instead of steps later."""
        sink, every = self.sink, self.context.options.layer_nudge_ms / 1e3
        if sink is None or not every or not sink.reading:
            return
        now = time.monotonic()
        if now - self._nudged < every or _capturing():
            return
        self._nudged = now
        try:
            sink.advance()
        except Exception as exc:  # never fail the forward: the step's end tries again
            self._nudge_log.log(f"advancing reads inside the forward: {exc!r}")

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
        if self.sink is not None:
            self.sink.close()


def _capturing() -> bool:
    """A CUDA graph is being captured on this thread's stream: nothing may be launched."""
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _shorten_switch_interval(ms: float) -> None:
    """Prefill's side channel answers claims on its own thread, which waits behind the
    engine thread for the GIL up to Python's switch interval at each of its hops (wake up,
    read, reply): 5 ms each by default. A shorter interval costs only while some thread
    waits (``lab/benchmarks/bench_claim_latency.py``). Never lengthened; 0: left as it is."""
    if 0 < ms / 1e3 < sys.getswitchinterval():
        sys.setswitchinterval(ms / 1e3)


class NixlBackend(Backend):
    name = "nixl"

    def scheduler_side(self, context: SchedulerContext) -> NixlScheduler:
        return NixlScheduler(context)

    def worker_side(self, context: WorkerContext) -> NixlWorker:
        return NixlWorker(context)
