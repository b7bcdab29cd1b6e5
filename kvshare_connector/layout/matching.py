"""Receiving side: match our owners to the peer's, and say exactly what differs if we can't.

Two engines may hold the same logical KV in different memory layouts (per-layer vs
cross-layer blocks, kvcached contiguous vs per-layer): bytes can move between them as
long as the content of a block is laid out in the same physical order inside each dense
segment. Then both sides are cut into the finer of their two segmentations and paired
segment by segment. Anything else (another model, sharing map, block size, dtype, head
geometry, or an incompatible in-block order) is refused before a byte moves.

Two engines can hold identically shaped KV for different models (a fine-tune, another
revision, another KV cache dtype with the same item size): ``EngineIdentity`` carries what
the topology cannot see, as plain values from the vLLM layer, and is compared too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvshare_connector.layout.descriptors import PairedOwner
from kvshare_connector.layout.topology import KVTopology

# Keys of a model config that name where or with what it was loaded, not what it is.
_VOLATILE_CONFIG_KEYS = frozenset(
    {"_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation_autoset"}
)


@dataclass(frozen=True)
class EngineIdentity:
    """What an engine computes KV with, beyond the KV's shape. ``None``: not known (an
    engine that does not say); such a field is not compared."""

    model: str | None = None  # the model name or path the engine loaded
    model_config_hash: str | None = None  # ``config_digest`` of the loaded model config
    dtype: str | None = None  # model dtype, e.g. "bfloat16"
    cache_dtype: str | None = None  # vLLM's cache_config.cache_dtype, e.g. "auto", "fp8"
    block_size: int | None = None  # vLLM's cache_config.block_size
    vllm_version: str | None = None


def config_digest(config: Mapping[str, Any]) -> str:
    """Hash of a model config (``hf_config.to_dict()``) without where it was loaded from:
    two hosts loading the same model from different paths agree."""
    kept = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    text = json.dumps(kept, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def identity_differences(local: EngineIdentity | None, remote: EngineIdentity | None) -> list[str]:
    """Fields both engines state and disagree on (an engine that says nothing: none)."""
    if local is None or remote is None:
        return []
    found = []
    for f in fields(EngineIdentity):
        lv, rv = getattr(local, f.name), getattr(remote, f.name)
        if lv is not None and rv is not None and lv != rv:
            found.append(f"{f.name}: local {lv}, remote {rv}")
    return found


class LayoutMismatch(ValueError):
    """The two sides do not hold the same KV: the message lists every difference."""

    def __init__(self, differences: list[str], local_layout: str, remote_layout: str):
        self.differences = differences
        shown = "\n  - ".join(differences[:20])
        more = f"\n  ... and {len(differences) - 20} more" if len(differences) > 20 else ""
        super().__init__(
            f"KV layouts do not match (local {local_layout}, remote {remote_layout}):"
            f"\n  - {shown}{more}"
        )


def differences(
    local: KVTopology,
    remote: KVTopology,
    local_identity: EngineIdentity | None = None,
    remote_identity: EngineIdentity | None = None,
) -> list[str]:
    """Every way the two sides disagree on what a block holds, local first."""
    found: list[str] = identity_differences(local_identity, remote_identity)
    if len(local.groups) != len(remote.groups):
        found.append(
            f"KV cache group count: local {len(local.groups)}, remote {len(remote.groups)}"
        )
    for lg, rg in zip(local.groups, remote.groups, strict=False):
        for attr in ("kind", "block_size", "num_kv_heads", "head_size", "dtype", "sliding_window"):
            lv, rv = getattr(lg.spec, attr), getattr(rg.spec, attr)
            if lv != rv:
                found.append(f"group {lg.index} {attr}: local {lv}, remote {rv}")
        if lg.layer_names != rg.layer_names:
            only_l = sorted(set(lg.layer_names) - set(rg.layer_names))
            only_r = sorted(set(rg.layer_names) - set(lg.layer_names))
            found.append(
                f"group {lg.index} owner layers differ: only local {only_l or '-'}, "
                f"only remote {only_r or '-'}"
                + ("" if only_l or only_r else " (same layers, other order)")
            )
    for name in sorted(set(local.sharers) | set(remote.sharers)):
        lt, rt = local.sharers.get(name), remote.sharers.get(name)
        if lt != rt:
            found.append(
                f"layer {name}: local {_role(name, lt, local)}, remote {_role(name, rt, remote)}"
            )
    for name in sorted(set(local.owners) & set(remote.owners)):
        lo, ro = local.owners[name].geometry, remote.owners[name].geometry
        if lo.order != ro.order:
            found.append(
                f"layer {name}: block content order differs: local {_order(lo.order)} "
                f"({local.layout}), remote {_order(ro.order)} ({remote.layout})"
            )
    return found


def pair_owners(
    local: KVTopology,
    remote: KVTopology,
    local_identity: EngineIdentity | None = None,
    remote_identity: EngineIdentity | None = None,
) -> list[PairedOwner]:
    """Owners of both sides cut into the same segments, or ``LayoutMismatch``."""
    found = differences(local, remote, local_identity, remote_identity)
    if found:
        raise LayoutMismatch(found, local.layout, remote.layout)
    paired = []
    for name, owner in local.owners.items():
        lg, rg = owner.geometry, remote.owners[name].geometry
        split = max(lg.dense_split, rg.dense_split)
        paired.append(PairedOwner(name, owner.group, lg.with_split(split), rg.with_split(split)))
    return paired


def _role(name: str, target: str | None, topology: KVTopology) -> str:
    if target is not None:
        return f"shares the KV of {target}"
    if name in topology.owners:
        return "owns its KV"
    return "is absent"


def _order(order: tuple[tuple[str, int], ...]) -> str:
    return "(" + ", ".join(f"{label}={size}" for label, size in order) + ")"
