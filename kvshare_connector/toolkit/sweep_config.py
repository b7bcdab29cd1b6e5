"""The sweep's configuration file: one ``SweepEntry`` per configuration, read strictly (an
unknown key, a value out of range or a path that does not exist is named with the file
and the configuration it is in), with the file's ``defaults`` merged under each entry.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvshare_connector.toolkit import checks
from kvshare_connector.toolkit.launcher import LAYOUTS
from kvshare_connector.toolkit.lmeval import EvalSpec

_RANGES: dict[str, checks.Range] = {  # of SweepEntry's numbers
    "block_size": (1, None, False, True),
    "max_model_len": (1, None, False, True),
    "gpu_memory_utilization": (0, 1, True, False),
    "expected_score": (None, None, False, False),
    "tolerance": (0, None, False, False),
    "baseline_tolerance": (0, None, False, False),
    "min_agreement": (0, 1, False, False),
    "ready_timeout": (0, None, True, False),
}


@dataclass
class SweepEntry:
    """One configuration of the sweep."""

    name: str
    model: str | None = None
    tiny_model_config: str | None = None  # build a dummy-weight model dir from this config
    served_model_name: str | None = None
    layout: str = "per_layer"
    kvcached: bool = False
    kvcached_contiguous_layout: bool | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    prefill_gpus: list[str] = field(default_factory=lambda: ["0"])
    decode_gpus: list[str] = field(default_factory=lambda: ["0"])
    expected_score: float | None = None
    tolerance: float = 0.03  # |PD - expected| allowed
    baseline_tolerance: float = 0.0  # |PD - baseline| allowed
    min_agreement: float | None = None  # fraction of identical generations required
    probe: bool = True
    baseline: bool = True
    vllm_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    ready_timeout: float = 900.0
    eval: EvalSpec = field(default_factory=EvalSpec)

    def __post_init__(self) -> None:
        if (self.model is None) == (self.tiny_model_config is None):
            raise ValueError(
                f"config {self.name!r}: give exactly one of model and tiny_model_config"
            )
        if self.layout not in LAYOUTS:
            raise ValueError(f"config {self.name!r}: layout must be one of {LAYOUTS}")
        where = f"config {self.name!r}:"
        for key in ("prefill_gpus", "decode_gpus"):
            gpus = getattr(self, key)
            if not isinstance(gpus, list) or not gpus:
                raise ValueError(f"{where} {key} must be a list of GPU ids like [0], got {gpus!r}")
            setattr(self, key, [str(g) for g in gpus])
        checks.check_fields(self, f"{where} ", _RANGES)

    def server_env(self) -> dict[str, str]:
        env = {k: str(v) for k, v in self.env.items()}
        env["ENABLE_KVCACHED"] = "true" if self.kvcached else "false"
        if self.kvcached and self.kvcached_contiguous_layout is not None:
            env["KVCACHED_CONTIGUOUS_LAYOUT"] = str(self.kvcached_contiguous_layout).lower()
        return env

    def summary(self, model: str) -> dict[str, Any]:
        keys = (
            "layout",
            "kvcached",
            "kvcached_contiguous_layout",
            "block_size",
            "max_model_len",
            "gpu_memory_utilization",
            "prefill_gpus",
            "decode_gpus",
        )
        out = {"model": model, **{k: getattr(self, k) for k in keys}}
        out.update(
            task=self.eval.task,
            num_fewshot=self.eval.num_fewshot,
            api=self.eval.api,
            metric=self.eval.metric,
            vllm_args=self.vllm_args,
        )
        return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _strict(cls: type, data: dict[str, Any], where: str) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
    return cls(**data)


def load_sweep(path: Path) -> list[SweepEntry]:
    """Parse a sweep file; relative paths become relative to the file's directory."""
    text = path.read_text()
    if path.suffix == ".json":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
    else:
        import yaml

        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("configs"), list):
        raise ValueError(f"{path}: expected a mapping with a `configs` list")
    defaults = raw.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ValueError(f"{path}: `defaults` must be a mapping")
    entries = []
    for i, item in enumerate(raw["configs"]):
        if not isinstance(item, dict):
            raise ValueError(f"{path}: configs[{i}] must be a mapping, got {item!r}")
        data = _merge(defaults, item)
        where = f"{path} config {data.get('name', i)!r}"
        try:
            entries.append(_entry(path, data, where))
        except TypeError as exc:  # a value of the wrong kind
            raise ValueError(f"{where}: {exc}") from None
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: configuration names must be unique: {names}")
    return entries


def _entry(path: Path, data: dict[str, Any], where: str) -> SweepEntry:
    """One configuration; its paths resolved against the sweep file and required to exist."""
    eval_data = dict(data.pop("eval", {}) or {})
    inc = eval_data.get("include_path")
    if inc:
        inc = path.parent / inc  # an absolute one stays as it is
        checks.require_dir(inc, f"{where}: eval include_path")
        eval_data["include_path"] = str(inc.resolve())
    tiny = data.get("tiny_model_config")
    if tiny:
        tiny = checks.require_file(path.parent / tiny, f"{where}: tiny_model_config")
        data["tiny_model_config"] = str(tiny.resolve())
    if isinstance(data.get("model"), str):
        data["model"] = checks.check_model(data["model"], f"{where}: model")
    data["eval"] = _strict(EvalSpec, eval_data, where + " eval")
    return _strict(SweepEntry, data, where)
