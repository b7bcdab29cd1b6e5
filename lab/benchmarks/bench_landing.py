#!/usr/bin/env python3
"""Decode's host-side work for one E2B-shaped request, on the CPU: what its engine thread
spends around a READ besides the wire.

On one H200 (results/gpu/2026-12-04) a 16k request's packed READ took 0.15-0.42 ms, but
arrived -> landed (scatter and digests) took 10-15 ms, and block by block spent 28 ms
between the claim and the READ posted. This times the host's share of each step, with
vLLM-laid-out CPU tensors (``demo.cpu_stack``):
- the descriptors (``transfer_descriptors``) and NIXL's preparation of them (no post),
  before the READ;
- the packed plan (``packed_read_of``) and the index plans of the scatter (``Packer.plan_copy``)
  and of the digests (``Digester.plan``), which decode makes while its claim is out, off
  the load's path;
- comparing the digests (``compare``).

It also times the scatter and the digests whole. On the CPU their copies run inline, so
those two rows are memory traffic, not launch cost. Median of ``--repeat`` after one
warm-up.

    .venv/bin/python -m lab.benchmarks.bench_landing [--tokens 16384] [--repeat 7] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Median milliseconds of ``fn`` over ``repeat`` calls after one warm-up; its result."""
    out = fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def nixl_prepare(topo: Any, local: np.ndarray, remote: np.ndarray,
                 repeat: int) -> tuple[str, float, str]:  # fmt: skip
    """NIXL's share of posting a block-by-block READ: the descriptor lists and
    ``initialize_xfer`` for the request's rows, between two agents in this process (nothing
    is posted; UCX's per-descriptor post is what is left of the GPU's claimed -> posted)."""
    import uuid

    from kvshare_connector.transfer.device.nixl import NixlTransport

    ours, theirs = (NixlTransport(f"landing-{uuid.uuid4().hex[:8]}", progress_thread=False)
                    for _ in range(2))  # fmt: skip
    for transport in (ours, theirs):
        transport.register(topo.regions)
    peer = ours.add_peer(theirs.metadata())

    def prepare() -> None:
        descs = ours.agent.get_xfer_descs(local, "DRAM"), ours.agent.get_xfer_descs(remote, "DRAM")
        ours.release(ours.agent.initialize_xfer("READ", *descs, peer, b"landing"))

    try:
        ms, _ = timed(prepare, repeat)
    finally:
        for transport in (ours, theirs):
            transport.close()
    return "NIXL descriptor lists + initialize_xfer (not posted)", ms, f"{len(local):,} rows"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)

    from kvshare_connector.demo import parts as demo
    from kvshare_connector.layout.descriptors import (
        TransferPlan,
        request_descriptors,
        transfer_descriptors,
    )
    from kvshare_connector.layout.matching import pair_owners
    from kvshare_connector.layout.staging import (
        PackedLayout,
        packed_read_of,
    )
    from kvshare_connector.layout.verification import compare

    kv_mib = args.tokens * 56 // 1024 + 128  # two requests in every group, with room
    stack, topo = demo.build("gemma4_e2b_shape", "per_layer", kv_mib, max(2048, args.tokens))
    prefill_ids = demo.request_block_ids(topo, args.tokens, 1)
    decode_ids = demo.request_block_ids(topo, args.tokens, 2)
    plan = TransferPlan(pair_owners(topo, topo, None, None))
    rows: list[tuple[str, float, str]] = []

    ms, (local, remote) = timed(lambda: transfer_descriptors(
        plan, decode_ids, prefill_ids, topo.num_blocks, topo.num_blocks), args.repeat)  # fmt: skip
    rows.append(("descriptors (transfer_descriptors)", ms, f"{len(local):,} rows"))
    rows.append(nixl_prepare(topo, local, remote, args.repeat))
    layout = PackedLayout.of(request_descriptors(topo, prefill_ids))
    ms, packed = timed(lambda: packed_read_of(topo, prefill_ids, layout.nbytes, local, remote),
                       args.repeat)  # fmt: skip
    rows.append(("packed plan (packed_read_of; made while the claim is out)", ms,
                 f"{packed.nbytes:,} bytes"))  # fmt: skip
    s = packed.scatter
    packer = demo.cpu_packer(stack, max(64, packed.nbytes >> 20) + 16)
    # In the slot's offsets: planned before the slot is allocated.
    ms, ahead = timed(lambda: packer.plan_copy(s[:, 0], s[:, 2], s[:, 1]), args.repeat)
    rows.append(("scatter index plan (Packer.plan_copy; ahead)", ms,
                 f"{ahead.rows:,} words of {ahead.word} bytes, one indexed copy"))  # fmt: skip
    digester = demo.cpu_digester(stack)
    ms, plan = timed(lambda: digester.plan(topo, decode_ids), args.repeat)
    rows.append(("digest plan (Digester.plan; made while the claim is out)", ms,
                 f"{len(topo.owners)} layers in {len(plan.groups)} gathers"))  # fmt: skip
    slot = packer.staging.allocate(packed.nbytes)
    assert slot is not None
    ms, _ = timed(lambda: packer.scatter(s[:, 0], s[:, 2], s[:, 1], slot=slot, plan=ahead),
                  args.repeat)  # fmt: skip
    rows.append(("scatter, whole (CPU: the copy runs inline)", ms, ""))
    ms, pending = timed(lambda: digester.start(topo, decode_ids), args.repeat)
    rows.append(("digests, whole (CPU: the sums run inline)", ms, ""))
    digests = pending.result()
    theirs = {name: value.copy() for name, value in digests.items()}
    ms, (compared, found) = timed(lambda: compare(topo, decode_ids, prefill_ids, digests,
                                                  prefill_ids, theirs), args.repeat)  # fmt: skip
    assert not found, found
    rows.append(("compare digests (compare)", ms, f"{compared:,} layer-blocks"))

    print(f"E2B shape, one request of {args.tokens:,} tokens ({packed.nbytes:,} bytes), "
          f"median of {args.repeat} after a warm-up\n")  # fmt: skip
    print("| host work | ms | size |\n|---|---|---|")
    for name, value, size in rows:
        print(f"| {name} | {value:.2f} | {size} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "bytes": packed.nbytes,
                       "rows": [{"step": n, "ms": v, "size": z} for n, v, z in rows]}, f,
                      indent=1)  # fmt: skip
    return 0 if np.isfinite([v for _, v, _ in rows]).all() else 1


if __name__ == "__main__":
    raise SystemExit(main())
