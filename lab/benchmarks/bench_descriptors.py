#!/usr/bin/env python3
"""Descriptor building for a Gemma-4 E2B geometry: our vectorised path vs a Python loop.

Same run, same inputs, reported as ratios:
  * per request: descriptors for a 2,000-block request (per group), ours vs a loop over
    layers and blocks that appends one ``(addr, len, dev)`` tuple per slab;
  * per engine: the per-block descriptor list a loop prepares up front for a 200k-block
    cache (what a connector that prepares every block at registration does) vs our
    registration rows;
  * coalescing: descriptor count of a contiguous request, slabs vs coalesced rows.

The geometry (groups, block sizes, strides) comes from vLLM's own objects for the
E2B-shaped config; only the block count is scaled, on synthetic addresses (200k blocks
of E2B are 19 GiB), since descriptor math never touches the bytes.

    .venv/bin/python -m lab.benchmarks.bench_descriptors [--blocks 200000] [--request 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from kvshare_connector.layout.descriptors import (
    PairedOwner,
    TransferPlan,
    request_descriptors,
    transfer_descriptors,
)
from kvshare_connector.layout.matching import pair_owners
from kvshare_connector.layout.topology import KVTopology, TensorView, build_topology


def scaled_topology(num_blocks: int) -> KVTopology:
    """The E2B topology vLLM builds, re-laid over ``num_blocks`` blocks at fake addresses."""
    from kvshare_connector.demo.parts import build

    stack, small = build("gemma4_e2b_shape", "per_layer", 64, 2048)
    views, base = {}, 1 << 40
    storages: dict[int, int] = {}
    for name, owner in small.owners.items():
        real = TensorView.of(stack.kv_caches[name])
        # Layers that shared a raw tensor keep sharing one (the HMA overlay).
        if real.storage_ptr not in storages:
            storages[real.storage_ptr] = base
            base += num_blocks * owner.spec.page_bytes + (1 << 30)
        start = storages[real.storage_ptr] + (real.data_ptr - real.storage_ptr)
        shape = (num_blocks, *real.shape[1:])
        views[name] = TensorView(
            start,
            shape,
            real.strides,
            real.itemsize,
            storages[real.storage_ptr],
            num_blocks * owner.spec.page_bytes,
            -1,
        )
    labels = {n: o.labels for n, o in small.owners.items()}
    return build_topology(small.groups, views, labels, small.sharers, num_blocks, "per_layer")


def loop_descriptors(
    topology: KVTopology, block_ids: list[list[int]]
) -> list[tuple[int, int, int]]:
    """The straightforward way: one tuple per (layer, block, segment)."""
    out = []
    for group, ids in zip(topology.groups, block_ids, strict=True):
        for name in group.layer_names:
            g = topology.owners[name].geometry
            offsets, length, dev = g.segment_offsets, g.segment_len, max(g.device_id, 0)
            for block in ids:
                start = g.base + block * g.block_stride
                for offset in offsets:
                    out.append((start + offset, length, dev))
    return out


def loop_pairs(
    owners: list[PairedOwner], local_ids: list[list[int]], remote_ids: list[list[int]]
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """The straightforward decode read: matching local and remote tuples per slab."""
    local, remote = [], []
    for owner in owners:
        lg, rg = owner.local, owner.remote
        length, ldev, rdev = lg.segment_len, max(lg.device_id, 0), max(rg.device_id, 0)
        pairs = list(zip(lg.segment_offsets, rg.segment_offsets, strict=True))
        for lb, rb in zip(local_ids[owner.group], remote_ids[owner.group], strict=True):
            lstart, rstart = lg.base + lb * lg.block_stride, rg.base + rb * rg.block_stride
            for lo, ro in pairs:
                local.append((lstart + lo, length, ldev))
                remote.append((rstart + ro, length, rdev))
    return local, remote


def loop_prepare_all_blocks(topology: KVTopology) -> list[tuple[int, int, int]]:
    """Per-block descriptors of every block of every owner, prepared up front."""
    return loop_descriptors(topology, [list(range(topology.num_blocks))] * len(topology.groups))


def timed(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def versus(loop_s: float, ours_s: float, **counts: float) -> dict:
    """One row of the report: the per-descriptor loop against ours."""
    return {"loop_s": loop_s, "ours_s": ours_s, "speedup": loop_s / ours_s, **counts}


def request_ids(
    blocks: int, request: int, groups: int
) -> tuple[np.ndarray, list[list[int]], list[list[int]]]:
    """``(pool, scattered, contiguous)``: a request's block ids per group, drawn from a
    shuffled pool of the cache's blocks (0 is the null block) or laid out in a row."""
    pool = np.random.default_rng(0).permutation(np.arange(1, blocks))[: groups * request]
    scattered = [pool[i * request : (i + 1) * request].tolist() for i in range(groups)]
    contiguous = [list(range(1 + i * request, 1 + (i + 1) * request)) for i in range(groups)]
    return pool, scattered, contiguous


def build_times(
    topology: KVTopology, scattered: list[list[int]], contiguous: list[list[int]], repeat: int
) -> dict:
    """One side's descriptors of a request, built by the loop and by ours."""
    t_loop, slabs = timed(lambda: loop_descriptors(topology, scattered), repeat)
    t_ours, rows = timed(lambda: request_descriptors(topology, scattered), repeat)
    assert sum(s[1] for s in slabs) == int(rows[:, 1].sum())  # same bytes either way
    t_loop_c, slabs_c = timed(lambda: loop_descriptors(topology, contiguous), repeat)
    t_ours_c, rows_c = timed(lambda: request_descriptors(topology, contiguous), repeat)
    t_prep, prepared = timed(lambda: loop_prepare_all_blocks(topology), 1)
    # The floor of any vectorised path: turning vLLM's Python lists of ids into an array.
    t_ids, _ = timed(
        lambda: [np.fromiter(ids, dtype=np.int64, count=len(ids)) for ids in scattered], repeat
    )
    return {
        "scattered": versus(t_loop, t_ours, slabs=len(slabs), rows=len(rows)),
        "contiguous": versus(
            t_loop_c,
            t_ours_c,
            slabs=len(slabs_c),
            rows=len(rows_c),
            coalescing=len(slabs_c) / len(rows_c),
        ),
        "ids_to_array_s": t_ids,
        "prepare_all_blocks": {
            "loop_s": t_prep,
            "descriptors": len(prepared),
            "our_registration_rows": len(topology.regions),
        },
    }


def pair_times(
    topology: KVTopology,
    remote: list[list[int]],
    scattered: list[list[int]],
    contiguous: list[list[int]],
    repeat: int,
) -> dict:
    """Decode's read: local and remote rows together (the plan is made once per peer)."""
    owners = pair_owners(topology, topology)
    plan = TransferPlan(owners)
    n = topology.num_blocks

    def ours_pairs(local_ids: list[list[int]]) -> tuple:
        return transfer_descriptors(plan, local_ids, remote, n, n)

    t_loop_p, (pairs, _) = timed(lambda: loop_pairs(owners, scattered, remote), repeat)
    t_ours_p, (prow, _) = timed(lambda: ours_pairs(scattered), repeat)
    assert sum(p[1] for p in pairs) == int(prow[:, 1].sum())
    t_loop_pc, _ = timed(lambda: loop_pairs(owners, contiguous, remote), repeat)
    t_ours_pc, _ = timed(lambda: ours_pairs(contiguous), repeat)
    return {
        "paired_scattered": versus(t_loop_p, t_ours_p),
        "paired_contiguous_local": versus(t_loop_pc, t_ours_pc),
    }


def dlist_times(
    topology: KVTopology, scattered: list[list[int]], contiguous: list[list[int]], repeat: int
) -> dict:
    """What a transfer consumes: a NIXL descriptor list, from either side's rows."""
    from kvshare_connector.transfer.device.nixl import NixlTransport

    agent = NixlTransport("bench-descriptors").agent
    found = {}
    for name, ids in (("scattered", scattered), ("contiguous", contiguous)):
        t_loop, _ = timed(
            lambda ids=ids: agent.get_xfer_descs(loop_descriptors(topology, ids), "DRAM"), repeat
        )
        t_ours, _ = timed(
            lambda ids=ids: agent.get_xfer_descs(request_descriptors(topology, ids), "DRAM"),
            repeat,
        )
        found[f"{name}_to_nixl_dlist"] = versus(t_loop, t_ours)
    return found


def measure(args: argparse.Namespace) -> dict:
    """Every timing and count of the report, as one JSON-able dict."""
    topology = scaled_topology(args.blocks)
    groups = len(topology.groups)
    pool, scattered, contiguous = request_ids(args.blocks, args.request, groups)
    remote = [pool[::-1][i * args.request : (i + 1) * args.request].tolist() for i in range(groups)]
    built = build_times(topology, scattered, contiguous, args.repeat)
    paired = pair_times(topology, remote, scattered, contiguous, args.repeat)
    dlists = dlist_times(topology, scattered, contiguous, args.repeat)
    return {
        "owners": len(topology.owners),
        "groups": groups,
        "cache_blocks": args.blocks,
        "request_blocks_per_group": args.request,
        "scattered": built["scattered"],
        "contiguous": built["contiguous"],
        **dlists,
        **paired,
        "ids_to_array_s": built["ids_to_array_s"],
        "prepare_all_blocks": built["prepare_all_blocks"],
        "repeat": args.repeat,
    }


def faster(case: str, r: dict) -> str:
    """A report row of build times, the loop's against ours."""
    return (
        f"| {case} | {r['loop_s'] * 1e3:.1f} ms | {r['ours_s'] * 1e3:.2f} ms "
        f"| {r['speedup']:.0f}x faster |"
    )


def fewer(case: str, r: dict, digits: int) -> str:
    """A report row of descriptor counts, the loop's against ours."""
    ratio = r["slabs"] / r["rows"]
    return f"| {case} | {r['slabs']:,} | {r['rows']:,} | {ratio:.{digits}f}x fewer |"


def report(results: dict) -> str:
    """The markdown table (and the targets line) of ``measure``'s results."""
    blocks, t_ids = results["cache_blocks"], results["ids_to_array_s"]
    s, c, p = results["scattered"], results["contiguous"], results["prepare_all_blocks"]
    x, xc = results["scattered_to_nixl_dlist"], results["contiguous_to_nixl_dlist"]
    pp, ppc = results["paired_scattered"], results["paired_contiguous_local"]
    lines = [
        f"E2B geometry: {results['owners']} owners in {results['groups']} groups, "
        f"{blocks:,}-block cache, request of {results['request_blocks_per_group']:,} blocks "
        f"per group (median of {results['repeat']})",
        "| case | loop | ours | ratio |",
        "|---|---|---|---|",
        faster("scattered request: build time", s),
        faster("contiguous request: build time", c),
        faster("scattered request: to a NIXL descriptor list", x),
        fewer("contiguous request: descriptors", c, digits=0),
        fewer("scattered request: descriptors", s, digits=1),
        f"| per-engine setup ({blocks:,} blocks) | {p['descriptors']:,} descriptors, "
        f"{p['loop_s']:.2f} s | {p['our_registration_rows']} regions, 0 s | - |",
        faster("contiguous request: to a NIXL descriptor list", xc),
        faster("decode read, local+remote (scattered): build time", pp),
        faster("decode read, local+remote (contiguous local): build time", ppc),
        f"| of which: the request's block ids, Python lists -> int64 | - "
        f"| {t_ids * 1e3:.2f} ms | the floor: at most {s['loop_s'] / t_ids:.0f}x |",
    ]
    fastest = min(r["speedup"] for r in (s, c, x, xc, pp, ppc))
    targets = (
        f"targets: >=20x faster (every row): {'met' if fastest >= 20 else 'MISSED'}; "
        f">=4x fewer descriptors (contiguous): {'met' if c['coalescing'] >= 4 else 'MISSED'}"
    )
    return "\n".join([*lines, targets])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=200_000)
    parser.add_argument("--request", type=int, default=2_000, help="blocks per group")
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = measure(args)
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
