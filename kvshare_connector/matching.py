"""Receiving side: match our owners to the peer's, and say exactly what differs if we can't.

Two engines may hold the same logical KV in different memory layouts (per-layer vs
cross-layer blocks, kvcached contiguous vs per-layer): bytes can move between them as
long as the content of a block is laid out in the same physical order inside each dense
segment. Then both sides are cut into the finer of their two segmentations and paired
segment by segment. Anything else (another model, sharing map, block size, dtype, head
geometry, or an incompatible in-block order) is refused before a byte moves.
"""

from __future__ import annotations

from kvshare_connector.descriptors import PairedOwner
from kvshare_connector.topology import KVTopology


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


def differences(local: KVTopology, remote: KVTopology) -> list[str]:
    """Every way the two sides disagree on what a block holds, local first."""
    found: list[str] = []
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


def pair_owners(local: KVTopology, remote: KVTopology) -> list[PairedOwner]:
    """Owners of both sides cut into the same segments, or ``LayoutMismatch``."""
    found = differences(local, remote)
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
