"""The kvshare command: proxy, serve-pd, sweep (and demo when its module is present).

Subcommands live in their modules; each registers itself through ``add_parser(subparsers)``
and sets ``func(args) -> int``. ``kvshare_connector.demo.run`` is optional and imported
lazily, so the command works (and starts fast) without it. Arguments after ``--`` go to
``vllm serve``.

Bad input never ends in a traceback: argument types (``checks``) refuse malformed values,
then a subcommand's ``check(args)``, when it sets one, looks at paths, executables, GPUs
and ports before anything starts; either failure is one line on stderr and exit status 2.
Failures of running servers keep their own report (the tail of the server's log).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from kvshare_connector.toolkit import checks

if TYPE_CHECKING:  # imported when serve-pd runs: the CLI starts without it
    from kvshare_connector.toolkit.launcher import Deployment

logger = logging.getLogger(__name__)

PASSTHROUGH_COMMANDS = ("serve-pd", "sweep")  # the ones that pass `-- ARGS` to vllm serve


def _add_timeouts(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--connect-timeout",
        type=checks.positive_float,
        default=10.0,
        help="seconds to connect to a backend (default 10)",
    )
    p.add_argument(
        "--read-timeout",
        type=checks.positive_float,
        default=600.0,
        help="seconds to wait for each chunk of a backend answer (default 600)",
    )


def _timeouts(args: argparse.Namespace) -> Any:
    from kvshare_connector.toolkit.proxy import ProxyTimeouts

    return ProxyTimeouts(connect=args.connect_timeout, read=args.read_timeout)


def _run_proxy(args: argparse.Namespace) -> int:
    from kvshare_connector.toolkit.proxy import ProxyOptions, serve

    options = ProxyOptions(
        timeouts=_timeouts(args),
        hand_off_token_ids=not args.prompt_as_text,
        first_token_from_prefill=args.first_token == "prefill",
        serve_alone=args.side_down == "alone",
    )
    serve(args.prefill, args.decode, args.host, args.port, options, args.log_level.lower())
    return 0


def _check_proxy(args: argparse.Namespace) -> None:
    checks.check_ports(args.host, [("--port", args.port)])


def add_proxy_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("proxy", help="run the PD proxy in front of running servers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=checks.port_number, default=8000)
    p.add_argument(
        "--prefill",
        nargs="+",
        action="extend",
        required=True,
        type=checks.http_url,
        metavar="URL",
        help="prefill (kv_producer) server URL(s), e.g. http://127.0.0.1:8100",
    )
    p.add_argument(
        "--decode",
        nargs="+",
        action="extend",
        required=True,
        type=checks.http_url,
        metavar="URL",
        help="decode (kv_consumer) server URL(s)",
    )
    p.add_argument(
        "--prompt-as-text",
        action="store_true",
        help="send decode a completion's prompt as the client's text (default: as the token "
        "ids prefill computed, so decode's server does not tokenize it again)",
    )
    _add_first_token(p)
    _add_side_down(p)
    _add_timeouts(p)
    p.set_defaults(func=_run_proxy, check=_check_proxy)


def serve_config_from_args(args: argparse.Namespace) -> Any:
    from kvshare_connector.toolkit import roles
    from kvshare_connector.toolkit.launcher import ServeConfig

    roles.check_command_line(args)

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
        kv_extra_config=dict(args.kv_extra_config or {}),
        served_model_name=args.served_model_name,
        vllm_args=list(args.passthrough),
        env=dict(args.env),
        server_cmd=args.server_cmd,
        ready_timeout=args.ready_timeout,
        grace=args.grace,
        parallel_start=args.parallel_start,
        proxy_timeouts=_timeouts(args),
        router=args.router,
        first_token=getattr(args, "first_token", "prefill"),
        side_down=getattr(args, "side_down", "alone"),
        router_policy=args.router_policy,
        router_metrics_port=args.router_metrics_port,
        router_args=list(args.router_args or []),
        **roles.config_kwargs(args),
    )
    if args.log_dir is not None:
        kwargs["log_dir"] = args.log_dir
    return ServeConfig(**kwargs)


def _deployment(args: argparse.Namespace) -> Any:
    from kvshare_connector.toolkit.launcher import colocated_deployment, pd_deployment

    cfg = serve_config_from_args(args)
    return colocated_deployment(cfg) if args.colocated else pd_deployment(cfg)


def _check_serve_pd(args: argparse.Namespace) -> None:
    """The model, where logs and the ready file go, then the plan's needs (see
    ``Deployment.check``); keeps the checked deployment for ``_run_serve_pd``."""
    args.model = checks.check_model(args.model)
    if args.log_dir is not None:
        checks.check_writable_dir(args.log_dir, "--log-dir")
    if args.ready_file is not None:
        checks.check_new_file(args.ready_file, "--ready-file")
    args.deployment = _deployment(args)
    args.deployment.check()


def _run_serve_pd(args: argparse.Namespace) -> int:
    deployment = getattr(args, "deployment", None) or _deployment(args)
    return run_foreground(deployment, args.ready_file)


def run_foreground(deployment: Deployment, ready_file: Path | None = None) -> int:
    """Start, print the endpoint, and block until Ctrl-C/SIGTERM or a server dies."""
    import json
    import signal
    import time

    from kvshare_connector.common.files import write_atomic
    from kvshare_connector.toolkit.procs import LaunchError, signals_interrupt

    try:
        with signals_interrupt(signal.SIGINT, signal.SIGTERM):
            try:
                deployment.start()
            except LaunchError as exc:
                logger.error("%s", exc)
                return 1
            info = deployment.describe()
            if info["endpoint"] is None:  # one role of a multi-host deployment
                from kvshare_connector.toolkit.roles import ready_line

                print(ready_line(deployment), flush=True)
            else:
                print(
                    f"kvshare: ready; OpenAI endpoint {info['endpoint']}/v1 "
                    f"(model {info['model']!r}); logs in {info['log_dir']}; Ctrl-C stops",
                    flush=True,
                )
            if ready_file is not None:
                # Readers poll for the file: it must appear whole.
                write_atomic(ready_file, json.dumps(info, indent=2))
            try:
                while True:
                    dead = deployment.dead()
                    if dead:
                        for p in dead:
                            logger.error(
                                "%s exited (code %s); log %s:\n%s",
                                p.name,
                                p.proc.returncode if p.proc else None,
                                p.log_path,
                                p.log_tail(),
                            )
                        return 1
                    time.sleep(0.5)
            finally:
                deployment.stop()
    except KeyboardInterrupt:
        print("kvshare: stopped", flush=True)
        return 0


def add_serve_pd_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve-pd",
        help="start prefill + decode vLLM servers with KVShareConnector and the proxy",
        description="Start prefill + decode `vllm serve` with KVShareConnector plus the PD "
        "proxy, wait until all are healthy, print the endpoint, stop everything on Ctrl-C; "
        "with --role, one host's prefill or decode engines alone (docs/multi_host.md). "
        "Arguments after `--` are passed to every `vllm serve`.",
    )
    p.add_argument("model")
    _add_placement_args(p)
    _add_role_args(p)
    _add_engine_args(p)
    _add_process_args(p)
    _add_router_args(p)
    _add_first_token(p)
    _add_side_down(p)
    _add_timeouts(p)
    p.set_defaults(func=_run_serve_pd, check=_check_serve_pd)


def _add_role_args(p: argparse.ArgumentParser) -> None:
    """serve-pd: one role per host (toolkit/roles.py), imported when the parser is built."""
    from kvshare_connector.toolkit import roles

    roles.add_args(p)


def _add_placement_args(p: argparse.ArgumentParser) -> None:
    """serve-pd: where the engines run (ports, counts, GPUs, memory)."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--port",
        type=checks.port_number,
        default=8000,
        help="endpoint port: the proxy (or the server with --colocated)",
    )
    p.add_argument("--prefill-port", type=checks.port_number, default=8100)
    p.add_argument("--decode-port", type=checks.port_number, default=8200)
    p.add_argument(
        "--side-channel-port",
        type=checks.port_number,
        default=5600,
        help="VLLM_NIXL_SIDE_CHANNEL_PORT of the first engine; the others step by 16",
    )
    p.add_argument("--num-prefill", type=checks.positive_int, default=1)
    p.add_argument("--num-decode", type=checks.positive_int, default=1)
    p.add_argument(
        "--prefill-gpus",
        type=checks.gpu_list,
        default=["0"],
        help="CUDA_VISIBLE_DEVICES per prefill server, cycled (default 0)",
    )
    p.add_argument(
        "--decode-gpus",
        type=checks.gpu_list,
        default=["0"],
        help="CUDA_VISIBLE_DEVICES per decode server, cycled (default 0: same GPU)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=checks.fraction,
        default=None,
        help="per engine; default 0.85 split over the engines sharing a GPU",
    )
    p.add_argument("--block-size", type=checks.positive_int, default=None)
    p.add_argument("--max-model-len", type=checks.positive_int, default=None)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """serve-pd: what each engine runs with (layout, connector options, env)."""
    p.add_argument(
        "--layout",
        choices=["per_layer", "cross_layer"],
        default=None,
        help="KV layout the connector asks vLLM for (its cross_layer_blocks option)",
    )
    p.add_argument("--kv-both", action="store_true", help="run both engines as kv_both")
    p.add_argument(
        "--kv-extra-config",
        type=checks.json_object,
        default=None,
        help="JSON object merged into kv_connector_extra_config",
    )
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--env",
        type=checks.env_pair,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for the vLLM servers, e.g. ENABLE_KVCACHED=true",
    )


def _add_process_args(p: argparse.ArgumentParser) -> None:
    """serve-pd: how the processes start, log and stop."""
    p.add_argument(
        "--server-cmd",
        default=None,
        help="server command template instead of `{vllm} serve {model} --host {host} "
        "--port {port}` (fields: model host port role python vllm); env "
        "KVSHARE_SERVER_CMD works too; no GPU check then",
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
    p.add_argument("--ready-timeout", type=checks.positive_float, default=900.0)
    p.add_argument(
        "--grace",
        type=checks.non_negative_float,
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


def _add_first_token(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--first-token",
        choices=["prefill", "decode"],
        default="prefill",
        help="where a streamed completion's first token comes from: 'prefill' (default) "
        "streams the token prefill sampled at once and decode generates the rest, where the "
        "output is the same (docs/pd_toolkit.md); 'decode' samples it again on decode, "
        "as vLLM's toy proxy does",
    )


def _add_side_down(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--side-down",
        choices=["alone", "fail"],
        default="alone",
        help="a leg no server of its side takes (prefill or decode: every one refused the "
        "connection or dropped it unanswered): 'alone' (default) has a server of the other "
        "side compute the request whole, as a colocated engine would; 'fail' answers the "
        "error (503/502)",
    )


def _add_router_args(p: argparse.ArgumentParser) -> None:
    """serve-pd: what fronts the engines."""
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
        type=checks.port_number,
        default=None,
        help="vllm-router's Prometheus port (default: a free one)",
    )
    p.add_argument(
        "--router-args",
        type=checks.shell_words,
        default=None,
        help="more vllm-router arguments, one string",
    )


class OneLineParser(argparse.ArgumentParser):
    """argparse's ``prog: error: message``, on one line without the usage block (its
    subcommand parsers are of this class too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(checks.EXIT_USAGE, f"{self.prog}: error: {checks.one_line(message)} "
                  f"(see {self.prog} --help)\n")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="kvshare", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_proxy_parser(sub)
    add_serve_pd_parser(sub)
    from kvshare_connector.toolkit import lane, sweep

    sweep.add_parser(sub)
    lane.add_parser(sub)
    try:  # optional subcommand, in its own module
        demo = importlib.import_module("kvshare_connector.demo.run")
    except ImportError as exc:
        if exc.name != "kvshare_connector.demo.run":  # demo exists but is broken: say so
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
    if passthrough and args.command not in PASSTHROUGH_COMMANDS:
        parser.exit(
            checks.EXIT_USAGE,
            f"kvshare {args.command}: error: arguments after `--` are for vllm serve; "
            f"`{args.command}` takes none\n",
        )
    args.passthrough = passthrough
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    check = getattr(args, "check", None)
    try:
        if check is not None:
            check(args)
    except (ValueError, argparse.ArgumentTypeError) as exc:  # UsageError included
        return _usage_error(args.command, exc)
    except Exception as exc:  # a check that broke must not bury the input under a traceback
        logger.debug("checking the arguments failed", exc_info=True)
        return _usage_error(
            args.command, f"cannot check the arguments: {type(exc).__name__}: {exc}"
        )
    try:
        return int(args.func(args) or 0)
    except checks.UsageError as exc:  # found late, still bad input
        return _usage_error(args.command, exc)


def _usage_error(command: str, message: object) -> int:
    """One line on stderr, as argparse words its own errors; exit status 2."""
    text = checks.one_line(message) or repr(message)
    print(f"kvshare {command}: error: {text}", file=sys.stderr, flush=True)
    return checks.EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
