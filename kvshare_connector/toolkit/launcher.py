"""Start a PD deployment (prefill + decode ``vllm serve`` with KVShareConnector, plus the proxy)
or a colocated baseline (one plain ``vllm serve``), and stop it cleanly.

The plan (commands, ports, environments) is computed by pure functions so it can be
checked without starting anything; ``Deployment`` turns a plan into processes.

Conventions worth knowing:

* every engine gets its own ``VLLM_NIXL_SIDE_CHANNEL_PORT`` (base + ``SIDE_CHANNEL_STRIDE``
  per engine: vLLM offsets the side-channel port by the data-parallel rank);
* engines that share a GPU start one after the other by default, because vLLM's memory
  profiling at startup misreads memory that another engine is allocating at the same time;
* ``ENABLE_KVCACHED=true`` implies ``VLLM_USE_V2_MODEL_RUNNER=0`` (kvcached 0.1.6 refuses
  vLLM 0.26's V2 model runner; not on 0.34, which has no other) unless that variable is set
  explicitly, and ``check`` refuses it where kvcached is missing or does not adapt the
  installed vLLM (0.1.6: up to 0.30);
* ``--server-cmd`` (or ``KVSHARE_SERVER_CMD``) replaces ``{vllm} serve {model} --host {host}
  --port {port}``, e.g. with tests/support/fake_vllm_server.py; the vLLM options follow it;
  ``{vllm}`` is the ``vllm`` beside the running Python (its virtualenv), else on PATH;
* ``Deployment.check`` looks at what a plan needs (executables, GPUs, free ports) before
  anything starts, and raises ``checks.UsageError`` naming what is missing;
* the front is our proxy (no dependency) or vllm-router (``router="vllm-router"``, the
  optional ``router`` extra): it does the same NIXL-style two-step (see docs/pd_toolkit.md).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvshare_connector.toolkit import roles
from kvshare_connector.toolkit.checks import (
    UsageError,
    check_gpus,
    check_kvcached,
    check_ports,
    locate,
    require_command,
    require_executable,
)
from kvshare_connector.toolkit.fronts import proxy_argv, router_argv, vllm_router_available
from kvshare_connector.toolkit.procs import (
    LaunchError,
    ManagedProcess,
    pick_free_port,
    stop_processes,
    wait_healthy,
)
from kvshare_connector.toolkit.proxy import ProxyTimeouts
from kvshare_connector.transfer.wire.side_channel import SECRET_ENV

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "KVShareConnector"
CONNECTOR_MODULE = "kvshare_connector"
#: KVShareConnector's ``kv_connector_extra_config`` switch for the cross-layer blocks layout
#: (its default: on unless kvcached is enabled; vLLM uses it only for one-group models).
LAYOUT_KEY = "cross_layer_blocks"
LAYOUTS = ("per_layer", "cross_layer")
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
SIDE_CHANNEL_STRIDE = 16
SERVER_CMD_ENV = "KVSHARE_SERVER_CMD"
DEFAULT_SERVER_CMD = "{vllm} serve {model} --host {host} --port {port}"
SERVER_CMD_FIELDS = ("model", "host", "port", "role", "python", "vllm")
#: What fronts a PD deployment: our proxy (toolkit/proxy.py) or vllm-router's PD mode.
ROUTERS = ("kvshare", "vllm-router")
ROUTER_POLICIES = ("round_robin", "random", "power_of_two", "cache_aware", "consistent_hash")
ROUTER_MISSING = (
    "--router vllm-router: the vllm_router package is not installed here "
    "(pip install 'kvshare-connector[router]', i.e. vllm-router==0.1.17)"
)


@dataclass
class ServeConfig:
    """Everything needed to start a PD deployment or its colocated baseline."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000  # the endpoint: the proxy (PD) or the single server (colocated)
    prefill_port: int = 8100  # first prefill server; further ones count up
    decode_port: int = 8200
    side_channel_port: int = 5600
    num_prefill: int = 1
    num_decode: int = 1
    prefill_gpus: list[str] = field(default_factory=lambda: ["0"])
    decode_gpus: list[str] = field(default_factory=lambda: ["0"])
    gpu_memory_utilization: float | None = None  # None: 0.85 split over engines on a GPU
    block_size: int | None = None
    max_model_len: int | None = None
    layout: str | None = None  # per_layer | cross_layer | None (connector default)
    kv_both: bool = False  # both engines as kv_both instead of producer/consumer
    kv_extra_config: dict[str, Any] = field(default_factory=dict)
    served_model_name: str | None = None
    vllm_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    server_cmd: str | None = None
    log_dir: Path = field(
        default_factory=lambda: Path("runs/serve_pd") / time.strftime("%Y%m%d-%H%M%S")
    )
    ready_timeout: float = 900.0
    grace: float = 20.0
    parallel_start: bool | None = None  # None: one engine per GPU at a time; False: one at all
    proxy_timeouts: ProxyTimeouts = field(default_factory=ProxyTimeouts)
    router: str = "kvshare"  # one of ROUTERS
    first_token: str = "prefill"  # our proxy: "prefill" streams prefill's token (first_token.py)
    side_down: str = "alone"  # our proxy, one side all down: "alone" (the other serves) or "fail"
    router_policy: str = "round_robin"  # vllm-router's --policy (prefill and decode)
    router_metrics_port: int | None = None  # vllm-router's Prometheus port; None: a free one
    router_args: list[str] = field(default_factory=list)  # more vllm-router arguments
    # The side channel's shared secret for this deployment (KVSHARE_SIDE_CHANNEL_SECRET of
    # every engine), unless the user gave one (--env, the environment, the extra config).
    side_channel_secret: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)
    # One host per role (toolkit/roles.py, docs/multi_host.md): "both" (with the proxy),
    # "prefill" or "decode" engines only; where side channels listen and what they advertise;
    # decode's allowed_prefills (default: this plan's prefills); the secret's file.
    role: str = "both"
    side_channel_host: str | None = None
    advertise_host: str | None = None
    allowed_prefills: list[str] | None = None
    secret_file: Path | None = None

    def __post_init__(self) -> None:
        roles.check(self)
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if self.first_token not in ("prefill", "decode"):
            raise ValueError(f"first_token must be prefill or decode, got {self.first_token!r}")
        if self.side_down not in ("alone", "fail"):
            raise ValueError(f"side_down must be alone or fail, got {self.side_down!r}")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("need at least one prefill and one decode server")
        if not self.prefill_gpus or not self.decode_gpus:
            raise ValueError("GPU lists must not be empty")


@dataclass
class EngineSpec:
    """One server process of a plan."""

    name: str  # prefill0, decode0, colocated
    role: str  # prefill | decode | colocated
    host: str
    port: int
    argv: list[str]
    env: dict[str, str]  # only what the launcher adds on top of os.environ

    @property
    def url(self) -> str:
        return f"http://{client_host(self.host)}:{self.port}"


def client_host(host: str) -> str:
    """Where to connect to a server bound to ``host`` (wildcard binds are reached locally)."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def side_channel_host(cfg: ServeConfig) -> str:
    """Where prefill engines' side channels listen (``roles.side_channel_host``)."""
    return roles.side_channel_host(cfg)


def prefill_side_channel_ports(cfg: ServeConfig) -> list[int]:
    """The side-channel ports of the plan's engines that serve KV (its prefills, with
    ``kv_both`` every engine), as ``plan_pd`` numbers them."""
    serving = cfg.num_prefill + (cfg.num_decode if cfg.kv_both else 0)
    return [cfg.side_channel_port + k * SIDE_CHANNEL_STRIDE for k in range(serving)]


def kv_transfer_config(cfg: ServeConfig, role: str) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of a prefill or decode engine: decode may reach only
    the side channels of this deployment's prefills (``allowed_prefills``, each
    ``host:port``) or the ones given, unless the extra config says otherwise."""
    extra = dict(cfg.kv_extra_config)
    if cfg.layout is not None:
        extra[LAYOUT_KEY] = cfg.layout == "cross_layer"
    if (role == "prefill" or cfg.kv_both) and cfg.advertise_host:
        extra.setdefault("advertise_host", cfg.advertise_host)
    if (role == "decode" or cfg.kv_both) and "allowed_prefills" not in extra:
        extra["allowed_prefills"] = roles.allow_list(cfg, prefill_side_channel_ports(cfg))
    kv: dict[str, Any] = {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both" if cfg.kv_both else KV_ROLES[role],
    }
    if extra:
        kv["kv_connector_extra_config"] = extra
    return kv


def _gpu_share(cfg: ServeConfig, engines_per_gpu: int) -> float:
    if cfg.gpu_memory_utilization is not None:
        return cfg.gpu_memory_utilization
    return round(0.85 / engines_per_gpu - 0.005, 2)


def custom_server_cmd(server_cmd: str | None) -> str | None:
    """The template replacing ``vllm serve`` (``--server-cmd``, else ``KVSHARE_SERVER_CMD``)."""
    return server_cmd or os.environ.get(SERVER_CMD_ENV) or None


def engine_argv(
    cfg: ServeConfig, role: str, port: int, gpu_share: float, kv: dict[str, Any] | None
) -> list[str]:
    template = custom_server_cmd(cfg.server_cmd) or DEFAULT_SERVER_CMD
    fields = dict(model=cfg.model, host=cfg.host, port=port, role=role, python=sys.executable)
    try:
        argv = shlex.split(template.format(**fields, vllm=shlex.quote(locate("vllm") or "vllm")))
    except (KeyError, IndexError, ValueError) as exc:
        detail = f"unknown field {{{exc.args[0]}}}" if isinstance(exc, KeyError) else exc
        raise ValueError(
            f"server command {template!r}: {detail} (fields: {' '.join(SERVER_CMD_FIELDS)})"
        ) from None
    if not argv:
        raise ValueError(f"server command {template!r} is empty")
    if cfg.served_model_name:
        argv += ["--served-model-name", cfg.served_model_name]
    argv += ["--gpu-memory-utilization", str(gpu_share)]
    if cfg.block_size is not None:
        argv += ["--block-size", str(cfg.block_size)]
    if cfg.max_model_len is not None:
        argv += ["--max-model-len", str(cfg.max_model_len)]
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(kv, separators=(",", ":"))]
    return argv + list(cfg.vllm_args)


def engine_env(cfg: ServeConfig, gpu: str, side_channel_port: int | None) -> dict[str, str]:
    """What an engine's environment adds: its GPU, and with a side channel its port, host
    (where given, or with a role) and the deployment's secret (in the environment, not on
    the command line `ps` shows)."""
    env = dict(cfg.env)
    env["CUDA_VISIBLE_DEVICES"] = gpu
    if side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
        if cfg.side_channel_host or cfg.role != "both":
            env[roles.HOST_ENV] = roles.side_channel_host(cfg)
        secret = roles.engine_secret(cfg)
        if secret is not None:
            env[SECRET_ENV] = secret
    if kvcached_enabled(env) and "VLLM_USE_V2_MODEL_RUNNER" not in env and _has_v1_runner():
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    return env


def _has_v1_runner() -> bool:
    """Whether the installed vLLM still has the V1 model runner (0.34 has not, and stops
    an engine started with ``VLLM_USE_V2_MODEL_RUNNER=0``); imported only under kvcached."""
    from kvshare_connector.vllm import compat

    return compat.HAS_V1_MODEL_RUNNER


def kvcached_enabled(env: dict[str, str]) -> bool:
    """``ENABLE_KVCACHED`` on, in an engine's added ``env`` or else in ours."""
    value = env.get("ENABLE_KVCACHED") or os.environ.get("ENABLE_KVCACHED", "")
    return value.lower() in ("1", "true")


def plan_pd(cfg: ServeConfig) -> list[EngineSpec]:
    """Prefill then decode engines: ports, GPUs, memory shares, side channels, kv roles
    (with a role, that role's engines only)."""
    prefill_gpus = [cfg.prefill_gpus[i % len(cfg.prefill_gpus)] for i in range(cfg.num_prefill)]
    decode_gpus = [cfg.decode_gpus[i % len(cfg.decode_gpus)] for i in range(cfg.num_decode)]
    prefill_gpus = [] if cfg.role == "decode" else prefill_gpus
    decode_gpus = [] if cfg.role == "prefill" else decode_gpus
    all_gpus = prefill_gpus + decode_gpus
    specs = []
    for k, (role, i, gpu) in enumerate(
        [("prefill", i, g) for i, g in enumerate(prefill_gpus)]
        + [("decode", i, g) for i, g in enumerate(decode_gpus)]
    ):
        base = cfg.prefill_port if role == "prefill" else cfg.decode_port
        port = base + i
        share = _gpu_share(cfg, all_gpus.count(gpu))
        specs.append(
            EngineSpec(
                name=f"{role}{i}",
                role=role,
                host=cfg.host,
                port=port,
                argv=engine_argv(cfg, role, port, share, kv_transfer_config(cfg, role)),
                env=engine_env(cfg, gpu, cfg.side_channel_port + k * SIDE_CHANNEL_STRIDE),
            )
        )
    return specs


def plan_colocated(cfg: ServeConfig) -> list[EngineSpec]:
    """One plain server on the endpoint port: no connector, no side channel."""
    share = _gpu_share(cfg, 1)
    return [
        EngineSpec(
            name="colocated",
            role="colocated",
            host=cfg.host,
            port=cfg.port,
            argv=engine_argv(cfg, "colocated", cfg.port, share, None),
            env=engine_env(cfg, cfg.prefill_gpus[0], None),
        )
    ]


def start_waves(engines: Sequence[EngineSpec], parallel: bool | None) -> list[list[EngineSpec]]:
    """Groups of engines started together: all at once (``True``), one by one (``False``),
    or (``None``) at most one engine per GPU per group (vLLM's startup memory profiling
    misreads memory another engine on its GPU is allocating): 1P2D on two GPUs, two waves."""
    if parallel:
        return [list(engines)]
    if parallel is False:
        return [[e] for e in engines]
    waves: list[list[EngineSpec]] = []
    seen: dict[str, int] = {}
    for e in engines:
        gpu = e.env.get("CUDA_VISIBLE_DEVICES", "")
        k = seen.get(gpu, 0)
        seen[gpu] = k + 1
        if k == len(waves):
            waves.append([])
        waves[k].append(e)
    return waves


def check_server(cfg: ServeConfig, engines: Sequence[EngineSpec]) -> None:
    """The engines' command runs here and, for vLLM itself, kvcached can serve them where
    they ask for it and their GPUs are visible."""
    if custom_server_cmd(cfg.server_cmd) is not None:
        for program in sorted({e.argv[0] for e in engines}):
            require_command(program, "--server-cmd (or KVSHARE_SERVER_CMD)")
        return
    require_executable("vllm", "install vLLM there (pip install vllm) or pass --server-cmd")
    if any(kvcached_enabled(e.env) for e in engines):
        check_kvcached()
    gpus = {e.env.get("CUDA_VISIBLE_DEVICES", "") for e in engines}
    check_gpus(gpus, "vLLM engines need one (--server-cmd starts another server instead)")


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    # The proxy runs as `python -m kvshare_connector.toolkit.cli`: make the package importable even
    # when it is used from a checkout rather than installed. Appended, so that a PYTHONPATH the
    # caller gave wins: put first, this tree shadowed the earlier tree of a side-by-side
    # "before" deployment (fast_lane.sh serve), which then ran this code (2026-12-03, twice).
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), root) if p)
    return env


class Deployment:
    """Processes of one plan; a context manager that always stops what it started."""

    def __init__(self, cfg: ServeConfig, engines: list[EngineSpec], with_proxy: bool) -> None:
        self.cfg = cfg
        self.engines = engines
        self.with_proxy = with_proxy
        self.front_env: dict[str, str] = {}  # e.g. a fault test's failpoint in our proxy
        self.procs: list[ManagedProcess] = []

    @property
    def endpoint(self) -> str:
        return f"http://{client_host(self.cfg.host)}:{self.cfg.port}"

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> ManagedProcess:
        proc = ManagedProcess(name, argv, _child_env(env), self.cfg.log_dir / f"{name}.log")
        self.procs.append(proc)
        proc.start()
        return proc

    def _spawn_front(self) -> ManagedProcess:
        """Our proxy, or vllm-router (started once the engines answer: it waits for them)."""
        if self.cfg.router == "kvshare":
            return self._spawn("proxy", proxy_argv(self.cfg, self.engines), self.front_env)
        if not vllm_router_available():
            raise LaunchError(ROUTER_MISSING)
        port = self.cfg.router_metrics_port or pick_free_port(client_host(self.cfg.host))
        return self._spawn("router", router_argv(self.cfg, self.engines, port), {})

    def planned_ports(self, side_channels: bool = True) -> list[tuple[str, int]]:
        """(what, port) of every port the plan listens on (engines' side channels too)."""
        flags = {"prefill": "--prefill-port", "decode": "--decode-port", "colocated": "--port"}
        ports = [("--port (the proxy)", self.cfg.port)] if self.with_proxy else []
        ports += [(f"{flags[e.role]} ({e.name})", e.port) for e in self.engines]
        side = "VLLM_NIXL_SIDE_CHANNEL_PORT"
        if side_channels:
            ports += [
                (f"--side-channel-port ({e.name})", int(e.env[side]))
                for e in self.engines
                if side in e.env
            ]
        if self.with_proxy and self.cfg.router == "vllm-router" and self.cfg.router_metrics_port:
            ports.append(("--router-metrics-port", self.cfg.router_metrics_port))
        return ports

    def check(self) -> None:
        """Before starting anything: the server command (for vLLM: the executable and the
        GPUs), vllm-router when it fronts, and every port (in range, distinct, free; side
        channels only for vLLM itself). Raises ``UsageError`` naming the problem."""
        check_server(self.cfg, self.engines)
        if self.with_proxy and self.cfg.router == "vllm-router" and not vllm_router_available():
            raise UsageError(ROUTER_MISSING)
        real_vllm = custom_server_cmd(self.cfg.server_cmd) is None
        check_ports(self.cfg.host, self.planned_ports(side_channels=real_vllm))

    def start(self) -> Deployment:
        """Start engines (in waves, one per GPU at a time unless ``parallel_start``), then
        the proxy or router; wait until each answers ``/health``."""
        cfg = self.cfg
        t0 = time.monotonic()
        try:
            for wave in start_waves(self.engines, cfg.parallel_start):
                started = [(spec, self._spawn(spec.name, spec.argv, spec.env)) for spec in wave]
                for spec, proc in started:
                    left = max(1.0, cfg.ready_timeout - (time.monotonic() - t0))
                    wait_healthy(spec.url + "/health", proc, left)
            if self.with_proxy:
                front = self._spawn_front()
                wait_healthy(self.endpoint + "/health", front, min(cfg.ready_timeout, 60.0))
        except BaseException:
            self.stop()
            raise
        where = f"at {self.endpoint}" if self.with_proxy else f"({cfg.role} engines)"
        logger.info("deployment ready %s after %.1fs", where, time.monotonic() - t0)
        return self

    def dead(self) -> list[ManagedProcess]:
        """Processes that exited on their own."""
        return [p for p in self.procs if not p.alive()]

    def describe(self) -> dict[str, Any]:
        """What started (a role's deployment has no endpoint of its own: its front does;
        its prefills' side channels are what decode hosts admit)."""
        return {
            "endpoint": self.endpoint if self.with_proxy else None,
            "role": self.cfg.role,
            "side_channels": roles.side_channels(self.cfg, self.engines),
            "model": self.cfg.served_model_name or self.cfg.model,
            "processes": [
                {"name": p.name, "pid": p.pid, "log": str(p.log_path)} for p in self.procs
            ],
            "engines": [{"name": e.name, "role": e.role, "url": e.url} for e in self.engines],
            "log_dir": str(self.cfg.log_dir),
        }

    def stop(self) -> None:
        # Signalled in reverse start order: the proxy (no new requests), decode, prefill.
        stop_processes(list(reversed(self.procs)), self.cfg.grace)

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def pd_deployment(cfg: ServeConfig) -> Deployment:
    """The PD deployment of ``cfg``: with one role, that role's engines alone (no proxy)."""
    return Deployment(cfg, plan_pd(cfg), with_proxy=cfg.role == "both")


def colocated_deployment(cfg: ServeConfig) -> Deployment:
    return Deployment(cfg, plan_colocated(cfg), with_proxy=False)
