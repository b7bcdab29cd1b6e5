"""Decode's landing of a READ: the device work between the wire and vLLM.

Once NIXL says a READ is done, a packed request is scattered from its staging slot into
its blocks and, with ``verify_kv``, decode digests those blocks and compares them with
prefill's. ``KVSink`` moves reads through their phases; ``Lander`` does this part of it.
What can be known before the bytes arrive is planned and uploaded while the claim is out
(``plan_ahead``): the digests' index plan, the packed READ and its scatter's index plan (in
offsets relative to the staging slot, allocated only at the post), so that between the
READ and the blocks in place the host only launches: on a GPU a READ can take less than
the plans, which then decide when the bytes are in place (docs/performance.md).
"""

from __future__ import annotations

import time

import numpy as np

from kvshare_connector.common.failpoints import failpoint
from kvshare_connector.layout.staging import PackedRead, packed_layout_of, packed_read
from kvshare_connector.layout.topology import KVTopology
from kvshare_connector.layout.verification import VerificationError, compare
from kvshare_connector.transfer.decode.reads import Landing, PackedAhead, Phase, Read, Transfer
from kvshare_connector.transfer.device.digests import Digester
from kvshare_connector.transfer.device.nixl import NixlTransport
from kvshare_connector.transfer.device.packing import Copy, CopyPlan, Packer


class Lander:
    """Scatters, digests and checks the reads whose READ is done."""

    def __init__(
        self,
        topology: KVTopology,
        transport: NixlTransport,
        packer: Packer | None,
        digester: Digester | None,
    ):
        self.topology = topology
        self.transport = transport
        self.packer = packer
        self.digester = digester

    def plan_ahead(self, read: Read, prefill: KVTopology | None) -> None:
        """While ``read``'s claim is out, plan (and upload) its landing: verify_kv's digests
        of its blocks (their bytes are read only at ``land``) and, where prefill (its
        topology; None: it cannot pack for this reader) may pack the request, the packed
        READ and its scatter. Host seconds go in the read log as ``digest_plan`` and
        ``scatter_plan``, apart from the landing's own parts; their index uploads, parts of
        them, as ``digest_upload`` and ``scatter_upload``."""
        plan = read.plan
        if plan is None:
            return
        if self.digester is not None and plan.verify and read.digest_plan is None:
            clock = time.perf_counter()
            read.digest_plan = self.digester.plan(self.topology, plan.local_ids)
            read.lap("digest_plan", clock)
            read.note("digest_upload", read.digest_plan.upload_s)
        if self.packer is not None and prefill is not None and read.packed_ahead is None:
            clock = time.perf_counter()
            layout = packed_layout_of(prefill, read.order.params.remote_block_ids)
            packed = packed_read(layout, *plan.rows)
            read.packed_ahead = PackedAhead(layout.nbytes, packed)
            read.scatter_plan = self._plan_scatter(packed)
            read.lap("scatter_plan", clock)
            read.note("scatter_upload", read.scatter_plan.upload_s)

    def plan_scatter(self, read: Read) -> None:
        """A packed READ was just posted that was not planned ahead (prefill packed it in
        another size, say): plan its scatter while the bytes are on their way."""
        t = read.transfer
        if t is None or t.packed is None or self.packer is None or read.scatter_plan is not None:
            return
        clock = time.perf_counter()
        read.scatter_plan = self._plan_scatter(t.packed)
        read.lap("scatter_plan", clock)

    def _plan_scatter(self, packed: PackedRead) -> CopyPlan:
        assert self.packer is not None
        s = packed.scatter
        return self.packer.plan_copy(s[:, 0], s[:, 2], s[:, 1])

    def land(self, read: Read) -> None:
        """The READ is done: a packed request is scattered into its blocks and, with
        ``verify_kv``, decode digests its blocks after that, both on
        the device; neither is waited for here (``Landing.ready`` is asked while the read
        is watched)."""
        t, plan = read.transfer, read.plan
        assert t is not None and plan is not None
        scatter = None
        clock = time.perf_counter()
        if t.packed is not None and t.slot is not None and self.packer:
            self.transport.release(t.handle)
            t.handle = None
            clock = read.lap("release", clock)
            failpoint("sink.before_scatter")
            ahead, read.scatter_plan = read.scatter_plan, None
            scatter = self._scatter(t, ahead)
            clock = read.lap("scatter", clock)
        digests = None
        if self.digester is not None and plan.verify:
            ahead = read.digest_plan
            if ahead is None:  # not planned ahead (its claim's answer came at once)
                ahead = self.digester.plan(self.topology, plan.local_ids)
            read.digest_plan = None
            # behind the scatter, which waited for the compute stream at its launch; with no
            # scatter (NIXL wrote the blocks), behind the compute stream
            digests = self.digester.launch(ahead, after=scatter, after_compute=scatter is None)
            read.lap("digests", clock)
        read.landing = Landing(scatter, digests)
        read.phase = Phase.LAND
        read.mark("launched")

    def _scatter(self, t: Transfer, plan: CopyPlan | None) -> Copy:
        """``t``'s staging slot into its request's blocks (``Packer.scatter``)."""
        assert self.packer is not None and t.packed is not None and t.slot is not None
        s = t.packed.scatter
        return self.packer.scatter(s[:, 0], s[:, 2], s[:, 1], slot=t.slot, plan=plan)

    def landed(self, read: Read) -> None:
        """The scatter is done: the staging slot serves the next read."""
        t = read.transfer
        if t is not None and t.slot is not None and self.packer is not None:
            self.packer.staging.release(t.slot)
            t.slot = None

    def verify(self, read: Read) -> None:
        """``verify_kv``: decode's blocks, as vLLM will read them, against prefill's digests."""
        if read.plan is None or not read.plan.verify:
            return
        assert read.grant is not None and read.grant.digests
        assert read.landing is not None and read.landing.digests is not None
        plan, digests = read.plan, read.grant.digests
        local = read.landing.digests.result()
        remote = {n: np.frombuffer(v, dtype="<u8") for n, v in digests.layers.items()}
        positions = read.order.params.remote_block_ids  # the request's order, as decode has it
        compared, found = compare(
            self.topology, plan.local_ids, plan.remote_ids, local, positions, remote
        )
        if found:
            raise VerificationError(
                f"request {read.request_id}: its KV differs from what prefill "
                f"{read.order.params.remote_engine_id} computed: " + "; ".join(found)
            )
        read.verified = compared
