"""The kvshare command: proxy, serve-pd, sweep (and demo when its module is present).

Subcommands live in their modules; each registers itself through ``add_parser(subparsers)``
and sets ``func(args) -> int``. ``kvshare_connector.devtools.demo`` is optional and imported
lazily, so the command works (and starts fast) without it. Arguments after ``--`` go to
``vllm serve``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _gpu_list(text: str) -> list[str]:
    gpus = [g.strip() for g in text.split(",") if g.strip()]
    if not gpus:
        raise argparse.ArgumentTypeError("expected GPU ids like 0 or 0,1")
    return gpus


def _add_timeouts(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=10.0,
        help="seconds to connect to a backend (default 10)",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for each chunk of a backend answer (default 600)",
    )


def _timeouts(args: argparse.Namespace) -> Any:
    from kvshare_connector.toolkit.proxy import ProxyTimeouts

    return ProxyTimeouts(connect=args.connect_timeout, read=args.read_timeout)


def _run_proxy(args: argparse.Namespace) -> int:
    from kvshare_connector.toolkit.proxy import serve

    serve(
        args.prefill,
        args.decode,
        args.host,
        args.port,
        _timeouts(args),
        log_level=args.log_level.lower(),
    )
    return 0


def add_proxy_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("proxy", help="run the PD proxy in front of running servers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--prefill",
        nargs="+",
        action="extend",
        required=True,
        metavar="URL",
        help="prefill (kv_producer) server URL(s), e.g. http://127.0.0.1:8100",
    )
    p.add_argument(
        "--decode",
        nargs="+",
        action="extend",
        required=True,
        metavar="URL",
        help="decode (kv_consumer) server URL(s)",
    )
    _add_timeouts(p)
    p.set_defaults(func=_run_proxy)


def serve_config_from_args(args: argparse.Namespace) -> Any:
    from kvshare_connector.toolkit.launcher import ServeConfig

    kwargs: dict[str, Any] = dict(
        model=args.model,
        host=args.host,
        port=args.port,
        prefill_port=args.prefill_port,
        decode_port=args.decode_port,
        side_channel_port=args.side_channel_port,
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        prefill_gpus=args.prefill_gpus,
        decode_gpus=args.decode_gpus,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        layout=args.layout,
        kv_both=args.kv_both,
        kv_extra_config=json.loads(args.kv_extra_config) if args.kv_extra_config else {},
        served_model_name=args.served_model_name,
        vllm_args=list(args.passthrough),
        env=dict(args.env),
        server_cmd=args.server_cmd,
        ready_timeout=args.ready_timeout,
        grace=args.grace,
        parallel_start=args.parallel_start,
        proxy_timeouts=_timeouts(args),
        router=args.router,
        router_policy=args.router_policy,
        router_metrics_port=args.router_metrics_port,
        router_args=shlex.split(args.router_args or ""),
    )
    if args.log_dir is not None:
        kwargs["log_dir"] = args.log_dir
    return ServeConfig(**kwargs)


def _run_serve_pd(args: argparse.Namespace) -> int:
    from kvshare_connector.toolkit.launcher import (
        colocated_deployment,
        pd_deployment,
        run_foreground,
    )

    cfg = serve_config_from_args(args)
    deployment = colocated_deployment(cfg) if args.colocated else pd_deployment(cfg)
    return run_foreground(deployment, args.ready_file)


def add_serve_pd_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve-pd",
        help="start prefill + decode vLLM servers with KVShareConnector and the proxy",
        description="Start prefill + decode `vllm serve` with KVShareConnector plus the PD "
        "proxy, wait until all are healthy, print the endpoint, stop everything on Ctrl-C. "
        "Arguments after `--` are passed to every `vllm serve`.",
    )
    p.add_argument("model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--port",
        type=int,
        default=8000,
        help="endpoint port: the proxy (or the server with --colocated)",
    )
    p.add_argument("--prefill-port", type=int, default=8100)
    p.add_argument("--decode-port", type=int, default=8200)
    p.add_argument(
        "--side-channel-port",
        type=int,
        default=5600,
        help="VLLM_NIXL_SIDE_CHANNEL_PORT of the first engine; the others step by 16",
    )
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument(
        "--prefill-gpus",
        type=_gpu_list,
        default=["0"],
        help="CUDA_VISIBLE_DEVICES per prefill server, cycled (default 0)",
    )
    p.add_argument(
        "--decode-gpus",
        type=_gpu_list,
        default=["0"],
        help="CUDA_VISIBLE_DEVICES per decode server, cycled (default 0: same GPU)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="per engine; default 0.85 split over the engines sharing a GPU",
    )
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--layout",
        choices=["per_layer", "cross_layer"],
        default=None,
        help="KV layout the connector asks vLLM for (its cross_layer_blocks option)",
    )
    p.add_argument("--kv-both", action="store_true", help="run both engines as kv_both")
    p.add_argument(
        "--kv-extra-config", default=None, help="JSON merged into kv_connector_extra_config"
    )
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--env",
        type=_env_pair,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for the vLLM servers, e.g. ENABLE_KVCACHED=true",
    )
    p.add_argument(
        "--server-cmd",
        default=None,
        help="server command template instead of `vllm serve {model} --host {host} "
        "--port {port}` (fields: model host port role python); env "
        "KVSHARE_SERVER_CMD works too",
    )
    p.add_argument(
        "--colocated",
        action="store_true",
        help="baseline: one plain `vllm serve` (no connector, no proxy) on --port",
    )
    p.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="per-process logs (default runs/serve_pd/<timestamp>)",
    )
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument(
        "--grace",
        type=float,
        default=20.0,
        help="seconds between SIGTERM and SIGKILL when stopping",
    )
    start = p.add_mutually_exclusive_group()
    start.add_argument("--parallel-start", dest="parallel_start", action="store_true", default=None)
    start.add_argument("--sequential-start", dest="parallel_start", action="store_false")
    p.add_argument(
        "--ready-file",
        type=Path,
        default=None,
        help="write a JSON description (endpoint, pids, logs) here once ready",
    )
    p.add_argument(
        "--router",
        choices=["kvshare", "vllm-router"],
        default="kvshare",
        help="what fronts the engines: our proxy (default, no dependency) or vllm-router's "
        "PD mode (pip install 'kvshare-connector[router]')",
    )
    p.add_argument(
        "--router-policy",
        default="round_robin",
        choices=["round_robin", "random", "power_of_two", "cache_aware", "consistent_hash"],
        help="vllm-router's load-balancing policy for prefill and decode (default round_robin)",
    )
    p.add_argument(
        "--router-metrics-port",
        type=int,
        default=None,
        help="vllm-router's Prometheus port (default: a free one)",
    )
    p.add_argument("--router-args", default=None, help="more vllm-router arguments, one string")
    _add_timeouts(p)
    p.set_defaults(func=_run_serve_pd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvshare", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_proxy_parser(sub)
    add_serve_pd_parser(sub)
    from kvshare_connector.toolkit import sweep

    sweep.add_parser(sub)
    try:  # optional subcommand, in its own module
        demo = importlib.import_module("kvshare_connector.devtools.demo")
    except ImportError as exc:
        if exc.name != "kvshare_connector.devtools.demo":  # demo exists but is broken: say so
            logger.warning("`kvshare demo` unavailable: %s", exc)
        demo = None
    if demo is not None and hasattr(demo, "add_parser"):
        demo.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    if passthrough and args.command == "proxy":
        parser.error("arguments after `--` are for vllm serve; `proxy` takes none")
    args.passthrough = passthrough
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
