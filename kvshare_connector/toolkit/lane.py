"""``kvshare lane``: which UCX lane a decode's READ of prefill's KV takes, measured without vLLM.

Each side chooses its UCX settings exactly as the connector does (``transfer.device.lanes``)
before its NIXL agent starts; prefill fills a probe buffer, decode READs it
(``transfer.device.probe.LaneProbe``: one wire-up READ, then timed ones), checks every byte and
names the lane by what carried the bytes, with every UCX setting in force on each side.

* ``kvshare lane``: both sides on this host, each in a process of its own.
* ``kvshare lane --serve HOST:PORT --secret-file F`` on the prefill host: a lane peer, a
  side channel with a probe buffer behind it (no engine), until Ctrl-C or SIGTERM.
* ``kvshare lane --prefill HOST:PORT --secret-file F`` on the decode host: READs from that
  lane peer, or from a running prefill engine's side channel (its own probe buffer), as
  the decode engine there would; ``--engine-id`` where the side channel should not be
  asked (the first answer names it).

Exit status 0 on a fast lane, 1 on a slow one (the fix is printed) or a failed probe, 2 on
bad arguments.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import signal
import sys
import threading
import time
from dataclasses import asdict
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvshare_connector.toolkit import checks
from kvshare_connector.transfer.device.probe import DEFAULT_PROBE_MIB

READY_S = 120.0  # a child's NIXL agent and CUDA context are up within this
SECRET_ENV = "KVSHARE_SIDE_CHANNEL_SECRET"  # transfer.side_channel's, read at parse time
_ADDRESSED = re.compile(r"this is '(?P<destination>[^']*)'")


def _device(text: str) -> str:
    if text != "cpu" and not text.startswith("cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:N], got {text!r}")
    return text


def _endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPV6]:PORT``."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def _start_side(
    device: str, mib: float, mode: str, seed: int | None, reach: Any = None, quiet: bool = True
) -> tuple[Any, Any, Any]:
    """This process's lane settings, NIXL agent and probe buffer (prefill's holds ``seed``).
    ``quiet``: stdout goes to stderr (NIXL logs there; ``--json`` keeps stdout clean)."""
    if quiet:
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    import torch

    from kvshare_connector.transfer.device import lanes
    from kvshare_connector.transfer.device.nixl import NixlTransport
    from kvshare_connector.transfer.device.probe import ProbeBuffer

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    buffer = ProbeBuffer(int(mib * 2**20), device, seed)
    region = buffer.region
    vmm = lanes.legacy_ipc_capable(region.addr) is False if region.mem_kind == "VRAM" else False
    plan = lanes.plan_lane({region.mem_kind}, vmm, mode=mode, reach=reach)
    lanes.apply(plan)
    role = "prefill" if seed is not None else "decode"
    transport = NixlTransport(f"kvshare-lane-{role}-{time.monotonic_ns()}")
    transport.register([region])
    return plan, transport, buffer


def _watch(probe: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    report = None
    while report is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the probe READ did not finish within {timeout_s:g} s")
        report = probe.advance()
    return report


# ---- both sides on this host ------------------------------------------------------------


def _prefill_main(conn: Connection, device: str, mib: float, mode: str) -> None:
    try:
        from kvshare_connector.transfer.device import lanes

        plan, transport, buffer = _start_side(device, mib, mode, seed=20261202)
        region = buffer.region
        conn.send(
            {
                "metadata": transport.metadata(),
                "probe": (region.addr, region.nbytes, region.device_id, buffer.seed),
                "settings": plan.describe(),
                "ucx": lanes.effective(),
            }
        )
        conn.poll(READY_S * 5)  # keep the memory registered until decode is done
    except Exception as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


def _decode_main(conn: Connection, device: str, mib: float, mode: str, timeout_s: float) -> None:
    try:
        from kvshare_connector.layout.topology import Region
        from kvshare_connector.transfer.device.probe import LaneProbe

        plan, transport, buffer = _start_side(device, mib, mode, seed=None)
        remote = conn.recv()
        agent = transport.add_peer(remote["metadata"])
        addr, nbytes, device_id, seed = remote["probe"]
        region = Region(addr, nbytes, device_id)
        probe = LaneProbe(transport, buffer, agent, region, seed, "prefill", "127.0.0.1:0",
                          True, region.mem_kind, remote["ucx"])  # fmt: skip
        report = _watch(probe, timeout_s)
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
        return _result(result["report"], ready["settings"], result["settings"],
                       prefill_device, decode_device)  # fmt: skip
    finally:
        to_prefill.send("stop")
        for process in (decode, prefill):
            process.join(10)
            if process.is_alive():
                process.kill()


def _result(
    report: dict[str, Any], prefill_settings: str, decode_settings: str, prefill: str, decode: str
) -> dict[str, Any]:
    return {
        **{k: v for k, v in report.items() if k not in ("ucx", "peer_ucx")},
        "prefill_settings": prefill_settings,
        "decode_settings": decode_settings,
        "prefill_ucx": report["peer_ucx"],
        "decode_ucx": report["ucx"],
        "prefill": prefill,
        "decode": decode,
    }


# ---- one side per host ------------------------------------------------------------------


def serve(
    host: str, port: int, device: str, mib: float, mode: str, secret: bytes | None,
    stop: threading.Event,
) -> None:  # fmt: skip
    """A lane peer at ``host:port``: the side channel answers a handshake naming a probe
    buffer on ``device``, until ``stop`` is set."""
    from kvshare_connector.layout.topology import KVTopology
    from kvshare_connector.transfer.device import lanes
    from kvshare_connector.transfer.prefill.source import KVSource
    from kvshare_connector.transfer.wire.settings import EngineSettings

    reach = lanes.side_channel_reach(host, ())
    plan, transport, buffer = _start_side(device, mib, mode, 20261207, reach, quiet=False)
    nothing = KVTopology((), {}, {}, (), 0, "lane probe only")
    engine_id = f"kvshare-lane-{os.uname().nodename}"
    settings = EngineSettings(engine_id, host=host, port=port, secret=secret)
    source = KVSource(nothing, transport, settings, probe=buffer,
                      lane=lanes.LaneInfo(lanes.effective()))  # fmt: skip
    try:
        print(f"kvshare lane: serving the lane probe ({buffer.nbytes / 2**20:g} MiB on "
              f"{device}) at {host}:{source.port} as {engine_id}; UCX: {plan.describe()}",
              flush=True)  # fmt: skip
        stop.wait()
    finally:
        source.close()


def _engine_id_of(host: str, port: int, secret: bytes | None, timeout_s: float) -> str:
    """The engine id the side channel at ``host:port`` answers to, from its refusal of a
    handshake addressed to no engine (only an address: the reply that counts is signed)."""
    from kvshare_connector.transfer.wire import protocol
    from kvshare_connector.transfer.wire.side_channel_client import ask
    from kvshare_connector.transfer.wire.side_channel_wire import SideChannelRefused

    hello = protocol.encode(protocol.Hello(protocol.PROTOCOL_VERSION, "kvshare-lane"))
    try:
        ask(host, port, hello, timeout_s, secret, "")
    except SideChannelRefused as exc:
        found = _ADDRESSED.search(str(exc))
        if exc.code == "misaddressed" and found:
            return found["destination"].rpartition("@")[0]
        raise
    return ""


def probe_remote(
    host: str, port: int, device: str, mib: float, mode: str, secret: bytes | None,
    timeout_s: float, engine_id: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """READ the probe of the prefill side channel at ``host:port`` (a lane peer or a prefill
    engine) from this host, as a decode engine here would."""
    from kvshare_connector.layout.topology import Region
    from kvshare_connector.transfer.decode.peers import HANDSHAKE_REPLY_BYTES
    from kvshare_connector.transfer.device import lanes
    from kvshare_connector.transfer.device.probe import LaneProbe
    from kvshare_connector.transfer.wire import protocol
    from kvshare_connector.transfer.wire.side_channel_client import ask

    reach = lanes.side_channel_reach(None, (host,))
    plan, transport, buffer = _start_side(device, mib, mode, None, reach)
    if engine_id is None:
        engine_id = _engine_id_of(host, port, secret, timeout_s)
    hello = protocol.Hello(protocol.PROTOCOL_VERSION, "kvshare-lane", engine_id)
    raw = ask(host, port, protocol.encode(hello), timeout_s, secret, engine_id,
              HANDSHAKE_REPLY_BYTES)  # fmt: skip
    reply = protocol.decode(raw)
    if not isinstance(reply, protocol.HandshakeReply):
        raise RuntimeError(f"prefill at {host}:{port} answered {reply!r:.300}")
    ref = reply.probe
    if ref is None or ref.nbytes == 0:
        raise RuntimeError(f"prefill at {host}:{port} has no lane probe (lane_probe_mib 0)")
    problem = lanes.segment_problem(ref.ucx, lanes.effective())
    if problem is not None:
        raise RuntimeError(problem)
    agent = transport.add_peer(reply.agent_metadata)
    region = Region(ref.addr, ref.nbytes, ref.device_id)
    probe = LaneProbe(transport, buffer, agent, region, ref.seed, reply.engine_id,
                      f"{host}:{port}", lanes.is_local_host(host), region.mem_kind,
                      ref.ucx)  # fmt: skip
    report = asdict(_watch(probe, timeout_s))
    return _result(report, lanes.describe_settings(ref.ucx), plan.describe(),
                   f"{host}:{port}", device)  # fmt: skip


# ---- the command ------------------------------------------------------------------------


def _default_device() -> str:
    try:
        import torch

        return "cuda:0" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def _secret(args: argparse.Namespace) -> bytes | None:
    """The side-channel secret: ``--secret-file``'s one line, else the environment's."""
    if args.secret_file is not None:
        try:
            text = Path(args.secret_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise checks.UsageError(f"--secret-file {args.secret_file!r}: {exc}") from None
        if not text or "\n" in text:
            raise checks.UsageError(f"--secret-file {args.secret_file!r}: not one line")
        return text.encode()
    value = os.environ.get(SECRET_ENV)
    return value.encode() if value else None


def check(args: argparse.Namespace) -> None:
    """A GPU for the cuda sides, NIXL and torch importable, the secret readable, before
    anything starts."""
    checks.require_module(["torch"], "the lane probe allocates its buffers with torch")
    checks.require_module(["nixl_cu13", "nixl"], "pip install nixl-cu13==1.5.1")
    devices = (args.prefill_device, args.decode_device, args.device)
    cuda = [d for d in devices if d and d.startswith("cuda")]
    if cuda:
        ids = [d.partition(":")[2] or "0" for d in cuda]
        checks.check_gpus(ids, "--device/--prefill-device/--decode-device name a GPU (or cpu)")
    if args.serve and args.prefill:
        raise checks.UsageError("--serve (the prefill host) and --prefill (the decode host) "
                                "are the two ends: give one")  # fmt: skip
    _secret(args)


def _serve(args: argparse.Namespace) -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    host, port = args.serve
    try:
        serve(host, port, args.device or _default_device(), args.mib, args.ucx_lane,
              _secret(args), stop)  # fmt: skip
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"kvshare lane: cannot serve at {host}:{port}: {exc}", file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    if args.serve:
        return _serve(args)
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")  # NIXL logs on stdout: ours stays ours
    try:
        if args.prefill:
            host, port = args.prefill
            result = probe_remote(host, port, args.device or _default_device(), args.mib,
                                  args.ucx_lane, _secret(args), args.timeout,
                                  args.engine_id)  # fmt: skip
        else:
            prefill = args.prefill_device or _default_device()
            decode = args.decode_device or prefill
            result = measure(prefill, decode, args.mib, args.ucx_lane, args.timeout)
    except (RuntimeError, TimeoutError, OSError) as exc:  # a side failed: say which
        print(f"kvshare lane: the probe failed: {checks.one_line(exc)}", file=sys.stderr)
        return 1
    with out:
        print(json.dumps(result) if args.json else describe(result), file=out)
    return 1 if result["slow"] else 0


def describe(result: dict[str, Any]) -> str:
    """The report as text: the two ends, every UCX setting of each, the lane, the fix."""
    lines = [
        f"kvshare lane: prefill {result['prefill']} -> decode {result['decode']}",
        f"  UCX, prefill: {result['prefill_settings']}",
        f"  UCX, decode:  {result['decode_settings']}",
        f"  lane: {result['lane']} ({result['where']}), {result['gbps']:.2f} GB/s (READ of "
        f"{result['nbytes'] / 2**20:.0f} MiB in {result['seconds'] * 1e6:.0f} us, bytes "
        "verified)",
    ]
    if result["slow"]:
        lines.append(f"  SLOW: {result['fix']}")
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lane",
        help="measure the UCX lane a decode READ takes (this host, or between two hosts)",
        description=__doc__.split("\n\n")[0],
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--serve",
        type=_endpoint,
        metavar="HOST:PORT",
        help="on the prefill host: serve a lane probe here (port 0: any)",
    )
    where.add_argument(
        "--prefill",
        type=_endpoint,
        metavar="HOST:PORT",
        help="on the decode host: READ from the prefill side channel there",
    )
    p.add_argument(
        "--secret-file",
        default=None,
        help=f"the side-channel secret (one line); default: ${SECRET_ENV}",
    )
    p.add_argument("--engine-id", default=None, help="with --prefill: the engine to address")
    p.add_argument(
        "--device",
        type=_device,
        default=None,
        help="with --serve/--prefill: this side's memory (default cuda:0 or cpu)",
    )
    p.add_argument("--prefill-device", type=_device, default=None, help="default cuda:0 or cpu")
    p.add_argument("--decode-device", type=_device, default=None, help="default: prefill's")
    p.add_argument(
        "--mib",
        type=checks.number(float, 0, 4096, above=True),
        default=float(DEFAULT_PROBE_MIB),
        help="probe READ size (default %(default)s)",
    )
    p.add_argument("--ucx-lane", choices=["auto", "off"], default="auto")
    p.add_argument(
        "--timeout", type=checks.positive_float, default=60.0, help="seconds for the probe READs"
    )
    p.add_argument("--json", action="store_true", help="one JSON line instead of text")
    p.set_defaults(func=run, check=check)  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="kvshare")
    add_parser(parser.add_subparsers(dest="command", required=True))
    parsed = parser.parse_args(["lane", *sys.argv[1:]])
    parsed.check(parsed)
    sys.exit(parsed.func(parsed))
