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
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvshare_connector.common.child_process import Child, report
from kvshare_connector.demo import kvcheck
from kvshare_connector.demo.cpu_stack import LAYOUTS, MODELS
from kvshare_connector.demo.parts import (
    MAX_MODEL_LEN,
    PROBE_MIB,
    build,
    cpu_packer,
    held_params,
    read_and_check,
    report_table,
    request_block_ids,
    zero_kv,
)
from kvshare_connector.toolkit import checks

READY = "KVSHARE_PREFILL_READY "
DONE = "KVSHARE_PREFILL_DONE "

DEMO_MODULE = "kvshare_connector.demo.run"  # its prefill child runs this module
















# ---- prefill process ----------------------------------------------------------------------


def run_prefill(args: argparse.Namespace) -> int:
    """Serve one request's KV until decode reads it or the lease ends (prints JSON lines)."""
    from kvshare_connector.transfer.device.nixl import NixlTransport
    from kvshare_connector.transfer.device.probe import ProbeBuffer
    from kvshare_connector.transfer.prefill.source import KVSource
    from kvshare_connector.transfer.wire.settings import EngineSettings

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
    """Start ``python -m kvshare_connector.demo.run prefill`` and wait for its ready line."""
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






def run_demo(args: argparse.Namespace) -> int:
    """Both sides here over 127.0.0.1, or one of them (``--role``: ``demo_hosts``)."""
    if args.role is not None:
        from kvshare_connector.demo import hosts as demo_hosts

        role = demo_hosts.run_prefill_host if args.role == "prefill" else demo_hosts.run_decode_host
        return role(args)
    from kvshare_connector.transfer.decode.sink import KVSink
    from kvshare_connector.transfer.device.nixl import NixlTransport
    from kvshare_connector.transfer.device.probe import ProbeBuffer
    from kvshare_connector.transfer.wire.settings import EngineSettings

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






# ---- command line -------------------------------------------------------------------------


def check_demo(args: argparse.Namespace) -> None:
    """What the demo needs here: vLLM (its KV objects) and NIXL (the transfer)."""
    from kvshare_connector.demo import hosts as demo_hosts

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
    from kvshare_connector.demo import hosts as demo_hosts

    demo_hosts.add_arguments(demo)
    demo.set_defaults(func=run_demo, check=check_demo)


def _prefill_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvshare_connector.demo.run prefill")
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
