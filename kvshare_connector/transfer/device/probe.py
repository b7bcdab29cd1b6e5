"""The lane probe: after a handshake, decode READs a known pattern from prefill, checks every
byte and measures the lane before any request's KV moves.

Prefill registers a small buffer on the KV's device filled with a pattern from a seed
(``ProbeBuffer``) and names it in its handshake reply; decode reads it into its own buffer
once to wire the connection up, then ``TIMED_READS`` times, compares the bytes with the
pattern and reports the fastest READ's GB/s (``LaneProbe``). One READ of one large
descriptor: what a packed request is (the staging area is plain device memory, as this
buffer is). A lane that reads slow is READ again, spaced out, for ``PATIENCE_S`` before it
is called slow: on one GPU shared by several engines a probe that runs while the others
start (8 at once in the fault matrix of 2026-12-03d) moved 8 MiB over cuda_ipc zero-copy
at 2.4 GB/s, which read as the slow lane. The lane is named by what carried the timed
READs' bytes (``transfer.device.lane_watch``: this process's TCP sockets, the host's RDMA ports,
else neither), with both sides' UCX settings (prefill's come in its ``ProbeRef``).
torch is imported lazily: the transfer layer stays importable without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from kvshare_connector.common.log import get_logger
from kvshare_connector.layout.topology import Region
from kvshare_connector.transfer.device import lanes
from kvshare_connector.transfer.device.lane_watch import LaneWatch
from kvshare_connector.transfer.device.lanes import Verdict, is_local_host, verdict
from kvshare_connector.transfer.device.nixl import NixlTransport, TransportError
from kvshare_connector.transfer.device.records import LaneReport
from kvshare_connector.transfer.wire import protocol

if TYPE_CHECKING:
    from kvshare_connector.transfer.decode.peers import Peer

logger = get_logger(__name__)
T = TypeVar("T")

DEFAULT_PROBE_MIB = 8
TIMED_READS = 3
PATIENCE_S = 2.0  # a slow lane is READ again for this long before it is called slow
RETRY_GAP_S = 0.2  # between those READs: a busy spell of the GPU may pass
SPIN_S = 0.25  # a timed READ is watched this long on the engine thread (once per peer)
# after this long a watched READ is looked at every YIELD_S, not in a spin: each look
# takes UCX's worker lock, which NIXL's progress thread needs to receive a tcp READ's bytes
SPIN_ONLY_S = 0.001
YIELD_S = 0.0001
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # as int64


class ProbeError(TransportError):
    """The probe READ failed or brought other bytes than prefill's pattern."""


class ProbeBuffer:
    """A registered buffer on ``device``: prefill's holds the pattern, decode's receives it.

    Its writes and its check run on a stream of its own, each waited for before it returns.
    The transport's copies do not order with the engine's streams: a clear queued behind a
    forward on the engine's stream ran after the READ had landed and wiped it (seen on one
    busy H200 as "other bytes than prefill's pattern"), and a pattern queued there could
    still be unwritten when a peer reads it."""

    def __init__(self, nbytes: int, device: Any, seed: int | None = None):
        import torch

        self.nbytes = (nbytes // 8) * 8
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self.tensor = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self.seed = seed
        if seed is not None:
            self._run(lambda: self.tensor.view(torch.int64).copy_(self._pattern(seed)))
        else:
            self.clear()

    def _run(self, work: Callable[[], T]) -> T:
        """``work()`` on the buffer's own stream, finished before this returns."""
        if self._stream is None:
            return work()
        import torch

        with torch.cuda.stream(self._stream):
            out = work()
        self._stream.synchronize()
        return out

    def _pattern(self, seed: int) -> Any:
        import torch

        words = torch.arange(self.nbytes // 8, dtype=torch.int64, device=self.device)
        return words * _GOLDEN + seed  # wraps modulo 2**64: every word differs

    @property
    def region(self) -> Region:
        device_id = -1 if self.device.type == "cpu" else self.device.index or 0
        return Region(int(self.tensor.data_ptr()), self.nbytes, device_id)

    def holds(self, seed: int, nbytes: int) -> bool:
        """The first ``nbytes`` are the pattern of ``seed`` (what prefill filled)."""
        import torch

        words = nbytes // 8
        return bool(
            self._run(
                lambda: torch.equal(
                    self.tensor.view(torch.int64)[:words], self._pattern(seed)[:words]
                )
            )
        )

    def clear(self) -> None:
        self._run(self.tensor.zero_)


class LaneProbe:
    """Drives one peer's probe on the engine thread: ``advance()`` until it returns a report.

    The first READ wires UCX up (it may take several engine steps: it is polled, not
    waited for); each timed READ is watched for up to ``SPIN_S`` so its time is the
    wire's, not an engine step's. The lane's speed is the fastest READ's: other work on
    the device only adds time. While that is slow, one more READ every ``RETRY_GAP_S``
    until ``PATIENCE_S`` has passed since the first timed one.
    """

    def __init__(
        self,
        transport: NixlTransport,
        local: ProbeBuffer,
        agent: str,
        remote: Region,
        seed: int,
        peer: str,
        address: str,
        same_host: bool,
        remote_kind: str,
        peer_ucx: dict[str, str] | None = None,
    ):
        self.transport = transport
        self.local = local
        self.agent = agent
        self.nbytes = min(local.nbytes, remote.nbytes)
        self.remote = remote
        self.seed = seed
        self.peer, self.address, self.same_host = peer, address, same_host
        self.remote_kind = remote_kind
        self.peer_ucx = dict(peer_ucx or {})  # prefill's UCX settings (its ProbeRef's)
        self._watch = LaneWatch(address.rpartition(":")[0].strip("[]"))
        self._handle: Any = None
        self._posted = 0.0
        self._times: list[float] = []
        self._warm = False
        self._first_timed = 0.0  # when the first timed READ was posted
        self._not_before = 0.0  # a READ again after a slow reading: not before this

    def _post(self) -> None:
        local = self.local.region
        rows_local = np.asarray([[local.addr, self.nbytes, max(local.device_id, 0)]], np.int64)
        rows_remote = np.asarray(
            [[self.remote.addr, self.nbytes, max(self.remote.device_id, 0)]], np.int64
        )
        self._posted = time.perf_counter()
        self._handle = self.transport.read(
            self.agent, rows_local, local.mem_kind, rows_remote, self.remote_kind, b""
        )

    def advance(self) -> LaneReport | None:
        """Move the probe on; the report once the timed READs are done and checked."""
        if self._handle is None:
            if time.perf_counter() < self._not_before:
                return None
            self.local.clear()
            if self._warm and not self._times:
                self._watch.start()
            self._post()
            if self._warm and not self._times:
                self._first_timed = self._posted
        state = self._watch_read(SPIN_S if self._warm else 0.0)
        if state == "PROC":
            return None
        elapsed = time.perf_counter() - self._posted
        self.transport.release(self._handle)
        self._handle = None
        if state != "DONE":
            raise ProbeError(f"the lane probe READ from {self.peer} at {self.address} failed")
        if not self._warm:
            self._warm = True
            return None
        self._times.append(elapsed)
        if len(self._times) < TIMED_READS:
            return None
        if not self.local.holds(self.seed, self.nbytes):
            raise ProbeError(
                f"the lane probe READ from {self.peer} at {self.address} brought other bytes "
                "than prefill's pattern: the transport is not moving KV correctly"
            )
        seconds = min(self._times)
        gbps = self.nbytes / seconds / 1e9
        mine = lanes.effective()
        seen = self._watch.seen(self.nbytes * len(self._times))
        found: Verdict = verdict(
            self.local.region.mem_kind, self.remote_kind, gbps, seen, self.same_host,
            mine, self.peer_ucx,
        )  # fmt: skip
        now = time.perf_counter()
        if found.slow and now - self._first_timed < PATIENCE_S:
            self._not_before = now + RETRY_GAP_S
            return None
        return LaneReport(
            self.peer, self.address, self.nbytes, seconds, gbps, found.lane, found.slow,
            found.fix, reads=len(self._times), spread_s=now - self._first_timed,
            where=found.where, ucx=mine, peer_ucx=self.peer_ucx,
        )  # fmt: skip

    def _watch_read(self, spin_s: float) -> str:
        """The READ's state, watched for up to ``spin_s``: in a spin for ``SPIN_ONLY_S``,
        then every ``YIELD_S``."""
        now = time.perf_counter()
        deadline, spin_until = now + spin_s, now + min(spin_s, SPIN_ONLY_S)
        state = self.transport.state(self._handle)
        while state == "PROC" and (now := time.perf_counter()) < deadline:
            if now > spin_until:
                time.sleep(YIELD_S)
            state = self.transport.state(self._handle)
        return state

    def cancel(self) -> None:
        if self._handle is not None:
            self.transport.release(self._handle)
            self._handle = None


class Lanes:
    """Decode's lane probes, one per prefill agent: ``ready(peer)`` is True once that
    prefill's lane is measured (or cannot be: no probe buffer on either side).

    A probe moves once per round (``next_round``: one per ``KVSink.advance``), however many
    reads ask: otherwise it could finish halfway through a round, and the reads asked
    before that would claim a round later than the rest, in a message of their own."""

    def __init__(self, transport: NixlTransport, buffer: ProbeBuffer | None):
        self.transport = transport
        self.buffer = buffer
        self._probes: dict[str, LaneProbe] = {}  # prefill agent -> its probe in flight
        self._measured: dict[str, LaneReport | None] = {}  # prefill agent -> its lane
        self._new: list[LaneReport] = []  # measured since the last ``take``
        self._moved: set[str] = set()  # agents whose probe moved this round

    def next_round(self) -> None:
        self._moved.clear()

    def ready(self, peer: Peer, host: str, port: int) -> bool:
        """``peer`` has its lane measured; ``ProbeError`` if its probe READ failed or
        brought wrong bytes."""
        if peer.agent in self._measured:
            return True
        ref: protocol.ProbeRef | None = peer.probe
        if self.buffer is None or ref is None or ref.nbytes == 0:
            self._measured[peer.agent] = None
            return True
        probe = self._probes.get(peer.agent)
        if probe is None:
            remote = Region(ref.addr, ref.nbytes, ref.device_id)
            probe = LaneProbe(
                self.transport, self.buffer, peer.agent, remote, ref.seed, peer.engine_id,
                f"{host}:{port}", is_local_host(host), remote.mem_kind, ref.ucx,
            )  # fmt: skip
            self._probes[peer.agent] = probe
        if peer.agent in self._moved:
            return False
        self._moved.add(peer.agent)
        try:
            report = probe.advance()
        except Exception:
            probe.cancel()
            del self._probes[peer.agent]
            raise
        if report is None:
            return False
        del self._probes[peer.agent]
        self._measured[peer.agent] = report
        self._new.append(report)
        log_lane(report, ref)
        return True

    def take(self) -> list[LaneReport]:
        new, self._new = self._new, []
        return new


def log_lane(report: LaneReport, ref: protocol.ProbeRef) -> None:
    """One line per measured lane; a warning with the fix when it is the slow one."""
    line = (
        f"KV lane from prefill {report.peer} at {report.address}: {report.lane} "
        f"({report.where}), {report.gbps:.1f} GB/s (probe READ of "
        f"{report.nbytes / 2**20:.0f} MiB, {report.seconds * 1e6:.0f} us, the fastest of "
        f"{report.reads} over {report.spread_s:.1f} s, bytes verified); UCX, prefill: "
        f"{lanes.describe_settings(report.peer_ucx)}; decode: "
        f"{lanes.describe_settings(report.ucx)}"
    )
    if ref.kv_ipc_capable is False:
        line += "; prefill's KV is VMM memory: its block-by-block reads need UCX_RMA_PPLN_ENABLE=y"
    if report.slow:
        logger.warning("%s: SLOW lane, every READ will crawl: %s", line, report.fix)
    else:
        logger.info("%s", line)
