#!/usr/bin/env python3
"""A packed READ between two hosts against plain TCP between the same addresses.

Two "hosts" on this machine (``scripts/two_hosts.sh``: own network, UTS, IPC and PID
namespaces, a veth pair; root only, skipped otherwise): a prefill process on one serves one
E2B-shaped request of ``--tokens`` tokens (vLLM's KV memory on the CPU, ``KVSource`` with
its side channel on the prefill address and a secret), a decode process on the other
READs it through ``KVSink`` (packed: one READ of the staging slot, then the scatter), as
the connector does, with the connector's UCX plan for side channels beyond loopback
(``--ucx-lane``). In the same rounds, side by side, decode receives as many bytes from a
plain TCP socket of the prefill process, between the same two addresses. Rounds alternate
which goes first; the first ``--warmup`` are not counted. Reported: the READ (its post ->
NIXL says done), the load (post -> bytes in the blocks), plain TCP, each round's ratio
READ / TCP (median and range), what carried the bytes (the lane probe's name, and the
decode host's link counter: the bytes crossed the veth), and the READ's transports as UCX
printed them (``UCX_PROTO_INFO=y``). Every round's load is checked byte for byte.

    .venv/bin/python -m lab.benchmarks.bench_lane_hosts [--id 50] [--tokens 16384] [--rounds 9]
        [--warmup 2] [--ucx-lane auto|off] [--packed-mib 256] [--poll-ms 1]
        [--env UCX_X=Y ...] [--same-machine] [--json out.json]

``--poll-ms``: how often decode looks at its reads (an engine looks once per step and per
layer while reads are in flight; 0: in a spin). ``--same-machine``: the two network
namespaces only (shared UTS/IPC/PID: UCX's same-machine shortcut allowed), the control.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvshare_connector.common.child_process import parse_report
from kvshare_connector.common.child_process import report as report_line
from lab.benchmarks.bench_transfer import build, disjoint_requests, fill, request_bytes, verify

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "two_hosts.sh"
READY = "LANE_PREFILL_READY "
RESULT = "LANE_DECODE_RESULT "
STARTED = "LANE_DECODE_STARTED "
SECRET_ENV = "KVSHARE_SIDE_CHANNEL_SECRET"
HEADER = (
    "| UCX settings (decode) | READ | READ GB/s (min-max) | load GB/s | plain TCP GB/s (min-max) "
    "| READ / TCP per round (min-max) | probe | UCX's READ transport | rounds |"
)
_READ_TABLE = re.compile(r"(self|intra-node|inter-node) cfg#\d+")
_TRANSPORT = re.compile(r"\|\s*[0-9.]+(?:inf)?\s*\|[^|]*\|\s*([a-z_]+/[\w.:-]+)")


def _plan(host: str, connects: tuple[str, ...], mode: str) -> str:
    """The connector's UCX plan for this side, applied before NIXL starts."""
    from kvshare_connector.transfer.device import lanes

    serves = host if not connects else None
    plan = lanes.plan_lane(
        {"DRAM"}, False, mode=mode, reach=lanes.side_channel_reach(serves, connects)
    )
    lanes.apply(plan)
    return plan.describe()


# ---- prefill host ------------------------------------------------------------------------


def _tcp_sender(listener: socket.socket, data: memoryview) -> None:
    """Plain TCP: each connection asks for N bytes (8-byte length) and gets them."""
    while True:
        conn, _ = listener.accept()
        with conn:
            want = int.from_bytes(conn.recv(8), "little")
            sent = 0
            while sent < want:
                sent += conn.send(
                    data[sent % len(data) : min(len(data), sent % len(data) + want - sent)]
                )
            conn.recv(1)


def run_prefill(args: argparse.Namespace) -> int:
    import numpy as np

    from kvshare_connector.demo.parts import cpu_packer, held_params
    from kvshare_connector.transfer.device import lanes
    from kvshare_connector.transfer.device.nixl import NixlTransport
    from kvshare_connector.transfer.device.probe import ProbeBuffer
    from kvshare_connector.transfer.prefill.source import KVSource
    from kvshare_connector.transfer.wire.settings import EngineSettings

    described = _plan(args.host, (), args.ucx_lane)
    stack, topology = build(args.kv_mib)
    (ids,) = disjoint_requests(topology, args.tokens, 1, seed=1)
    fill(topology, ids, salt=0)
    secret = os.environ[SECRET_ENV].encode()
    engine_id = "bench-prefill"
    source = KVSource(
        topology, NixlTransport(f"{engine_id}-{os.getpid()}"),
        EngineSettings(engine_id, host=args.host, lease_s=3600, secret=secret),
        packer=cpu_packer(stack, args.packed_mib), probe=ProbeBuffer(8 << 20, "cpu", 20261207),
        lane=lanes.LaneInfo(lanes.effective()),
    )  # fmt: skip
    nbytes = request_bytes(topology, args.tokens)
    data = np.full(nbytes, 7, dtype=np.uint8)
    listener = socket.create_server((args.host, 0))
    threading.Thread(target=_tcp_sender, args=(listener, memoryview(data)), daemon=True).start()
    rounds = [held_params(source, f"r{i}", ids, args.tokens) for i in range(args.rounds)]
    report_line(READY, {"rounds": rounds, "tcp_port": listener.getsockname()[1],
                        "plan": described, "ucx": lanes.effective()})  # fmt: skip
    source.hold("r0", block_ids=ids)
    closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), closed.set()), daemon=True).start()
    released = 0
    while not closed.is_set():  # a round is held once the one before it was read
        read, expired = source.poll()
        released += len(read) + len(expired)
        if read and released < args.rounds:
            source.hold(f"r{released}", block_ids=ids)
        time.sleep(0.001)
    source.close()
    os._exit(0)  # skip the interpreter teardown of vLLM and torch


# ---- decode host -------------------------------------------------------------------------


def _tcp_round(host: str, port: int, buffer: Any) -> float:
    view, want = memoryview(buffer), len(buffer)
    with socket.create_connection((host, port)) as conn:
        start = time.perf_counter()
        conn.sendall(want.to_bytes(8, "little"))
        got = 0
        while got < want:
            got += conn.recv_into(view[got:], want - got)
        seconds = time.perf_counter() - start
        conn.send(b"k")
    return seconds


def _nixl_round(sink: Any, params: dict, ids: list, tag: str, poll_s: float) -> Any:
    from kvshare_connector.transfer.wire.kv_params import remote_prefill_params

    sink.request(tag, remote_prefill_params(params), ids)
    deadline = time.monotonic() + 300
    while True:
        done, failed = sink.poll(0.0 if poll_s else 0.002)
        if failed:
            raise SystemExit(f"read failed: {failed}")
        if tag in done:
            (record,) = [r for r in sink.records if r.request_id == tag]
            return record
        if time.monotonic() > deadline:
            raise SystemExit(f"read {tag} did not finish in 300 s")
        if poll_s:
            time.sleep(poll_s)


def _link_rx(veth: str) -> int:
    try:
        return int(Path(f"/sys/class/net/{veth}/statistics/rx_bytes").read_text())
    except OSError:
        return -1


def run_decode(args: argparse.Namespace) -> int:
    import ctypes

    import numpy as np

    from kvshare_connector.demo.parts import cpu_packer
    from kvshare_connector.transfer.decode.sink import KVSink
    from kvshare_connector.transfer.device import lanes
    from kvshare_connector.transfer.device.nixl import NixlTransport
    from kvshare_connector.transfer.device.probe import ProbeBuffer
    from kvshare_connector.transfer.wire.settings import EngineSettings

    report_line(STARTED, {})  # fd 1 is stderr from here: UCX prints its tables there
    described = _plan(args.host, (args.prefill_host,), args.ucx_lane)
    stack, topology = build(args.kv_mib)
    (local,) = disjoint_requests(topology, args.tokens, 1, seed=2)
    ready = json.loads(sys.stdin.readline())
    allowed = frozenset({f"{args.prefill_host}:{ready['rounds'][0]['remote_port']}"})
    settings = EngineSettings(
        "bench-decode",
        handshake_timeout_s=60,
        transfer_timeout_s=120,
        secret=os.environ[SECRET_ENV].encode(),
        allowed_prefills=allowed,
    )
    transport = NixlTransport(f"bench-decode-{os.getpid()}")
    packer = cpu_packer(stack, args.packed_mib)
    sink = KVSink(topology, transport, settings, packer=packer, probe=ProbeBuffer(8 << 20, "cpu"))
    buffer = np.empty(request_bytes(topology, args.tokens), dtype=np.uint8)
    veth = f"kvs{args.id}d"
    rows, rx0, bad = [], _link_rx(veth), 0
    for index, params in enumerate(ready["rounds"]):
        for region in topology.regions:
            ctypes.memset(region.addr, 0, region.nbytes)
        order = ("nixl", "tcp") if index % 2 == 0 else ("tcp", "nixl")
        row: dict[str, Any] = {"first": order[0]}
        for what in order:
            if what == "tcp":
                row["tcp_s"] = _tcp_round(args.prefill_host, ready["tcp_port"], buffer)
            else:
                record = _nixl_round(sink, params, local, f"r{index}", args.poll_ms / 1e3)
                t = record.timeline
                row.update(read_s=t["arrived"] - t["prepared"], load_s=record.seconds,
                           bytes=record.bytes, packed=record.packed)  # fmt: skip
        bad += verify(topology, local, salt=0)
        rows.append(row)
    lane = sink.take_lanes()
    report_line(RESULT, {
        "rows": rows, "bad_segments": bad, "link_rx_bytes": _link_rx(veth) - rx0,
        "plan": described, "ucx": lanes.effective(), "lane": [vars(r) for r in lane],
    })  # fmt: skip
    sink.close()
    os._exit(0)


# ---- the driver --------------------------------------------------------------------------


class Skip(RuntimeError):
    """No two hosts here (not root, no namespaces): the benchmark says why and skips."""


def _script(*words: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *words], capture_output=True, text=True,
                          check=check, timeout=120)  # fmt: skip


def _on_host(args: argparse.Namespace, role: str, argv: list[str]) -> list[str]:
    if args.same_machine:  # the network namespace alone (and its /sys): UCX sees one machine
        return ["ip", "netns", "exec", f"kvshare-{args.id}-{role}", *argv]
    return ["bash", str(SCRIPT), "run", str(args.id), role, *argv]


def _child(args: argparse.Namespace, role: str, host: str, extra: list[str], env: dict,
           stderr: Any) -> subprocess.Popen:  # fmt: skip
    argv = [sys.executable, "-m", "lab.benchmarks.bench_lane_hosts", "--role", role, "--id",
            str(args.id), "--host", host, "--tokens", str(args.tokens), "--kv-mib",
            str(args.kv_mib), "--packed-mib", str(args.packed_mib), "--ucx-lane", args.ucx_lane,
            "--poll-ms", str(args.poll_ms), "--rounds", str(args.rounds), *extra]  # fmt: skip
    pipe = subprocess.PIPE
    command = _on_host(args, role, argv)
    return subprocess.Popen(
        command, stdin=pipe, stdout=pipe, stderr=stderr, text=True, env=env, cwd=ROOT
    )


def _report(process: subprocess.Popen, prefix: str, timeout_s: float) -> dict:
    found: dict[str, Any] = {}

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith(prefix):
                found.update(parse_report(line, prefix))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not found:
        raise SystemExit(f"{prefix.strip()} not seen in {timeout_s:g} s (exit {process.poll()})")
    return found


def ucx_read_transports(log: str) -> list[str]:
    """``scope: transports`` of each READ table UCX printed for a peer (not itself)."""
    found, scope = [], None
    lines = log.splitlines()
    for i, line in enumerate(lines):
        config = _READ_TABLE.search(line)
        if config:
            scope = config.group(1)
        if "remote memory read by ucp_get" in line and scope not in (None, "self"):
            transports = {m for ln in lines[i + 1 : i + 8] for m in _TRANSPORT.findall(ln)}
            found.append(f"{scope}: {', '.join(sorted(transports))}")
    return sorted(set(found))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Bring the two hosts up, run both sides, take them down: the results."""
    from kvshare_connector.demo.parts import blocks_per_group

    _, probe = build(64)
    need = sum(blocks_per_group(probe, args.tokens)) + 64
    per_block = sum(r.nbytes for r in probe.regions) // probe.num_blocks
    args.kv_mib = args.kv_mib or -(-need * per_block // (1 << 20))
    _script("down", str(args.id), check=False)
    up = _script("up", str(args.id), check=False)
    if up.returncode != 0:
        raise Skip(f"two hosts: {up.stderr.strip()}")
    prefill_host, decode_host = f"10.77.{args.id}.1", f"10.77.{args.id}.2"
    env = {**os.environ, SECRET_ENV: secrets.token_hex(32), "PYTHONUNBUFFERED": "1",
           **dict(kv.split("=", 1) for kv in args.env)}  # fmt: skip
    with tempfile.TemporaryFile("w+") as prefill_log, tempfile.TemporaryFile("w+") as decode_log:
        logs = [prefill_log, decode_log]
        decode_env = {**env, "UCX_PROTO_INFO": "y"}
        prefill = _child(args, "prefill", prefill_host, [], env, logs[0])
        decode = _child(args, "decode", decode_host, ["--prefill-host", prefill_host],
                        decode_env, logs[1])  # fmt: skip
        try:
            ready = _report(prefill, READY, 600)
            assert decode.stdin is not None
            decode.stdin.write(json.dumps(ready) + "\n")
            decode.stdin.flush()
            result = _report(decode, RESULT, 600 + 30 * args.rounds)
        finally:
            for process in (decode, prefill):
                if process.stdin:
                    process.stdin.close()
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            _script("down", str(args.id), check=False)
        logs[1].seek(0)
        transports = ucx_read_transports(logs[1].read())
    return summarize(args, ready, result, transports)


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(args: argparse.Namespace, ready: dict, result: dict, transports: list[str]) -> dict:
    rows = result["rows"][args.warmup :]
    nbytes = rows[0]["bytes"]
    gbps = {k: [nbytes / r[f"{k}_s"] / 1e9 for r in rows] for k in ("read", "load", "tcp")}
    ratios = [r["tcp_s"] / r["read_s"] for r in rows]
    return {
        "tokens": args.tokens, "bytes": nbytes, "packed": rows[0]["packed"], "rounds": len(rows),
        "warmup": args.warmup, "poll_ms": args.poll_ms, "same_machine": args.same_machine,
        "env": args.env, "ucx_lane": args.ucx_lane,
        "gbps": {k: _stats(v) for k, v in gbps.items()},
        "read_vs_tcp": _stats(ratios),
        "load_vs_tcp": _stats([r["tcp_s"] / r["load_s"] for r in rows]),
        "verified": result["bad_segments"] == 0, "bad_segments": result["bad_segments"],
        "link_rx_bytes": result["link_rx_bytes"],
        "read_bytes_all_rounds": nbytes * len(result["rows"]),
        # what the link carried beyond the plain TCP rounds' bytes: the READs', if they crossed
        "link_rx_beyond_tcp": result["link_rx_bytes"] - nbytes * len(result["rows"]),
        "lane": result["lane"], "ucx_read_transports": transports,
        "prefill_ucx": ready["ucx"], "decode_ucx": result["ucx"],
        "rows": result["rows"], "loadavg": os.getloadavg(),
    }  # fmt: skip


def markdown(results: dict) -> str:
    g, r = results["gbps"], results["read_vs_tcp"]
    lane = results["lane"][0] if results["lane"] else {}
    shown = {k: v for k, v in results["decode_ucx"].items() if k != "UCX_PROTO_INFO"}
    ucx = ", ".join(f"{k}={v}" for k, v in shown.items()) or "UCX defaults"
    return (
        f"| {ucx} | {'packed' if results['packed'] else 'blocks'} | "
        f"{g['read']['median']:.2f} ({g['read']['min']:.2f}-{g['read']['max']:.2f}) | "
        f"{g['load']['median']:.2f} | {g['tcp']['median']:.2f} "
        f"({g['tcp']['min']:.2f}-{g['tcp']['max']:.2f}) | **{r['median']:.2f}x** "
        f"({r['min']:.2f}-{r['max']:.2f}) | {lane.get('lane', '-')} "
        f"{lane.get('gbps', 0):.2f} GB/s{' SLOW' if lane.get('slow') else ''} | "
        f"{'; '.join(results['ucx_read_transports'])} | {results['rounds']} |"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--role", choices=["main", "prefill", "decode"], default="main",
                   help=argparse.SUPPRESS)  # fmt: skip
    p.add_argument("--host", help=argparse.SUPPRESS)
    p.add_argument("--prefill-host", help=argparse.SUPPRESS)
    p.add_argument("--id", type=int, default=50, help="the namespaces' ID (two_hosts.sh)")
    p.add_argument("--tokens", type=int, default=16_384, help="tokens of the request (107 MB)")
    p.add_argument("--rounds", type=int, default=11, help="rounds, warm-up included")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--kv-mib", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--packed-mib", type=int, default=256, help="staging per side; 0: blocks")
    p.add_argument("--ucx-lane", choices=["auto", "off"], default="auto")
    p.add_argument("--poll-ms", type=float, default=1.0, help="decode looks this often (0: spin)")
    p.add_argument("--env", action="append", default=[], help="UCX_X=Y for both sides")
    p.add_argument("--same-machine", action="store_true", help="network namespaces only")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    if args.role == "prefill":
        return run_prefill(args)
    if args.role == "decode":
        return run_decode(args)
    if os.geteuid() != 0:
        print("SKIP: two hosts need root (network namespaces)")
        return 0
    if args.warmup >= args.rounds:
        p.error("--rounds must exceed --warmup")
    out = os.fdopen(os.dup(1), "w")  # the tables; vLLM's and NIXL's logs go to stderr
    os.dup2(2, 1)
    try:
        results = measure(args)
    except Skip as exc:
        print(f"SKIP: {exc}", file=out)
        return 0
    print(f"{HEADER}\n|{'---|' * 9}\n{markdown(results)}", file=out)
    print(
        f"bytes verified: {results['verified']}; decode's link received "
        f"{results['link_rx_beyond_tcp'] / 1e6:.0f} MB beyond plain TCP's (the READs: "
        f"{results['read_bytes_all_rounds'] / 1e6:.0f} MB); load average "
        f"{results['loadavg'][0]:.1f}",
        file=out,
        flush=True,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if results["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
