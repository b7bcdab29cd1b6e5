"""What fronts a PD deployment's engines: the command lines of our proxy and of vllm-router
(``launcher.Deployment`` starts them once the engines answer)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvshare_connector.toolkit.launcher import EngineSpec, ServeConfig


def proxy_argv(cfg: ServeConfig, engines: Sequence[EngineSpec]) -> list[str]:
    t = cfg.proxy_timeouts
    argv = [
        sys.executable,
        "-m",
        "kvshare_connector.toolkit.cli",
        "proxy",
        "--host",
        cfg.host,
        "--port",
        str(cfg.port),
        "--connect-timeout",
        str(t.connect),
        "--read-timeout",
        str(t.read),
    ]
    argv += ["--first-token", cfg.first_token, "--side-down", cfg.side_down]
    argv += ["--prefill", *[e.url for e in engines if e.role == "prefill"]]
    argv += ["--decode", *[e.url for e in engines if e.role == "decode"]]
    return argv


def vllm_router_available() -> bool:
    """vllm-router's Python launcher (and its Rust extension) is importable here."""
    return importlib.util.find_spec("vllm_router") is not None


def router_argv(cfg: ServeConfig, engines: Sequence[EngineSpec], metrics_port: int) -> list[str]:
    """vllm-router in vLLM PD mode over these engines. It sends prefill a one-token,
    unstreamed copy with ``kv_transfer_params.do_remote_decode`` and decode the original body
    plus prefill's answered ``kv_transfer_params`` (its ``--kv-connector nixl``, the default):
    the flow KVShareConnector speaks. Run as a module of this interpreter (its console script
    may not be on PATH where the wheel was installed with ``--target``)."""
    argv = [
        sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation",
        "--host", cfg.host, "--port", str(cfg.port), "--policy", cfg.router_policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--request-timeout-secs", str(max(1, int(cfg.proxy_timeouts.read))),
        "--worker-startup-check-interval", "1", "--log-level", "warning",
    ]  # fmt: skip
    for e in engines:
        if e.role == "prefill":
            argv += ["--prefill", e.url]
    for e in engines:
        if e.role == "decode":
            argv += ["--decode", e.url]
    return argv + list(cfg.router_args)
