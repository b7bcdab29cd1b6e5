#!/usr/bin/env python3
"""Loopback NIXL READ of E2B-shaped KV between two processes vs a memcpy of the same bytes.

A prefill process (this script, ``--role prefill``) builds vLLM's KV memory for the
E2B-shaped config (15 owner layers in 5 KV cache groups, 20 sharers; CPU tensors laid out
as vLLM lays them out), fills ``--batch`` requests of ``--tokens`` tokens and serves them
through ``KVSource``. This process builds its own KV memory and reads them through
``KVSink`` over NIXL/UCX on 127.0.0.1, into other block ids. A round reads the whole batch
(~``--gib`` GiB; one E2B request is at most 131,072 tokens, ~0.76 GiB, since sliding
groups keep only their window and the full-attention group holds most bytes); rounds
after the warm-up are timed. In the same process, the same number of bytes is then copied
by a plain memcpy (numpy) and by a memmove per descriptor into the same local rows.
The first and the last round read into zeroed memory and are verified: every block of
every owner holds the byte prefill wrote for its owner and position (a sanity check;
tests/test_transfer.py checks full patterns on every layer).

    .venv/bin/python -m lab.benchmarks.bench_transfer [--tokens 65536] [--gib 1.0] [--repeat 7]
        [--warmup 2] [--progress-thread on|off]
        [--decode-progress-thread on|off] [--json results.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvshare_connector.backends.options import ConnectorOptions
from kvshare_connector.common.child_process import report as report_line
from kvshare_connector.demo.parts import (
    blocks_per_group,
    cpu_packer,
    held_params,
    requests_block_ids,
)
from kvshare_connector.transfer.wire.settings import EngineSettings
from lab.benchmarks.copy_references import idle_cpu, summary, time_cma, time_memcpy, time_memmove

ROOT = Path(__file__).resolve().parents[1]  # children run as -m lab.benchmarks.bench_transfer

MODEL = "gemma4_e2b_shape"
LAYOUT = "per_layer"
READY = "BENCH_PREFILL_READY "
MAX_MODEL_LEN = 2048  # vLLM's check only; requests here are longer (see blocks_per_group)


# ---- KV geometry helpers ----------------------------------------------------------------


def request_bytes(topology: Any, tokens: int) -> int:
    return sum(
        n * g.spec.page_bytes * len(g.layer_names)
        for g, n in zip(topology.groups, blocks_per_group(topology, tokens), strict=True)
    )


def disjoint_requests(topology: Any, tokens: int, count: int, seed: int) -> list[list[list[int]]]:
    try:
        return requests_block_ids(topology, tokens, count, seed)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc


def segments(topology: Any, ids: list[list[int]]):
    """``(value, addr, length)`` for every dense segment of every owner block of a request;
    ``value`` depends on owner and position in the request, never on the block id."""
    for group, block_ids in zip(topology.groups, ids, strict=True):
        for index, name in enumerate(group.layer_names):
            geometry = topology.owners[name].geometry
            for position, block in enumerate(block_ids):
                value = 1 + (group.index * 37 + index * 11 + position * 3) % 251
                start = geometry.base + block * geometry.block_stride
                for offset in geometry.segment_offsets:
                    yield value, start + offset, geometry.segment_len


def fill(topology: Any, ids: list[list[int]], salt: int) -> None:
    for value, addr, length in segments(topology, ids):
        ctypes.memset(addr, (value + salt) % 256, length)


def verify(topology: Any, ids: list[list[int]], salt: int) -> int:
    """Segments that do not hold the expected byte (0 = the read is right)."""
    bad = 0
    for value, addr, length in segments(topology, ids):
        view = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(addr))
        bad += not bool((view == (value + salt) % 256).all())
    return bad


def build(kv_mib: int) -> tuple[Any, Any]:
    from kvshare_connector.demo.parts import build as demo_build

    return demo_build(MODEL, LAYOUT, kv_mib, MAX_MODEL_LEN)


# ---- prefill role ----------------------------------------------------------------------


def run_prefill(args: argparse.Namespace) -> int:
    import uuid

    from kvshare_connector.transfer.device.nixl import NixlTransport
    from kvshare_connector.transfer.prefill.source import KVSource

    stack, topology = build(args.kv_mib)  # stack keeps the KV memory alive
    batch = disjoint_requests(topology, args.tokens, args.batch, seed=1)
    for member, ids in enumerate(batch):
        fill(topology, ids, salt=member)
    engine_id = f"bench-prefill-{uuid.uuid4().hex[:8]}"
    source = KVSource(
        topology,
        NixlTransport(engine_id, **ConnectorOptions.parse(None).nixl_progress),
        EngineSettings(engine_id, lease_s=3600),
        packer=cpu_packer(stack, args.packed_mib),
    )
    rounds = []
    for round_index in range(args.rounds):
        members = [  # every round reads the same blocks again
            held_params(source, f"round{round_index}-member{member}", ids, args.tokens)
            for member, ids in enumerate(batch)
        ]
        rounds.append(members)
    regions = [(r.addr, r.nbytes) for r in topology.regions]
    ready = {"rounds": rounds, "num_blocks": topology.num_blocks, "pid": os.getpid()}
    report_line(READY, {**ready, "regions": regions})

    # A round is held once the one before it was read: a packed request takes a staging
    # slot from its hold until it is read (decode retries its claim meanwhile).
    def hold(round_index: int) -> None:
        for member, ids in enumerate(batch):
            source.hold(f"round{round_index}-member{member}", block_ids=ids)

    hold(0)
    closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), closed.set()), daemon=True).start()
    released = 0
    while not closed.is_set():
        read, expired = source.poll()
        released += len(read) + len(expired)
        if read and released % len(batch) == 0 and released // len(batch) < args.rounds:
            hold(released // len(batch))
        time.sleep(0.001)
    print(f"prefill: {released} request(s) released, {len(source.held)} held", file=sys.stderr)
    source.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter teardown of vLLM and torch


# ---- decode side and the measurements ---------------------------------------------------


def spawn_prefill(args: argparse.Namespace, kv_mib: int, batch: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "lab.benchmarks.bench_transfer",
        "--role",
        "prefill",
        "--tokens",
        str(args.tokens),
        "--batch",
        str(batch),
        "--rounds",
        str(args.warmup + args.repeat),
        "--kv-mib",
        str(kv_mib),
        "--packed-mib",
        str(args.packed_mib),
    ]
    return subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if not args.verbose else None,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        cwd=ROOT,
    )


def wait_ready(process: subprocess.Popen, timeout_s: float) -> dict[str, Any]:
    found: dict[str, Any] = {}

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith(READY):
                found.update(json.loads(line[len(READY) :]))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not found:
        raise SystemExit(f"prefill not ready in {timeout_s:g} s (exit code {process.poll()})")
    return found


def read_round(sink: Any, members: list[dict], local: list, tag: str, timeout_s: float) -> float:
    from kvshare_connector.transfer.wire.kv_params import remote_prefill_params

    start = time.perf_counter()
    pending = set()
    for index, (params, ids) in enumerate(zip(members, local, strict=True)):
        request_id = f"{tag}-{index}"
        sink.request(request_id, remote_prefill_params(params), ids)
        pending.add(request_id)
    while pending:
        done, failed = sink.poll()
        if failed:
            raise SystemExit(f"read failed: {failed}")
        pending -= done
        if time.perf_counter() - start > timeout_s:
            raise SystemExit(f"reads {sorted(pending)} did not finish in {timeout_s:g} s")
    return time.perf_counter() - start


def sizes(args: argparse.Namespace) -> tuple[int, int]:
    """``(requests per round, KV cache MiB per side)``: geometry first (a small cache),
    then caches just large enough for the batch."""
    _, probe = build(64)
    one = request_bytes(probe, args.tokens)
    batch = args.batch or max(1, round(args.gib * (1 << 30) / one))
    bytes_per_block = sum(r.nbytes for r in probe.regions) // probe.num_blocks
    need_blocks = batch * sum(blocks_per_group(probe, args.tokens)) + 64
    return batch, args.kv_mib or math.ceil(need_blocks * bytes_per_block / (1 << 20))


def decode_sink(args: argparse.Namespace, kv_mib: int) -> tuple[Any, Any, Any]:
    """``(stack, topology, sink)`` of the decode side (the stack keeps its KV alive)."""
    from kvshare_connector.transfer.decode.sink import KVSink
    from kvshare_connector.transfer.device.nixl import NixlTransport

    stack, topology = build(kv_mib)
    decode_thread = args.decode_progress_thread or args.progress_thread
    transport = NixlTransport(f"bench-decode-{os.getpid()}", progress_thread=decode_thread == "on")
    settings = EngineSettings("bench-decode", handshake_timeout_s=60.0, transfer_timeout_s=120.0)
    sink = KVSink(topology, transport, settings, packer=cpu_packer(stack, args.packed_mib))
    return stack, topology, sink


def read_rounds(
    args: argparse.Namespace, sink: Any, topology: Any, local: list, rounds: list
) -> tuple[list[float], int, float]:
    """``(seconds of each measured round, bad segments, decode's CPU cores)``: the first
    and the last round land in zeroed caches and are checked block by block."""
    read_times = []
    bad_segments = 0
    cpu0, wall0 = time.process_time(), time.monotonic()
    for index, members in enumerate(rounds):
        checked = index in (0, len(rounds) - 1)
        if checked:
            for region in topology.regions:
                ctypes.memset(region.addr, 0, region.nbytes)
        seconds = read_round(sink, members, local, f"round{index}", 300)
        if checked:
            bad_segments += sum(verify(topology, ids, salt=m) for m, ids in enumerate(local))
        if index >= args.warmup:
            read_times.append(seconds)
    return read_times, bad_segments, (time.process_time() - cpu0) / (time.monotonic() - wall0)


def stop_prefill(prefill: subprocess.Popen) -> None:
    """Close its stdin (its cue to exit), then wait, killing it after 30 s."""
    if prefill.stdin:
        prefill.stdin.close()
    try:
        prefill.wait(timeout=30)
    except subprocess.TimeoutExpired:
        prefill.kill()
        prefill.wait()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the prefill child, read every round, time the in-process copies: the results."""
    from kvshare_connector.layout.descriptors import request_descriptors

    batch, kv_mib = sizes(args)
    prefill = spawn_prefill(args, kv_mib, batch)
    try:
        _stack, topology, sink = decode_sink(args, kv_mib)  # while the prefill builds its own
        local = disjoint_requests(topology, args.tokens, batch, seed=2)
        ready = wait_ready(prefill, 300)
        read_times, bad_segments, read_cores = read_rounds(
            args, sink, topology, local, ready["rounds"]
        )
        idle_cores = idle_cpu(1.0)  # NIXL's progress thread, if on, spins while idle too
        cma_times = time_cma(
            ready["pid"],
            ready["regions"],
            sum(r.bytes for r in sink.records[:batch]),
            args.warmup,
            args.repeat,
        )
        measured = sink.records[batch * args.warmup :]
        per_round = sum(r.bytes for r in measured[:batch])
        descriptors = sorted({r.descriptors for r in sink.records})
        sink.close()
    finally:
        stop_prefill(prefill)

    # The same number of bytes, in this process.
    memcpy_times = time_memcpy(per_round, args.warmup, args.repeat)
    rows = [request_descriptors(topology, ids) for ids in local]
    memmove_times = time_memmove(rows, args.warmup, args.repeat)

    read = summary(read_times, per_round)
    memcpy = summary(memcpy_times, per_round)
    memmove = summary(memmove_times, per_round)
    counts = blocks_per_group(topology, args.tokens)
    return {
        "model": MODEL,
        "owners": len(topology.owners),
        "sharers": len(topology.sharers),
        "groups": len(topology.groups),
        "tokens_per_request": args.tokens,
        "requests_per_round": batch,
        "bytes_per_round": per_round,
        "bytes_per_request": per_round // batch,
        "blocks_per_request": sum(counts),
        "blocks_per_request_by_group": counts,
        "descriptors_per_request": descriptors,
        "memmove_descriptors_per_request": sorted({len(r) for r in rows}),
        "kv_cache_mib_per_side": kv_mib,
        "warmup": args.warmup,
        "repeat": args.repeat,
        "verified": bad_segments == 0,
        "bad_segments": bad_segments,
        "ucx_tls": os.environ.get("UCX_TLS", "default"),
        "nixl_progress_thread": {
            "prefill": args.progress_thread == "on",
            "decode": sink.transport.progress_thread,
        },
        "decode_cpu_cores_during_reads": read_cores,
        "decode_cpu_cores_idle": idle_cores,
        "packed_mib": args.packed_mib,
        "packed_reads": sum(r.packed for r in measured),
        "nixl_read": read,
        # Per request, posted -> DONE. A round posts its requests one after the other and
        # most of a READ runs inside NIXL's transfer() call (UCX's CMA copies there), so
        # the first request of a round also counts the posting of the others.
        "nixl_read_post_to_done_s": [r.seconds for r in measured],
        "memcpy": memcpy,
        "process_vm_readv": summary(cma_times, per_round) if cma_times else None,
        "memmove_per_descriptor": memmove,
        "read_vs_memcpy": read["gb_per_s"] / memcpy["gb_per_s"],
        "read_vs_memmove_per_descriptor": read["gb_per_s"] / memmove["gb_per_s"],
    }


def report(results: dict[str, Any]) -> str:
    """The markdown tables of ``measure``'s results."""
    batch, tokens = results["requests_per_round"], results["tokens_per_request"]
    per_round, bad_segments = results["bytes_per_round"], results["bad_segments"]
    descriptors, counts = results["descriptors_per_request"], results["blocks_per_request_by_group"]
    read, memcpy, memmove = (
        results["nixl_read"],
        results["memcpy"],
        results["memmove_per_descriptor"],
    )
    lines: list[str] = []
    gib = per_round / (1 << 30)
    lines.append(
        f"E2B-shaped KV ({results['owners']} owner layers in {results['groups']} groups, "
        f"{results['sharers']} sharers): a round reads {batch} request(s) of {tokens:,} "
        f"tokens = {gib:.2f} GiB; median of {results['repeat']} rounds after "
        f"{results['warmup']} warm-up"
    )
    lines.append("")
    lines.append("| copy of the same bytes | median | min - max | stdev | GB/s | vs memcpy |")
    lines.append("|---|---|---|---|---|---|")
    how = "packed: READ + scatter" if results.get("packed_reads") else "block by block"
    rows = [
        (f"NIXL READ, 2 processes, UCX on 127.0.0.1, {how}", read),
        (
            "process_vm_readv (the kernel copy of UCX's CMA), 2 processes",
            results["process_vm_readv"],
        ),
        ("memmove per descriptor, 1 process", memmove),
        ("memcpy (numpy, contiguous), 1 process", memcpy),
    ]
    for label, s in (row for row in rows if row[1]):
        lines.append(
            f"| {label} | {s['median_s'] * 1e3:.0f} ms | {s['min_s'] * 1e3:.0f} - "
            f"{s['max_s'] * 1e3:.0f} ms | {s['stdev_s'] * 1e3:.1f} ms | {s['gb_per_s']:.2f} | "
            f"{s['gb_per_s'] / memcpy['gb_per_s']:.2f}x |"
        )
    lines.append("")
    lines.append("| per request | value |")
    lines.append("|---|---|")
    lines.append(f"| tokens | {tokens:,} |")
    lines.append(f"| bytes | {per_round // batch:,} ({per_round // batch / (1 << 20):.0f} MiB) |")
    lines.append(f"| blocks (per group) | {sum(counts):,} ({', '.join(str(c) for c in counts)}) |")
    lines.append(f"| NIXL descriptors (coalesced) | {', '.join(f'{d:,}' for d in descriptors)} |")
    lines.append(f"| bytes per descriptor | {per_round // batch // max(descriptors):,} |")
    memmove_rows = ", ".join(f"{n:,}" for n in results["memmove_descriptors_per_request"])
    lines.append(f"| memmove rows (local side coalesced alone) | {memmove_rows} |")
    verdict = "yes" if bad_segments == 0 else f"NO: {bad_segments} segment(s) wrong"
    lines.append(f"| every owner block holds prefill's bytes | {verdict} |")
    threads = results["nixl_progress_thread"]
    thread = "/".join("on" if threads[side] else "off" for side in ("prefill", "decode"))
    lines.append(
        f"| NIXL progress thread prefill/decode; decode's CPU cores in READ rounds / idle "
        f"| {thread}; "
        f"{results['decode_cpu_cores_during_reads']:.2f} / {results['decode_cpu_cores_idle']:.2f} |"
    )
    lines.append("")
    lines.append(
        f"ratio NIXL READ / memcpy: {results['read_vs_memcpy']:.2f}; "
        f"NIXL READ / memmove per descriptor: {results['read_vs_memmove_per_descriptor']:.2f}"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--role", choices=["main", "prefill"], default="main", help=argparse.SUPPRESS
    )
    parser.add_argument("--tokens", type=int, default=65_536, help="tokens per request")
    parser.add_argument("--gib", type=float, default=1.0, help="bytes read per round (target)")
    parser.add_argument("--batch", type=int, default=0, help="requests per round (0: from --gib)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--kv-mib", type=int, default=0, help="KV cache per side (0: just enough)")
    parser.add_argument(
        "--packed-mib",
        type=int,
        default=0,
        help="staging area per side: each request is gathered, READ as a few runs, scattered",
    )
    parser.add_argument(
        "--progress-thread",
        choices=["on", "off"],
        default="on",
        help="NIXL's progress thread in both processes (on: NIXL's and the connector's default)",
    )
    parser.add_argument(
        "--decode-progress-thread",
        choices=["on", "off"],
        help="decode's own setting (default: --progress-thread's)",
    )
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--verbose", action="store_true", help="show the prefill's stderr")
    args = parser.parse_args()
    if args.role == "main":  # the prefill child inherits it; decode's is passed explicitly
        os.environ["KVSHARE_NIXL_PROGRESS_THREAD"] = "1" if args.progress_thread == "on" else "0"
    if args.role == "prefill":
        return run_prefill(args)
    results = measure(args)
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if results["bad_segments"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
