"""A prefill engine of the NIXL backend as the connector builds it, in a process of its own:
one ``NixlWorker`` per TP rank (side channel on 127.0.0.1, rank r on the base port + r),
each holding one request filled with the pattern of its global heads
(``lab.tools.headcheck``). What UCX opens here is this process's alone, so a test can read
its sockets from /proc (``tests/test_ucx_reach.py``). Reports on stdout::

    READY {"pid", "before": ["address:port" bound before the connector started],
           "lines": [each rank's start line], "kv_transfer_params"}

then serves until its parent is gone or it is killed.

    python -m tests.support.lane_peer --tp 2 --heads 4 --ucx-lane auto
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import time
import uuid
from pathlib import Path

TOKENS = 200
_LISTEN, _UDP_BOUND = "0A", "07"
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def bound_sockets(pid: int) -> list[tuple[Address, int]]:
    """(address, port) of each TCP socket of process ``pid`` that listens and each UDP
    socket it bound: the process's fds name the socket inodes, /proc/PID/net the tables."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table, state in (("tcp", _LISTEN), ("tcp6", _LISTEN), ("udp", _UDP_BOUND),
                         ("udp6", _UDP_BOUND)):  # fmt: skip
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] != state or fields[9] not in inodes:
                continue
            addr_hex, port_hex = fields[1].split(":")
            raw = bytes.fromhex(addr_hex)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((ipaddress.ip_address(raw), int(port_hex, 16)))
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ucx-lane", choices=["auto", "off"], default="auto")
    args = p.parse_args(argv)

    from kvshare_connector.backends.base import WorkerContext
    from kvshare_connector.backends.nixl import NixlWorker
    from kvshare_connector.backends.options import ConnectorOptions
    from kvshare_connector.common.child_process import report
    from kvshare_connector.demo.cpu_stack import build_cpu_stack, topology_of
    from kvshare_connector.demo.parts import requests_block_ids
    from kvshare_connector.toolkit.procs import free_port_run
    from kvshare_connector.transfer.decode.shards import rank_shard
    from kvshare_connector.transfer.wire.kv_params import kv_transfer_params
    from lab.tools.headcheck import fill_heads

    model = "gemma4_e2b_kv4" if args.heads == 4 else "gemma4_e2b_shape"
    options = ConnectorOptions.parse(
        {"kv_lease_duration": 120, "staging_mib": 16, "ucx_lane": args.ucx_lane}, environ={}
    )
    engine_id = f"lane-peer-{uuid.uuid4().hex[:8]}"
    base = free_port_run(args.tp)
    heads = max(args.heads // args.tp, 1)
    stacks = [
        build_cpu_stack(
            model, "per_layer", kv_bytes=(32 << 20) * heads, max_model_len=1024, kv_heads=heads
        )
        for _ in range(args.tp)
    ]
    # What the process holds before the connector starts (torch.distributed's rendezvous
    # store of the CPU stack listens on every interface, as it does in a vLLM engine).
    before = [f"{a}:{p}" for a, p in bound_sockets(os.getpid())]
    workers, lines, ids = [], [], None
    for rank, stack in enumerate(stacks):
        topology = topology_of(stack)
        context = WorkerContext(
            engine_id=engine_id, role="kv_producer", host="127.0.0.1", port=base + rank,
            model_name="m", options=options, tp_size=args.tp, tp_rank=rank,
            model_kv_heads=args.heads,
        )  # fmt: skip
        worker = NixlWorker(context)
        lines.append(worker.start(topology, stack.kv_caches))
        ids = ids or requests_block_ids(topology, TOKENS, 1, 3)[0]
        shard = rank_shard(topology, args.tp, rank, args.heads)
        fill_heads(stack.kv_caches, topology, shard, ids, seed=1)
        worker.hold({"req": ids})
        workers.append(worker)
    params = kv_transfer_params(
        remote_block_ids=ids, remote_engine_id=engine_id, remote_request_id="req",
        remote_host="127.0.0.1", remote_port=base, remote_num_tokens=TOKENS, tp_size=args.tp,
    )  # fmt: skip
    report(
        "READY ",
        {"pid": os.getpid(), "before": before, "lines": lines, "kv_transfer_params": params},
    )
    parent = os.getppid()
    while os.getppid() == parent:
        for worker in workers:
            worker.poll()
        time.sleep(0.002)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
