"""The connector's options: ``kv_connector_extra_config`` parsed once per engine, passed whole.

Every option is a field of ``ConnectorOptions`` with its default, the environment variable
that sets it where there is one (the extra config wins over it), and a line of help; the
README's option table is checked against these fields (tests/test_options.py). A value of
the wrong type or out of range fails at engine start, naming the option; an unknown key is
warned about (the same config may carry other tools' keys).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvshare_connector.common.log import get_logger
from kvshare_connector.transfer.wire.kv_params import host_problem
from kvshare_connector.transfer.wire.settings import AllowedPrefill, AllowListError

logger = get_logger(__name__)

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
_WARNED_EVERY_PORT: set[str] = set()  # allow-list entries without a port, warned once each


def _option(default: Any, help: str, env: str | None = None) -> Any:
    return field(default=default, metadata={"help": help, "env": env})


class OptionError(ValueError):
    """An option of ``kv_connector_extra_config`` (or its variable) is not usable."""


@dataclass(frozen=True)
class ConnectorOptions:
    backend: str = _option("nixl", "How KV travels: `nixl` (decode READs prefill's blocks) "
                           "or `lmcache` (through an LMCache server, docs/lmcache.md).")
    kv_lease_duration: float = _option(30.0, "Seconds prefill keeps a finished request's "
                                       "blocks for decode (freed earlier once read).")
    handshake_timeout_s: float = _option(10.0, "Bound on each side-channel ask (handshake, "
                                         "claim) before the request is computed locally.")
    transfer_timeout_s: float = _option(60.0, "Bound on each READ before the request is "
                                        "computed locally.")
    cross_layer_blocks: bool | None = _option(None, "vLLM 0.26: ask for the cross-layer "
                                              "blocks tensor (default on, off under kvcached); "
                                              "vLLM 0.33/0.34: ask for the block-major layout "
                                              "(default off).")
    staging_mib: float = _option(512.0, "Staging area per engine for packed transfer "
                                 "(a request read as a few large runs); 0: block by block.")
    verify_kv: bool | None = _option(None, "Digest every loaded layer-block on both sides; "
                                     "a load whose KV differs from prefill's fails. Default "
                                     "(none): on with backend `nixl`, off with `lmcache`; "
                                     "`false` on both engines turns it off.",
                                     "KVSHARE_VERIFY_KV")
    side_channel_secret: str | None = _option(None, "HMAC key of every side-channel message, "
                                              "the same on every engine (docs/security.md).",
                                              "KVSHARE_SIDE_CHANNEL_SECRET")
    side_channel_insecure: bool = _option(False, "Let prefill's side channel listen beyond "
                                          "loopback without a secret.",
                                          "KVSHARE_SIDE_CHANNEL_INSECURE")
    advertise_host: str | None = _option(None, "Prefill: the host its kv_transfer_params "
                                         "name, which decode dials. Default: "
                                         "VLLM_NIXL_SIDE_CHANNEL_HOST, or where that is "
                                         "every interface (`0.0.0.0`, `::`) the address of "
                                         "the default route's interface "
                                         "(docs/multi_host.md).", "KVSHARE_ADVERTISE_HOST")
    allowed_prefills: tuple[str, ...] | None = _option(None, "Decode: the only prefill side "
                                                       "channels it may connect to, each "
                                                       "`host:port` (that port and the 63 "
                                                       "after it, where a TP prefill's "
                                                       "ranks serve), `host:first-last`, "
                                                       "or `host` (every port: warned). "
                                                       "Hosts compared as written, not "
                                                       "resolved (docs/configuration.md).")
    ucx_lane: str = _option("auto", "`auto`: set UCX's fast-lane settings before NIXL starts: "
                            "UCX_NET_DEVICES to loopback where every side channel is on "
                            "loopback, larger tcp segments and a mutex where one reaches "
                            "beyond (docs/performance.md; your own UCX_* values win); "
                            "`off`: leave UCX's defaults.", "KVSHARE_UCX_LANE")
    lane_probe_mib: float = _option(8.0, "Decode READs this much from each new prefill to "
                                    "check and measure the lane; 0: no probe.")
    nixl_progress_thread: bool = _option(True, "NIXL's background progress thread.",
                                         "KVSHARE_NIXL_PROGRESS_THREAD")
    nixl_progress_poll_ms: float = _option(1.0, "The progress thread sleeps on UCX's events "
                                           "and looks anyway after this long (whole ms); "
                                           "0: NIXL's own busy poll, a core per engine.",
                                           "KVSHARE_NIXL_PROGRESS_POLL_MS")
    switch_interval_ms: float = _option(1.0, "Prefill: Python's thread switch interval in "
                                        "the engine process (its 5 ms default is what a "
                                        "claim waits for the GIL behind the engine thread); "
                                        "0: leave Python's.", "KVSHARE_SWITCH_INTERVAL_MS")
    layer_nudge_ms: float = _option(2.0, "Decode: while reads are in flight, advance them "
                                    "from inside the forward (vLLM's per-layer hook) at "
                                    "most this often; 0: only at step boundaries.")
    read_log: str | None = _option(None, "A path: decode appends one JSON line per finished "
                                   "read (bytes, descriptors, phase timeline).")
    lmcache: Mapping[str, Any] = _option(None, "The LMCache backend's own options "
                                         "(docs/lmcache.md).")  # fmt: skip

    @classmethod
    def parse(
        cls, extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
    ) -> ConnectorOptions:
        extra = dict(extra or {})
        environ = os.environ if environ is None else environ
        known = {f.name: f for f in dataclasses.fields(cls)}
        for key in extra:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                logger.warning(
                    "kv_connector_extra_config: unknown option %r ignored%s",
                    key,
                    f" (did you mean {close[0]!r}?)" if close else "",
                )
        values = {}
        for name, f in known.items():
            env = f.metadata["env"]
            if name in extra:
                raw, source = extra[name], f"kv_connector_extra_config.{name}"
            elif env and environ.get(env, "") != "":
                raw, source = environ[env], env
            else:
                continue
            values[name] = _convert(name, raw, source)
        return cls(**values)

    def table(self) -> list[tuple[str, str, str, str]]:
        """(name, default, environment variable, help) of every option."""
        return [
            (f.name, _shown(f.default), f.metadata["env"] or "", f.metadata["help"])
            for f in dataclasses.fields(self)
        ]

    @classmethod
    def markdown_table(cls) -> str:
        """The option table of README.md and docs/configuration.md (a test checks both)."""
        lines = ["| option | default | env | what it does |", "|---|---|---|---|"]
        for name, default, env, help_text in cls().table():
            env_cell = f"`{env}`" if env else ""
            lines.append(f"| `{name}` | {default} | {env_cell} | {help_text} |")
        return "\n".join(lines)

    @property
    def secret(self) -> bytes | None:
        return self.side_channel_secret.encode() if self.side_channel_secret else None

    @property
    def verifies(self) -> bool:
        """``verify_kv`` as it applies to the nixl backend (on unless turned off)."""
        return self.verify_kv is not False

    @property
    def staging_bytes(self) -> int:
        return int(self.staging_mib * 2**20)

    @property
    def lane_probe_bytes(self) -> int:
        return int(self.lane_probe_mib * 2**20)

    @property
    def nixl_progress(self) -> dict[str, Any]:
        """``NixlTransport``'s progress-thread arguments."""
        return {
            "progress_thread": self.nixl_progress_thread,
            "progress_poll_ms": self.nixl_progress_poll_ms,
        }


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def _flag(raw: Any, source: str) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str | int) and str(raw).strip().lower() in (*_TRUE, *_FALSE):
        return str(raw).strip().lower() in _TRUE
    raise OptionError(f"{source} must be true or false, got {raw!r}")


def _number(raw: Any, source: str, positive: bool) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise OptionError(f"{source} must be a number, got {raw!r}") from None
    if value != value or value < 0 or (positive and value == 0) or value == float("inf"):
        raise OptionError(
            f"{source} must be {'greater than 0' if positive else '0 or more'}, got {raw!r}"
        )
    return value


_POSITIVE = ("kv_lease_duration", "handshake_timeout_s", "transfer_timeout_s")
_CHOICES = {"ucx_lane": ("auto", "off")}  # ``backend`` is checked by the registry


def _convert(name: str, raw: Any, source: str) -> Any:
    if name in ("side_channel_insecure", "nixl_progress_thread"):
        return _flag(raw, source)
    if name in ("cross_layer_blocks", "verify_kv"):
        return None if raw is None else _flag(raw, source)
    if name in _POSITIVE or name in ("staging_mib", "lane_probe_mib", "switch_interval_ms",
                                     "layer_nudge_ms", "nixl_progress_poll_ms"):
        return _number(raw, source, positive=name in _POSITIVE)
    if name in _CHOICES:
        if raw not in _CHOICES[name]:
            raise OptionError(f"{source} must be one of {_CHOICES[name]}, got {raw!r}")
        return raw
    if name == "allowed_prefills":
        return _allow_list(raw, source)
    if name == "advertise_host":
        why = host_problem(raw) if isinstance(raw, str) else "not a string"
        if why is not None:
            raise OptionError(f"{source} must be one host's name or address: {raw!r} is {why}")
        return raw
    if name == "lmcache":
        if not isinstance(raw, Mapping):
            raise OptionError(f"{source} must be an object, got {type(raw).__name__}")
        return dict(raw)
    if name == "backend":
        if not isinstance(raw, str):
            raise OptionError(f"{source} must be a backend name, got {raw!r}")
        return raw
    if raw is None or isinstance(raw, str):  # side_channel_secret, read_log
        return raw or None
    raise OptionError(f"{source} must be a string, got {type(raw).__name__}")


def _allow_list(raw: Any, source: str) -> tuple[str, ...]:
    """The ``allowed_prefills`` entries, each checked (``transfer.wire.settings.AllowedPrefill``);
    one without a port is warned about once per process: it admits every port of its host,
    so on a shared host any process listening there passes for a prefill."""
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list | tuple) or not items:
        raise OptionError(f"{source} must be a list of host:port, host:first-last or host strings")
    for i, item in enumerate(items):
        try:
            entry = AllowedPrefill.parse(item)
        except AllowListError as exc:
            raise OptionError(f"{source}[{i}] {exc}") from None
        if entry.every_port and item not in _WARNED_EVERY_PORT:
            _WARNED_EVERY_PORT.add(item)
            logger.warning(
                "%s[%d] %r has no port: decode may connect to every port of %s, where any "
                "process listening can pose as a prefill; write %s:PORT (that port and the "
                "63 after it, a TP prefill's ranks) or %s:FIRST-LAST",
                source, i, item, item, item, item,
            )  # fmt: skip
    return tuple(items)
