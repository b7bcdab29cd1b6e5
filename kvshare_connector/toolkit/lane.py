"""``kvshare lane``: which UCX lane a decode's READ of prefill's KV would take on this host,
measured without vLLM.

Two processes stand in for prefill and decode: each chooses its UCX settings exactly as the
connector does (``transfer.lanes``) before its NIXL agent starts; prefill fills a probe
buffer on its device, decode READs it (``transfer.probe.LaneProbe``: one wire-up READ, then
timed ones), checks every byte and names the lane. Exit status 0 on a fast lane, 1 on a
slow one (the fix is printed), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

from kvshare_connector.toolkit import checks
from kvshare_connector.transfer.probe import DEFAULT_PROBE_MIB

READY_S = 120.0  # a child's NIXL agent and CUDA context are up within this


def _device(text: str) -> str:
    if text != "cpu" and not text.startswith("cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:N], got {text!r}")
    return text


def _start_side(device: str, mib: float, mode: str, seed: int | None) -> tuple[Any, Any, Any]:
    """This process's lane settings, NIXL agent and probe buffer (prefill's holds ``seed``).
    The child's stdout goes to stderr: NIXL logs there, and ``--json`` keeps stdout clean."""
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    import torch

    from kvshare_connector.transfer import lanes
    from kvshare_connector.transfer.nixl import NixlTransport
    from kvshare_connector.transfer.probe import ProbeBuffer

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    buffer = ProbeBuffer(int(mib * 2**20), device, seed)
    region = buffer.region
    vmm = lanes.legacy_ipc_capable(region.addr) is False if region.mem_kind == "VRAM" else False
    plan = lanes.plan_lane({region.mem_kind}, vmm, mode=mode)
    lanes.apply(plan)
    role = "prefill" if seed is not None else "decode"
    transport = NixlTransport(f"kvshare-lane-{role}-{time.monotonic_ns()}")
    transport.register([region])
    return plan, transport, buffer


def _prefill_main(conn: Connection, device: str, mib: float, mode: str) -> None:
    try:
        plan, transport, buffer = _start_side(device, mib, mode, seed=20261202)
        region = buffer.region
        conn.send(
            {
                "metadata": transport.metadata(),
                "probe": (region.addr, region.nbytes, region.device_id, buffer.seed),
                "settings": plan.describe(),
            }
        )
        conn.poll(READY_S * 5)  # keep the memory registered until decode is done
    except Exception as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


def _decode_main(conn: Connection, device: str, mib: float, mode: str, timeout_s: float) -> None:
    try:
        from kvshare_connector.layout.topology import Region
        from kvshare_connector.transfer.probe import LaneProbe

        plan, transport, buffer = _start_side(device, mib, mode, seed=None)
        remote = conn.recv()
        agent = transport.add_peer(remote["metadata"])
        addr, nbytes, device_id, seed = remote["probe"]
        region = Region(addr, nbytes, device_id)
        probe = LaneProbe(
            transport, buffer, agent, region, seed, "prefill", "local", True, region.mem_kind
        )
        deadline = time.monotonic() + timeout_s
        report = None
        while report is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the probe READ did not finish within {timeout_s:g} s")
            report = probe.advance()
        conn.send({"report": asdict(report), "settings": plan.describe()})
    except Exception as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


def _receive(conn: Connection, who: str, timeout_s: float) -> dict[str, Any]:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"{who} process did not answer within {timeout_s:g} s")
    message = conn.recv()
    if "error" in message:
        raise RuntimeError(f"{who}: {message['error']}")
    return message


def measure(
    prefill_device: str, decode_device: str, mib: float, mode: str = "auto", timeout_s: float = 60
) -> dict[str, Any]:
    """Run the probe between two fresh processes; the decode side's report and both sides'
    UCX settings."""
    ctx = mp.get_context("spawn")
    to_prefill, prefill_end = ctx.Pipe()
    to_decode, decode_end = ctx.Pipe()
    prefill = ctx.Process(target=_prefill_main, args=(prefill_end, prefill_device, mib, mode))
    decode = ctx.Process(
        target=_decode_main, args=(decode_end, decode_device, mib, mode, timeout_s)
    )
    prefill.start()
    decode.start()
    try:
        ready = _receive(to_prefill, "prefill", READY_S)
        to_decode.send(ready)
        result = _receive(to_decode, "decode", READY_S + timeout_s)
        return {
            **result["report"],
            "prefill_settings": ready["settings"],
            "decode_settings": result["settings"],
            "prefill_device": prefill_device,
            "decode_device": decode_device,
        }
    finally:
        to_prefill.send("stop")
        for process in (decode, prefill):
            process.join(10)
            if process.is_alive():
                process.kill()


def _default_device() -> str:
    try:
        import torch

        return "cuda:0" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def check(args: argparse.Namespace) -> None:
    """A GPU for the cuda sides, NIXL and torch importable, before two processes start."""
    checks.require_module(["torch"], "the lane probe allocates its buffers with torch")
    checks.require_module(["nixl_cu13", "nixl"], "pip install nixl-cu13==1.5.1")
    cuda = [d for d in (args.prefill_device, args.decode_device) if d and d.startswith("cuda")]
    if cuda:
        ids = [d.partition(":")[2] or "0" for d in cuda]
        checks.check_gpus(ids, "--prefill-device/--decode-device name a GPU (or use cpu)")


def run(args: argparse.Namespace) -> int:
    prefill = args.prefill_device or _default_device()
    decode = args.decode_device or prefill
    try:
        result = measure(prefill, decode, args.mib, args.ucx_lane, args.timeout)
    except (RuntimeError, TimeoutError) as exc:  # a side failed: say which, no traceback
        print(f"kvshare lane: the probe failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    else:
        print(f"kvshare lane: prefill {prefill} -> decode {decode}")
        print(f"  UCX, prefill: {result['prefill_settings']}")
        print(f"  UCX, decode:  {result['decode_settings']}")
        print(
            f"  lane: {result['lane']}, {result['gbps']:.1f} GB/s (READ of "
            f"{result['nbytes'] / 2**20:.0f} MiB in {result['seconds'] * 1e6:.0f} us, "
            "bytes verified)"
        )
        if result["slow"]:
            print(f"  SLOW: {result['fix']}")
    return 1 if result["slow"] else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lane",
        help="measure the UCX lane a decode READ takes on this host (no vLLM)",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--prefill-device", type=_device, default=None, help="default cuda:0 or cpu")
    p.add_argument("--decode-device", type=_device, default=None, help="default: prefill's")
    p.add_argument(
        "--mib", type=checks.number(float, 0, 4096, above=True), default=float(DEFAULT_PROBE_MIB),
        help="probe READ size (default %(default)s)",
    )  # fmt: skip
    p.add_argument("--ucx-lane", choices=["auto", "off"], default="auto")
    p.add_argument(
        "--timeout", type=checks.positive_float, default=60.0, help="seconds for the probe READs"
    )
    p.add_argument("--json", action="store_true", help="one JSON line instead of text")
    p.set_defaults(func=run, check=check)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="kvshare")
    add_parser(parser.add_subparsers(dest="command", required=True))
    parsed = parser.parse_args(["lane", *sys.argv[1:]])
    sys.exit(parsed.func(parsed))
