"""``kvshare demo --role prefill|decode``: the demo's verified transfer between two hosts.

On the prefill host, ``kvshare demo --role prefill --listen HOST:PORT --secret-file F``
builds the demo's KV, holds two requests (one to check, one for the negative controls) and
serves them: its KV side channel on ``HOST:PORT`` (HMAC-signed with the secret in F; HOST is
the address decode dials, as ``kv_transfer_params`` name it) and, on ``PORT + 1``, the
requests' ``kv_transfer_params`` as a proxy hands them to decode (unsigned, as a proxy's
HTTP is: they name blocks, and nothing is read without the secret). It ends once decode
has read both, or their lease is over.

On the decode host, ``kvshare demo --role decode --prefill HOST:PORT --secret-file F``
takes the params, handshakes (a wrong secret is refused here, with the reason), READs the
request over NIXL/UCX and checks every layer; the controls: a handshake signed with another
secret, the block list reordered (prefill refuses it), the blocks read into the wrong places
(the check catches them). Both sides print ``RESULT: PASS`` or ``FAIL``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from kvshare_connector.demo import kvcheck
from kvshare_connector.demo.parts import (
    MAX_MODEL_LEN,
    PROBE_MIB,
    build,
    cpu_packer,
    held_params,
    read_and_check,
    report_table,
    request_block_ids,
    requests_block_ids,
    zero_kv,
)
from kvshare_connector.toolkit import checks
from kvshare_connector.toolkit.checks import UsageError

HANDOFF_ENGINE = "kvshare-demo-handoff"  # the hand-off server's name in addresses
HANDOFF_ASK = b"kv_transfer_params"
REQUESTS = ("req-0", "req-1")  # read and checked; the negative controls
PREFILL_LEASE_S = 600.0  # the prefill role's default: time to start decode on the other host
_ADDRESS = re.compile(
    r"\[(?P<v6>[^\]]+)\]:(?P<p6>[0-9]{1,5})|(?P<host>[^:\[\]]+):(?P<port>[0-9]{1,5})"
)


def host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``): an address another host can dial, and a port one
    below another (the hand-off is served on the next one)."""
    from kvshare_connector.transfer.wire.kv_params import host_problem

    match = _ADDRESS.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    host = match["v6"] or match["host"]
    port = int(match["p6"] or match["port"])
    if not 1 <= port <= 65534:
        raise argparse.ArgumentTypeError(
            f"{text!r}: port {port} not in 1-65534 (PORT+1 serves the params)"
        )
    why = host_problem(host)
    if why is not None:
        raise argparse.ArgumentTypeError(f"{text!r}: host {host!r} is {why}")
    return host, port


def address_text(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def read_secret(path: Path) -> bytes:
    """The shared secret in ``path`` (surrounding whitespace dropped)."""
    try:
        secret = path.read_text().strip()
    except OSError as exc:
        raise UsageError(f"--secret-file {path}: {exc.strerror or exc}") from None
    if not secret:
        raise UsageError(f"--secret-file {path} is empty")
    return secret.encode()


def check_roles(args: argparse.Namespace) -> None:
    """What each role needs given, before anything starts."""
    needed = {"prefill": "--listen", "decode": "--prefill"}.get(args.role)
    if needed is None:
        for option in ("listen", "prefill", "secret_file"):
            if getattr(args, option) is not None:
                raise UsageError(f"--{option.replace('_', '-')} needs --role prefill or decode")
        return
    other = {"prefill": "--prefill", "decode": "--listen"}[args.role]
    if getattr(args, other[2:]) is not None:
        raise UsageError(f"{other} is not an option of --role {args.role} (it takes {needed})")
    if getattr(args, needed[2:]) is None or args.secret_file is None:
        raise UsageError(f"--role {args.role} needs {needed} HOST:PORT and --secret-file FILE")
    args.secret = read_secret(args.secret_file)
    if args.role == "prefill":  # both ports free on an address of this host
        host, port = args.listen
        checks.check_ports(host, [("--listen", port), ("--listen's PORT+1", port + 1)])


# ---- prefill host -------------------------------------------------------------------------


def run_prefill_host(args: argparse.Namespace) -> int:
    """Hold the requests, serve them and their params, wait for decode (or the lease)."""
    from kvshare_connector.transfer.device.nixl import NixlTransport
    from kvshare_connector.transfer.device.probe import ProbeBuffer
    from kvshare_connector.transfer.prefill.source import KVSource
    from kvshare_connector.transfer.wire.settings import EngineSettings
    from kvshare_connector.transfer.wire.side_channel import SideChannelServer

    check_roles(args)
    host, port = args.listen
    lease_s = args.lease_s or PREFILL_LEASE_S
    stack, topology = build(args.model, args.prefill_layout, 128, MAX_MODEL_LEN)
    blocks = requests_block_ids(topology, args.tokens, len(REQUESTS), seed=1)
    for index, ids in enumerate(blocks):
        kvcheck.fill(stack.kv_caches, topology, ids, seed=1 + index)
    engine_id = f"prefill-{uuid.uuid4().hex[:8]}"
    settings = EngineSettings(engine_id, host=host, port=port, lease_s=lease_s, secret=args.secret)
    source = KVSource(
        topology, NixlTransport(engine_id), settings, packer=cpu_packer(stack, args.packed_mib),
        probe=ProbeBuffer(PROBE_MIB << 20, "cpu", seed=1),
    )  # fmt: skip
    offer = {
        "model": args.model,
        "layout": topology.layout,
        "owners": len(topology.owners),
        "sharers": len(topology.sharers),
        "registered_bytes": source.transport.registered_bytes,
        "requests": [],
    }
    for index, (request_id, ids) in enumerate(zip(REQUESTS, blocks, strict=True)):
        source.hold(request_id, block_ids=ids)
        params = held_params(source, request_id, ids, args.tokens)
        offer["requests"].append({"kv_transfer_params": params, "seed": 1 + index})
    answer = json.dumps(offer).encode()
    handoff = SideChannelServer(
        host, port + 1, lambda ask: answer if ask == HANDOFF_ASK else b"{}",
        engine_id=HANDOFF_ENGINE,
    )  # fmt: skip
    print(
        f"kvshare demo, prefill: {args.model} ({topology.layout}), {len(REQUESTS)} requests of "
        f"{args.tokens} tokens held for {lease_s:g} s; KV side channel {host}:{port} (signed), "
        f"their kv_transfer_params on port {port + 1}. On the decode host run:\n"
        f"  kvshare demo --role decode --prefill {address_text(host, port)} --secret-file FILE",
        flush=True,
    )
    read: set[str] = set()
    expired: set[str] = set()
    deadline = time.monotonic() + lease_s + 30
    try:
        while time.monotonic() < deadline and (read | expired) != set(REQUESTS):
            r, e = source.poll()
            read |= r
            expired |= e
            time.sleep(0.005)
        held, refused = sorted(source.held), source.take_refused()
    finally:
        handoff.close()
        source.close()
    ok = read == set(REQUESTS) and not held
    rows = [
        ("requests read by decode", ", ".join(sorted(read)) or "none"),
        ("leases expired (decode never read them)", ", ".join(sorted(expired)) or "none"),
        ("requests still held", str(len(held))),
        ("side-channel messages refused", ", ".join(f"{k} {v}" for k, v in refused.items())),
    ]
    _print_rows(rows)
    print("RESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


# ---- decode host --------------------------------------------------------------------------


def fetch_offer(host: str, port: int, wait_s: float) -> dict[str, Any]:
    """The params prefill's hand-off serves on ``port + 1``, waiting up to ``wait_s`` for a
    prefill that is still starting."""
    from kvshare_connector.transfer.wire.side_channel_client import ask
    from kvshare_connector.transfer.wire.side_channel_wire import SideChannelError

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return json.loads(ask(host, port + 1, HANDOFF_ASK, 10.0, engine_id=HANDOFF_ENGINE))
        except SideChannelError as exc:
            if time.monotonic() > deadline:
                raise SideChannelError(
                    f"no prefill demo at {host}:{port} after {wait_s:g} s ({exc}): start "
                    "`kvshare demo --role prefill --listen HOST:PORT` there first"
                ) from None
            time.sleep(0.5)


def handshake(host: str, port: int, engine_id: str, secret: bytes) -> str | None:
    """Why prefill's side channel refuses a handshake signed with ``secret``, or None."""
    from kvshare_connector.transfer.wire import protocol
    from kvshare_connector.transfer.wire.side_channel_client import ask
    from kvshare_connector.transfer.wire.side_channel_wire import SideChannelError

    hello = protocol.Hello(protocol.PROTOCOL_VERSION, "kvshare-demo-decode", engine_id)
    try:
        reply = ask(host, port, protocol.encode(hello), 10.0, secret, engine_id)
    except SideChannelError as exc:
        return str(exc)
    answer = protocol.decode(reply)
    return None if isinstance(answer, protocol.HandshakeReply) else f"answered {answer!r}"


def run_decode_host(args: argparse.Namespace) -> int:
    from kvshare_connector.transfer.decode.sink import KVSink
    from kvshare_connector.transfer.device.nixl import NixlTransport
    from kvshare_connector.transfer.device.probe import ProbeBuffer
    from kvshare_connector.transfer.wire.settings import EngineSettings
    from kvshare_connector.transfer.wire.side_channel_wire import SideChannelError

    check_roles(args)
    host, port = args.prefill
    try:
        offer = fetch_offer(host, port, args.wait_s)
    except SideChannelError as exc:
        return _fail(str(exc))
    (main, control) = offer["requests"]
    engine_id = main["kv_transfer_params"]["remote_engine_id"]
    refusal = handshake(host, port, engine_id, args.secret)
    if refusal is not None:
        return _fail(
            f"prefill's side channel at {host}:{port} refused this decode: {refusal}. Both "
            f"hosts need the same secret (--secret-file {args.secret_file})."
        )
    wrong_refused = handshake(host, port, engine_id, os.urandom(32)) or ""
    print(
        f"kvshare demo, decode: {offer['model']}, prefill {offer['layout']} at {host}:{port} -> "
        f"decode {args.decode_layout}, NIXL/UCX across hosts"
    )
    stack, topology = build(offer["model"], args.decode_layout, 64, MAX_MODEL_LEN)
    name = f"decode-{uuid.uuid4().hex[:8]}"
    allowed = frozenset({address_text(host, port)})
    sink = KVSink(
        topology,
        NixlTransport(name),
        EngineSettings(name, secret=args.secret, allowed_prefills=allowed),
        packer=cpu_packer(stack, args.packed_mib),
        probe=ProbeBuffer(PROBE_MIB << 20, "cpu"),
    )
    tokens = main["kv_transfer_params"]["remote_num_tokens"]
    local_ids = request_block_ids(topology, tokens, seed=2)
    try:
        result = read_and_check(
            sink, stack, topology, main["kv_transfer_params"], local_ids, main["seed"], "d-0"
        )
        lanes = sink.take_lanes()
        zero_kv(topology)
        params = control["kv_transfer_params"]
        reordered = [list(reversed(ids)) for ids in params["remote_block_ids"]]
        refused = read_and_check(sink, stack, topology, dict(params, remote_block_ids=reordered),
                                 local_ids, control["seed"], "d-1")  # fmt: skip
        misplaced = [list(reversed(ids)) for ids in local_ids]
        negative = read_and_check(sink, stack, topology, params, misplaced, control["seed"],
                                  "d-2", check_ids=local_ids)  # fmt: skip
    finally:
        sink.close()
    ok = result.done and not result.mismatches and not result.stray and len(lanes) == 1
    refused_ok = not refused.done and "in their order" in (refused.failure or "")
    secret_ok = "unauthenticated" in wrong_refused
    control_ok = refused_ok and secret_ok and negative.done and bool(negative.mismatches)
    secret_row = ("negative control (another secret) refused by prefill",
                  f"{secret_ok} ({wrong_refused[:60] or 'not refused'})")  # fmt: skip
    report_table(offer, stack, topology, local_ids, result, lanes, None, negative, refused_ok,
                 [secret_row])  # fmt: skip
    if result.failure:
        print(f"  read failed: {result.failure}")
    print("RESULT:", "PASS" if ok and control_ok else "FAIL")
    return 0 if ok and control_ok else 1


def _fail(why: str) -> int:
    print(f"kvshare demo: error: {why}", file=sys.stderr)
    print("RESULT: FAIL")
    return 1


def _print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def add_arguments(demo: argparse.ArgumentParser) -> None:
    """The two-host options of ``kvshare demo``."""

    demo.add_argument(
        "--role",
        choices=["prefill", "decode"],
        help="run one side, the other on another host (default: both here, over 127.0.0.1)",
    )
    demo.add_argument(
        "--listen",
        type=host_port,
        metavar="HOST:PORT",
        help="prefill: its KV side channel, at the address decode dials "
        "(kv_transfer_params are served on PORT+1)",
    )
    demo.add_argument(
        "--prefill", type=host_port, metavar="HOST:PORT", help="decode: the prefill host's --listen"
    )
    demo.add_argument(
        "--secret-file",
        type=Path,
        metavar="FILE",
        help="the side channel's shared secret, the same file on both hosts",
    )
    demo.add_argument(
        "--wait-s",
        type=checks.positive_float,
        default=120.0,
        help="decode: how long to wait for the prefill host (default 120)",
    )
