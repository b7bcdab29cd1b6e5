"""``serve-pd`` across hosts: one role per host, and what the hosts share (docs/multi_host.md).

``kvshare serve-pd MODEL --role prefill`` starts only this host's prefill engines,
``--role decode`` only its decode engines; ``kvshare proxy`` (or vllm-router), told their
URLs, fronts them. Without ``--role`` one host runs both and the proxy, as before. Between
the hosts:

* prefill's side channel listens on ``--side-channel-host`` (with ``--role``: ``--host``) and
  advertises the address decode dials: that host, or for every interface (``0.0.0.0``) the
  routable address (``transfer/wire/addresses.py``) or ``--advertise-host``;
* decode reaches only ``allowed_prefills``, written ``host:port`` (``--allowed-prefills``;
  the one-host form lists its own prefills'); a host alone would admit every port of it;
* the secret comes from ``--secret-file`` or ``KVSHARE_SIDE_CHANNEL_SECRET`` in serve-pd's
  environment and reaches the engines in theirs. A secret on a command line (``--env``,
  ``--kv-extra-config``) is refused: ``ps`` shows every user the command lines.
"""

from __future__ import annotations

import argparse
import logging
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvshare_connector.toolkit.checks import UsageError

if TYPE_CHECKING:
    from kvshare_connector.toolkit.launcher import Deployment, EngineSpec, ServeConfig

logger = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")
HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
# transfer.side_channel.SECRET_ENV and transfer.addresses.ADVERTISE_ENV, named here so that
# building the command's parser imports no transfer code (tests/test_serve_roles.py checks)
SECRET_ENV = "KVSHARE_SIDE_CHANNEL_SECRET"
ADVERTISE_ENV = "KVSHARE_ADVERTISE_HOST"
SECRET_NEEDED = (
    "needs the deployment's side-channel secret, the same on every host: --secret-file PATH "
    f"(one line, e.g. `openssl rand -hex 32 > PATH`) or {SECRET_ENV} in the environment"
)


def read_secret_file(path: Path) -> str:
    """The secret in ``path`` (one line; surrounding whitespace dropped)."""
    try:
        text = path.read_text()
        mode = path.stat().st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--secret-file {str(path)!r}: {exc}") from None
    secret = text.strip()
    if not secret or "\n" in secret:
        raise UsageError(f"--secret-file {str(path)!r} must hold one non-empty line")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("--secret-file %s can be read by other users: chmod 600 it", path)
    return secret


def engine_secret(cfg: ServeConfig) -> str | None:
    """The secret serve-pd puts in its engines' environment: the file's, or the deployment's
    own in the one-host form; None where the engines already get one (serve-pd's
    environment, or the extra config of a program that built the plan itself)."""
    if cfg.secret_file is not None:
        return read_secret_file(cfg.secret_file)
    if (
        SECRET_ENV in cfg.env
        or os.environ.get(SECRET_ENV)
        or "side_channel_secret" in (cfg.kv_extra_config)
    ):
        return None
    if cfg.role != "both":
        raise UsageError(f"serve-pd --role {cfg.role} {SECRET_NEEDED}")
    return cfg.side_channel_secret


def side_channel_host(cfg: ServeConfig) -> str:
    """Where prefill engines' side channels listen: ``side_channel_host``, else
    VLLM_NIXL_SIDE_CHANNEL_HOST as given, else with a role the HTTP host, else vLLM's
    default (localhost)."""
    given = cfg.side_channel_host or cfg.env.get(HOST_ENV) or os.environ.get(HOST_ENV)
    return given or (cfg.host if cfg.role != "both" else "localhost")


def advertised(cfg: ServeConfig) -> str:
    """The host prefill engines of this plan advertise (what the connector works out)."""
    from kvshare_connector.transfer.wire.addresses import advertised_host

    option = cfg.advertise_host or cfg.kv_extra_config.get("advertise_host")
    option = option or cfg.env.get(ADVERTISE_ENV) or os.environ.get(ADVERTISE_ENV)
    return advertised_host(side_channel_host(cfg), option).host


def allow_list(cfg: ServeConfig, side_channels: list[int]) -> list[str]:
    """Decode's ``allowed_prefills``: the ones given, or the side channels (ports) of the
    plan's own prefills at their advertised host."""
    from kvshare_connector.transfer.wire.addresses import host_port

    if cfg.allowed_prefills:
        return list(cfg.allowed_prefills)
    host = advertised(cfg)
    return [host_port(host, port) for port in side_channels]


def check_allowed_prefills(entries: list[str]) -> None:
    """Each entry a ``host:port`` or ``host:first-last`` (a host alone admits every port
    of it: refused here, where the connector would only warn)."""
    from kvshare_connector.transfer.wire.settings import AllowedPrefill, AllowListError

    for entry in entries:
        try:
            parsed = AllowedPrefill.parse(entry)
        except AllowListError as exc:
            raise UsageError(f"--allowed-prefills: {exc}") from None
        if parsed.every_port:
            raise UsageError(
                f"--allowed-prefills {entry!r} names no port: write {entry}:PORT, the "
                "prefill's --side-channel-port (it admits that port and the 63 after it)"
            )


def check(cfg: ServeConfig) -> None:
    """What a role needs before anything starts (raises ``UsageError``)."""
    if cfg.role not in ROLES:
        raise UsageError(f"--role must be one of {ROLES}, got {cfg.role!r}")
    if cfg.allowed_prefills:
        check_allowed_prefills(list(cfg.allowed_prefills))
    elif cfg.role == "decode" and "allowed_prefills" not in cfg.kv_extra_config:
        raise UsageError(
            "serve-pd --role decode needs --allowed-prefills HOST:PORT ...: the side channel "
            "of every prefill it may read from (the prefill host's address and "
            "--side-channel-port, e.g. 10.0.0.5:5600)"
        )
    if cfg.role == "decode" and cfg.kv_both:
        raise UsageError("--kv-both serves both roles: use it without --role")


def check_command_line(args: argparse.Namespace) -> None:
    """No secret on serve-pd's own command line."""
    if any(key == SECRET_ENV for key, _ in args.env):
        raise UsageError(
            f"--env {SECRET_ENV}=... puts the secret on serve-pd's command line, which `ps` "
            f"shows every user: use --secret-file PATH or export {SECRET_ENV}"
        )
    if "side_channel_secret" in (args.kv_extra_config or {}):
        raise UsageError(
            "--kv-extra-config side_channel_secret puts the secret on the engines' command "
            f"lines, which `ps` shows every user: use --secret-file PATH or export {SECRET_ENV}"
        )


def reachable_host(host: str) -> str:
    """The host others dial for a server bound to ``host`` (every interface: the routable
    address)."""
    from kvshare_connector.transfer.wire.addresses import every_interface, routable_address

    return routable_address().host if every_interface(host) else host


def ready_line(deployment: Deployment) -> str:
    """What an operator needs from a role's start: the engines' URLs for the front and, for
    prefill, the side channels decode hosts admit."""
    cfg = deployment.cfg
    host = reachable_host(cfg.host)
    urls = " ".join(f"http://{host}:{e.port}" for e in deployment.engines)
    line = f"kvshare: ready; {cfg.role} engines {urls}"
    if cfg.role == "prefill":
        sides = " ".join(side_channels(cfg, deployment.engines))
        line += f"; decode hosts: --allowed-prefills {sides}; front: kvshare proxy --prefill {urls}"
    else:
        line += f" (front: kvshare proxy ... --decode {urls})"
    return line + f"; logs in {cfg.log_dir}; Ctrl-C stops"


def side_channels(cfg: ServeConfig, engines: list[EngineSpec]) -> list[str]:
    """``host:port`` of each prefill engine's side channel, as decode reaches it."""
    ports = [int(e.env[PORT_ENV]) for e in engines if e.role == "prefill" and PORT_ENV in e.env]
    if not ports:
        return []
    from kvshare_connector.transfer.wire.addresses import host_port

    host = advertised(cfg)
    return [host_port(host, port) for port in ports]


def add_args(p: argparse.ArgumentParser) -> None:
    """serve-pd: which role this host runs, and what crosses hosts."""
    p.add_argument(
        "--role",
        choices=ROLES,
        default="both",
        help="what this host runs: 'prefill' or 'decode' engines only (one command per "
        "host; front them with `kvshare proxy`), or 'both' and the proxy (default)",
    )
    p.add_argument(
        "--side-channel-host",
        default=None,
        help="where prefill side channels listen (VLLM_NIXL_SIDE_CHANNEL_HOST; default: "
        "--host with --role, else localhost); 0.0.0.0 advertises the routable address",
    )
    p.add_argument(
        "--advertise-host",
        default=None,
        help="the address prefill's kv_transfer_params name, which decode dials (default: "
        "the side-channel host, or for 0.0.0.0 the default route's interface address)",
    )
    p.add_argument(
        "--allowed-prefills",
        nargs="+",
        default=None,
        metavar="HOST:PORT",
        help="decode: the prefill side channels it may read from (default: this "
        "deployment's own; needed with --role decode)",
    )
    p.add_argument(
        "--secret-file",
        type=Path,
        default=None,
        help=f"the side-channel secret, one line (else {SECRET_ENV}; the one-host form "
        "makes one); never on a command line",
    )


def config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """ServeConfig's role fields from serve-pd's arguments."""
    return dict(
        role=args.role,
        side_channel_host=args.side_channel_host,
        advertise_host=args.advertise_host,
        allowed_prefills=args.allowed_prefills,
        secret_file=args.secret_file,
    )
