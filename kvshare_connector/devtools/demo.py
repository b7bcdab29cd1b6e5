"""``kvshare demo``: a real NIXL transfer of Gemma-4-shaped KV between two processes, checked.

The prefill process builds vLLM's KV memory for the model (CPU tensors laid out as vLLM or
kvcached lays them out), fills a request's blocks with a pattern, registers its owner
regions and serves its layout on the side channel. The decode process (this one) builds
its own KV memory, possibly in another layout and with other block ids, handshakes, READs
the request over NIXL/UCX on 127.0.0.1, and checks every layer, sharers included, holds
the pattern. A negative control then reads the wrong blocks and must fail the same check.
With ``--role prefill|decode`` one side runs on each of two hosts (``demo_hosts``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvshare_connector.common.child_process import Child, report
from kvshare_connector.devtools import kvcheck
from kvshare_connector.devtools.cpu_stack import LAYOUTS, MODELS
from kvshare_connector.toolkit import checks

READY = "KVSHARE_PREFILL_READY "
DONE = "KVSHARE_PREFILL_DONE "

DEMO_MODULE = "kvshare_connector.devtools.demo"  # its prefill child runs this module
MAX_MODEL_LEN = 2048  # of the demo's KV caches: a request has at most this many tokens
PROBE_MIB = 4  # the lane probe decode READs and checks after the handshake


def blocks_per_group(topology: Any, tokens: int) -> list[int]:
    """Blocks of one request of ``tokens`` tokens per group; sliding-window groups keep
    only the blocks of the window (+1 for alignment, as vLLM clips them)."""
    counts = []
    for group in topology.groups:
        blocks = math.ceil(tokens / group.spec.block_size)
        if group.spec.sliding_window:
            blocks = min(blocks, math.ceil(group.spec.sliding_window / group.spec.block_size) + 1)
        counts.append(blocks)
    return counts


def requests_block_ids(topology: Any, tokens: int, count: int, seed: int) -> list[list[list[int]]]:
    """Block ids a vLLM block pool could give ``count`` requests, per group: distinct
    across groups and requests, shuffled, never the null block 0."""
    import numpy as np

    per_group = blocks_per_group(topology, tokens)
    need = count * sum(per_group)
    if need >= topology.num_blocks:
        raise ValueError(
            f"{count} request(s) of {tokens} tokens need {need} blocks, the cache has "
            f"{topology.num_blocks}"
        )
    pool = np.random.default_rng(seed).permutation(np.arange(1, topology.num_blocks))
    out, start = [], 0
    for _ in range(count):
        request = []
        for n in per_group:
            request.append([int(b) for b in pool[start : start + n]])
            start += n
        out.append(request)
    return out


def request_block_ids(topology: Any, tokens: int, seed: int) -> list[list[int]]:
    """Block ids of one request (see ``requests_block_ids``)."""
    return requests_block_ids(topology, tokens, 1, seed)[0]


def build(model: str, layout: str, kv_mib: int, max_model_len: int) -> tuple[Any, Any]:
    from kvshare_connector.devtools.cpu_stack import build_cpu_stack, topology_of

    stack = build_cpu_stack(model, layout, kv_bytes=kv_mib << 20, max_model_len=max_model_len)
    return stack, topology_of(stack)


def cpu_packer(stack: Any, packed_mib: int) -> Any:
    """A host staging area over this process's KV tensors (None: packing off)."""
    if packed_mib <= 0:
        return None
    from kvshare_connector.transfer.packing import MemoryMap, Packer, StagingArea

    return Packer(MemoryMap(stack.kv_caches.values()), StagingArea(packed_mib << 20, "cpu"))


def cpu_digester(stack: Any) -> Any:
    """``verify_kv`` digests over this process's KV tensors, on the host."""
    from kvshare_connector.transfer.digests import Digester
    from kvshare_connector.transfer.packing import MemoryMap

    return Digester(MemoryMap(stack.kv_caches.values()), "cpu")


def held_params(source: Any, request_id: str, ids: list[list[int]], tokens: int) -> dict:
    """The ``kv_transfer_params`` decode reads a request ``source`` holds with: what a
    prefill engine's connector would hand back for it."""
    from kvshare_connector.transfer.kv_params import kv_transfer_params

    return kv_transfer_params(
        remote_block_ids=ids,
        remote_engine_id=source.settings.engine_id,
        remote_request_id=request_id,
        remote_host=source.host,
        remote_port=source.port,
        remote_num_tokens=tokens,
    )


# ---- prefill process ----------------------------------------------------------------------


def run_prefill(args: argparse.Namespace) -> int:
    """Serve one request's KV until decode reads it or the lease ends (prints JSON lines)."""
    from kvshare_connector.transfer.nixl import NixlTransport
    from kvshare_connector.transfer.probe import ProbeBuffer
    from kvshare_connector.transfer.settings import EngineSettings
    from kvshare_connector.transfer.source import KVSource

    stack, topology = build(args.model, args.layout, args.kv_mib, args.max_model_len)
    ids = request_block_ids(topology, args.tokens, args.seed)
    kvcheck.fill(stack.kv_caches, topology, ids, seed=args.seed)
    engine_id = f"prefill-{uuid.uuid4().hex[:8]}"
    source = KVSource(
        topology,
        NixlTransport(engine_id),
        EngineSettings(engine_id, lease_s=args.lease_s),
        packer=cpu_packer(stack, args.packed_mib),
        probe=ProbeBuffer(PROBE_MIB << 20, "cpu", seed=args.seed),
    )
    request_id = "req-0"
    source.hold(request_id, block_ids=ids)
    params = held_params(source, request_id, ids, args.tokens)
    ready = {
        "kv_transfer_params": params,
        "layout": topology.layout,
        "owners": len(topology.owners),
        "sharers": len(topology.sharers),
        "registered_bytes": source.transport.registered_bytes,
    }
    report(READY, ready)
    deadline = time.monotonic() + args.lease_s + 30
    read: set[str] = set()
    expired: set[str] = set()
    while time.monotonic() < deadline and not (read or expired):
        r, e = source.poll()
        read |= r
        expired |= e
        time.sleep(0.005)
    report(
        DONE, {"read": sorted(read), "expired": sorted(expired), "still_held": sorted(source.held)}
    )
    time.sleep(args.linger_s)
    source.close()
    return 0


@dataclass
class PrefillProcess:
    """A prefill process started with ``spawn_prefill``."""

    child: Child
    ready: dict[str, Any]

    def wait_done(self, timeout_s: float) -> dict[str, Any]:
        return self.child.wait_json(DONE, timeout_s)

    def stop(self) -> None:
        self.child.kill()


def spawn_prefill(
    model: str,
    layout: str,
    tokens: int,
    seed: int = 0,
    lease_s: float = 30.0,
    kv_mib: int = 64,
    max_model_len: int = MAX_MODEL_LEN,
    linger_s: float = 1.0,
    timeout_s: float = 120.0,
    packed_mib: int = 0,
) -> PrefillProcess:
    """Start ``python -m kvshare_connector.devtools.demo prefill`` and wait for its ready line."""
    args = ["-m", DEMO_MODULE, "prefill", "--model", model, "--layout", layout]
    args += ["--tokens", str(tokens), "--seed", str(seed), "--lease-s", str(lease_s)]
    args += ["--kv-mib", str(kv_mib), "--max-model-len", str(max_model_len)]
    args += ["--linger-s", str(linger_s), "--packed-mib", str(packed_mib)]
    child = Child(args)
    try:
        return PrefillProcess(child, child.wait_json(READY, timeout_s))
    except TimeoutError:
        child.kill()
        raise


# ---- decode side --------------------------------------------------------------------------


@dataclass
class ReadResult:
    done: bool
    failure: str | None
    seconds: float
    bytes: int
    descriptors: int
    mismatches: list[str]
    stray: list[str]
    packed: bool = False


def read_and_check(
    sink: Any,
    stack: Any,
    topology: Any,
    params: dict[str, Any],
    local_ids: list[list[int]],
    seed: int,
    request_id: str,
    timeout_s: float = 60.0,
    check_ids: list[list[int]] | None = None,
) -> ReadResult:
    """Read one request through ``sink`` and check the pattern landed in ``local_ids``."""
    from kvshare_connector.transfer.kv_params import remote_prefill_params

    start = time.monotonic()
    sink.request(request_id, remote_prefill_params(params), local_ids)
    done, failed = set(), {}
    while request_id not in done and request_id not in failed:
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"read of {request_id} neither finished nor failed")
        d, f = sink.poll()
        done |= d
        failed.update(f)
        time.sleep(0.001)
    seconds = time.monotonic() - start
    record = next((r for r in sink.records if r.request_id == request_id), None)
    expected = check_ids if check_ids is not None else local_ids
    return ReadResult(
        done=request_id in done,
        failure=failed.get(request_id),
        seconds=seconds,
        bytes=record.bytes if record else 0,
        descriptors=record.descriptors if record else 0,
        packed=bool(record and record.packed),
        mismatches=kvcheck.mismatches(stack.kv_caches, topology, expected, seed=seed),
        stray=kvcheck.nonzero_blocks_outside(stack.kv_caches, topology, expected),
    )


def run_demo(args: argparse.Namespace) -> int:
    """Both sides here over 127.0.0.1, or one of them (``--role``: ``demo_hosts``)."""
    if args.role is not None:
        from kvshare_connector.devtools import demo_hosts

        role = demo_hosts.run_prefill_host if args.role == "prefill" else demo_hosts.run_decode_host
        return role(args)
    from kvshare_connector.transfer.nixl import NixlTransport
    from kvshare_connector.transfer.probe import ProbeBuffer
    from kvshare_connector.transfer.settings import EngineSettings
    from kvshare_connector.transfer.sink import KVSink

    print(
        f"kvshare demo: {args.model}, prefill {args.prefill_layout} -> decode "
        f"{args.decode_layout}, {args.tokens} tokens, NIXL/UCX over 127.0.0.1"
    )

    def prefill_process() -> PrefillProcess:
        return spawn_prefill(
            args.model,
            args.prefill_layout,
            args.tokens,
            seed=1,
            lease_s=args.lease_s or 30.0,
            packed_mib=args.packed_mib,
        )

    # Decode's KV first: prefill's lease runs from its ready line, and building vLLM's
    # objects can take longer than the lease on a loaded machine.
    stack, topology = build(args.model, args.decode_layout, 64, MAX_MODEL_LEN)
    sink = KVSink(
        topology,
        NixlTransport(f"decode-{uuid.uuid4().hex[:8]}"),
        EngineSettings(f"decode-{uuid.uuid4().hex[:8]}"),
        packer=cpu_packer(stack, args.packed_mib),
        probe=ProbeBuffer(PROBE_MIB << 20, "cpu"),
    )
    prefill = prefill_process()
    try:
        local_ids = request_block_ids(topology, args.tokens, seed=2)
        params = prefill.ready["kv_transfer_params"]
        result = read_and_check(sink, stack, topology, params, local_ids, seed=1, request_id="d-0")
        lanes = sink.take_lanes()
        released = prefill.wait_done(30)
    finally:
        prefill.stop()

    # Negative controls, on a second prefill: kv_transfer_params naming its blocks in the
    # wrong order (what a proxy that sorts lists sends) must be refused by prefill; its
    # blocks read into decode's in the wrong order must fail the byte check.
    control = prefill_process()
    try:
        params = dict(control.ready["kv_transfer_params"])
        reordered = [list(reversed(ids)) for ids in params["remote_block_ids"]]
        zero_kv(topology)
        refused = read_and_check(sink, stack, topology, dict(params, remote_block_ids=reordered),
                                 local_ids, seed=1, request_id="d-1")  # fmt: skip
        misplaced = [list(reversed(ids)) for ids in local_ids]
        negative = read_and_check(sink, stack, topology, params, misplaced, seed=1,
                                  request_id="d-2", check_ids=local_ids)  # fmt: skip
        control.wait_done(30)
    finally:
        control.stop()
        sink.close()

    ok = (
        result.done
        and not result.mismatches
        and not result.stray
        and released["read"] == ["req-0"]
        and len(lanes) == 1
    )
    refused_ok = not refused.done and "in their order" in (refused.failure or "")
    control_ok = refused_ok and negative.done and bool(negative.mismatches)
    report_table(prefill.ready, stack, topology, local_ids, result, lanes,
                 released["read"] == ["req-0"], negative, refused_ok)  # fmt: skip
    print("RESULT:", "PASS" if ok and control_ok else "FAIL")
    return 0 if ok and control_ok else 1


def report_table(
    ready: dict[str, Any],
    stack: Any,
    topology: Any,
    local_ids: list[list[int]],
    result: Any,
    lanes: list[Any],
    released: bool | None,
    negative: Any,
    refused: bool,
    extra: list[tuple[str, str]] | None = None,
) -> None:
    """The demo's table: what was registered, read and checked (``released`` None: prefill,
    on another host, says), then the ``extra`` rows."""
    layers = len(stack.kv_caches)
    bad_layers = len({m.split(" ")[0] for m in result.mismatches})
    rows = [
        ("prefill layout", ready["layout"]),
        ("decode layout", topology.layout),
        (
            "owner layers registered",
            f"{ready['owners']} (prefill), {len(topology.owners)} (decode)",
        ),
        ("sharing layers", f"{len(topology.sharers)} (never registered)"),
        ("registered bytes (prefill)", f"{ready['registered_bytes']:,}"),
        ("KV cache groups", str(len(topology.groups))),
        ("blocks read", str(sum(len(i) for i in local_ids))),
        ("bytes read", f"{result.bytes:,}"),
        ("descriptors", str(result.descriptors)),
        ("moved packed (staging areas, a few large runs)", str(result.packed)),
        ("read time (incl. handshake)", f"{result.seconds * 1000:.1f} ms"),
        (
            "lane (probe READ, bytes checked)",
            ", ".join(f"{lane.lane}, {lane.gbps:.2f} GB/s" for lane in lanes) or "not measured",
        ),
        ("layers holding prefill's KV (owners + sharers)", f"{layers - bad_layers}/{layers}"),
        ("stray writes outside the request", str(len(result.stray))),
        (
            "prefill released the blocks",
            "see prefill's output" if released is None else str(released),
        ),
        (
            "negative control (blocks misplaced) detected",
            f"{negative.done and bool(negative.mismatches)} ({len(negative.mismatches)} bad "
            "blocks)",
        ),
        ("negative control (reordered block list) refused by prefill", str(refused)),
        *(extra or []),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def zero_kv(topology: Any) -> None:
    import ctypes

    for region in topology.regions:
        ctypes.memset(region.addr, 0, region.nbytes)


# ---- command line -------------------------------------------------------------------------


def check_demo(args: argparse.Namespace) -> None:
    """What the demo needs here: vLLM (its KV objects) and NIXL (the transfer)."""
    from kvshare_connector.devtools import demo_hosts

    demo_hosts.check_roles(args)
    checks.require_module(["vllm"], "pip install vllm")
    checks.require_module(["nixl", "nixl_cu13"], "pip install nixl-cu13==1.5.1")


def add_parser(subparsers: Any) -> None:
    """Plug ``demo`` (and the internal ``prefill`` role) into the ``kvshare`` command."""
    demo = subparsers.add_parser("demo", help="real NIXL transfer of Gemma-4-shaped KV, checked")
    demo.add_argument("--model", choices=MODELS, default="gemma4_e2b_shape")
    demo.add_argument("--prefill-layout", choices=LAYOUTS, default="per_layer")
    demo.add_argument("--decode-layout", choices=LAYOUTS, default="per_layer")
    demo.add_argument(
        "--tokens",
        type=checks.number(int, 1, MAX_MODEL_LEN),
        default=1000,
        help=f"tokens of the request read (1-{MAX_MODEL_LEN})",
    )
    demo.add_argument(
        "--lease-s",
        type=checks.positive_float,
        help="how long prefill holds the requests (30 s; 600 s with --role)",
    )
    demo.add_argument(
        "--packed-mib",
        type=checks.non_negative_int,
        default=64,
        help="staging area per side for packed transfer (0: read block by block)",
    )
    from kvshare_connector.devtools import demo_hosts

    demo_hosts.add_arguments(demo)
    demo.set_defaults(func=run_demo, check=check_demo)


def _prefill_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvshare_connector.devtools.demo prefill")
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--layout", choices=LAYOUTS, required=True)
    parser.add_argument("--tokens", type=checks.positive_int, required=True)
    parser.add_argument("--seed", type=checks.non_negative_int, default=0)
    parser.add_argument("--lease-s", type=checks.positive_float, default=30.0)
    parser.add_argument("--kv-mib", type=checks.positive_int, default=64)
    parser.add_argument("--max-model-len", type=checks.positive_int, default=MAX_MODEL_LEN)
    parser.add_argument("--linger-s", type=checks.non_negative_float, default=1.0)
    parser.add_argument(
        "--packed-mib", type=checks.non_negative_int, default=0, help="staging area (0: off)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["prefill"]:
        return run_prefill(_prefill_parser().parse_args(argv[1:]))
    parser = argparse.ArgumentParser(prog="kvshare")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
