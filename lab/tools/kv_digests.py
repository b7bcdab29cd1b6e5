"""Per-block KV digests of a request and their comparison: what ``kv_probe``'s connectors
record on each side and what the GPU checks (``lab.gpu_checks.kv_exact``, ``kv_exact_tp``) compare.

Digests cover the request's token slots only (LMCache moves tokens, not the stale tail of a
last block), in one dim order (block, token, head, kv, dim, content), so two engines with
different physical layouts compare. Under tensor parallelism each rank digests one KV head
at a time and names the digest by the GLOBAL head index (``layer#h<g>``, ``head_record``),
so engines of different TP sizes compare head by head; ``merge_ranks`` joins one request's
per-rank records into the record ``compare`` reads. Pure torch: the same code runs in the
CPU tests and on the GPU.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvshare_connector.layout.topology import BLOCK, CONTENT, DIM, HEAD, KV, TOKEN, KVTopology

NULL_BLOCK = 0
CANONICAL = (BLOCK, TOKEN, HEAD, KV, DIM, CONTENT)


def positions_of(ids: Sequence[int], num_tokens: int, block_size: int) -> list[int]:
    """Position in the request of each listed block: a table from position 0 (as long as
    the request needs, or longer) or a tail clipped to a sliding window."""
    need = math.ceil(num_tokens / block_size)
    if len(ids) >= need:
        return list(range(need))
    return list(range(need - len(ids), need))


def layer_digests(
    view: Any,
    labels: Sequence[str],
    block_size: int,
    block_ids: Sequence[int],
    positions: Sequence[int],
    num_tokens: int,
) -> tuple[list[str | None], int]:
    """sha256 of each listed block's token slots < ``num_tokens`` in one layer's logical
    view (None for the null block), and the bytes of one token slot. One gather and one
    copy to the host per layer."""
    import torch

    b_axis, t_axis = labels.index(BLOCK), labels.index(TOKEN)
    kernel_tokens = view.shape[t_axis]
    per_block = block_size // kernel_tokens
    real = [(i, b) for i, b in enumerate(block_ids[: len(positions)]) if b != NULL_BLOCK]
    out: list[str | None] = [None] * len(positions)
    token_bytes = math.prod(view.shape) // view.shape[b_axis] // kernel_tokens
    token_bytes *= view.element_size()
    if not real:
        return out, token_bytes
    kernel = [b * per_block + k for _, b in real for k in range(per_block)]
    index = torch.tensor(kernel, dtype=torch.long, device=view.device)
    rest = [labels.index(label) for label in CANONICAL[2:] if label in labels]
    gathered = view.index_select(b_axis, index).permute(b_axis, t_axis, *rest)
    host = gathered.reshape(len(real), per_block * kernel_tokens, *gathered.shape[2:]).cpu()
    for row, (i, _) in enumerate(real):
        valid = min(block_size, num_tokens - positions[i] * block_size)
        data = host[row, :valid].contiguous().view(torch.uint8).numpy()
        out[i] = hashlib.sha256(data.tobytes()).hexdigest()
    return out, token_bytes


def request_record(
    topology: KVTopology,
    views: Mapping[str, Any],
    sharer_views: Mapping[str, Any],
    groups: Sequence[Sequence[int]],
    num_tokens: int,
    **fields: Any,
) -> dict[str, Any]:
    """One side's digests of one request: every owner layer's blocks (per KV cache group)
    and every sharer's blocks read through the tensor given for it."""
    started = time.perf_counter()
    positions = {
        g.index: positions_of(groups[g.index], num_tokens, g.spec.block_size)
        for g in topology.groups
    }
    record: dict[str, Any] = {
        **fields,
        "num_tokens": num_tokens,
        "layout": topology.layout,
        "groups": {g: list(groups[g][: len(p)]) for g, p in positions.items()},
        "positions": positions,
        "group_specs": {
            g.index: {"block_size": g.spec.block_size, "sliding_window": g.spec.sliding_window}
            for g in topology.groups
        },
        "layer_groups": {name: o.group for name, o in topology.owners.items()},
        "num_sharers": len(topology.sharers),
        "digests": {},
        "token_bytes": {},
        "sharers": {},
    }
    for name, owner in topology.owners.items():
        g = owner.group
        record["digests"][name], record["token_bytes"][name] = layer_digests(
            views[name], owner.labels, owner.spec.block_size, groups[g], positions[g], num_tokens
        )
    for sharer, target in topology.sharers.items():
        if sharer not in sharer_views:
            continue
        owner = topology.owners[target]
        g = owner.group
        digests, _ = layer_digests(
            sharer_views[sharer],
            owner.labels,
            owner.spec.block_size,
            groups[g],
            positions[g],
            num_tokens,
        )
        record["sharers"][sharer] = {"target": target, "digests": digests}
    record["seconds"] = round(time.perf_counter() - started, 4)
    return record


def scrambled(block_ids: Sequence[Sequence[int]]) -> tuple[list[int], ...]:
    """Each group's non-null block ids rotated by one among their places (null blocks
    stay put, so a load's null-block checks still pass): every block moves when a
    group has two or more."""
    out = []
    for ids in block_ids:
        places = [i for i, b in enumerate(ids) if b != NULL_BLOCK]
        real = [ids[i] for i in places]
        rotated = real[1:] + real[:1]
        new = list(ids)
        for i, b in zip(places, rotated, strict=True):
            new[i] = b
        out.append(new)
    return tuple(out)


# ---- comparison ---------------------------------------------------------------------------


def needed_from(num_tokens: int, spec: Mapping[str, Any]) -> int:
    """First position a sliding-window group needs for the prompt's last token (LMCache
    stores from there); 0 for full attention."""
    window = spec.get("sliding_window")
    return max(0, num_tokens - window) // spec["block_size"] if window else 0


def compare(
    prefill: Mapping[str, Any],
    decode: Mapping[str, Any],
    needed_only: bool = False,
    max_locations: int = 5,
) -> dict[str, Any]:
    """Decode's digests against prefill's, per owner layer and block, aligned by position
    in the request (blocks tail-aligned per group, null block 0 on either side skipped);
    and each sharer against its target on each side. ``needed_only``: sliding-window
    groups from the first position the last token attends to (what LMCache moves)."""
    prefill, decode = json.loads(json.dumps(prefill)), json.loads(json.dumps(decode))
    result: dict[str, Any] = {
        "request_id": decode.get("request_id"),
        "remote_request_id": decode.get("remote_request_id"),
        "num_tokens": decode.get("num_tokens"),
        "blocks_compared": 0,
        "bytes_compared": 0,
        "mismatches": 0,
        "locations": [],
        "groups_without_blocks": [],
        "sharers_checked": 0,
        "sharer_mismatches": 0,
        "sharer_locations": [],
        "sharers_missing": {  # sharers no tensor was found for (not checked)
            name: side.get("num_sharers", 0) - len(side.get("sharers", {}))
            for name, side in (("prefill", prefill), ("decode", decode))
        },
        "problems": [],
    }
    if prefill.get("num_tokens") != decode.get("num_tokens"):
        result["problems"].append(
            f"prompt lengths differ: prefill {prefill.get('num_tokens')}, "
            f"decode {decode.get('num_tokens')}"
        )
        return result
    n = int(decode["num_tokens"])
    pairs: dict[str, list[tuple[int, int, int, int, int]]] = {}
    for g, spec in decode["group_specs"].items():
        first = needed_from(n, spec) if needed_only else 0
        d_at, p_at = _by_position(decode, g), _by_position(prefill, g)
        common = sorted(p for p in d_at.keys() & p_at.keys() if p >= first)
        # (position, decode index, prefill index, decode block, prefill block)
        pairs[g] = [(p, d_at[p][0], p_at[p][0], d_at[p][1], p_at[p][1]) for p in common]
        if not common:
            result["groups_without_blocks"].append(int(g))
    for layer, group in decode["layer_groups"].items():
        g = str(group)
        mine, theirs = decode["digests"].get(layer), prefill["digests"].get(layer)
        if mine is None or theirs is None:
            result["problems"].append(f"layer {layer} missing on one side")
            continue
        block_size = decode["group_specs"][g]["block_size"]
        for pos, d_i, p_i, block, remote in pairs[g]:
            result["blocks_compared"] += 1
            valid = min(block_size, n - pos * block_size)
            result["bytes_compared"] += valid * decode["token_bytes"][layer]
            if mine[d_i] != theirs[p_i]:
                result["mismatches"] += 1
                if len(result["locations"]) < max_locations:
                    result["locations"].append(
                        f"layer {layer}, group {g}, block {block} (position {pos}; "
                        f"prefill block {remote})"
                    )
    for side in (prefill, decode):
        for sharer, entry in side.get("sharers", {}).items():
            result["sharers_checked"] += 1
            if entry["digests"] != side["digests"].get(entry["target"]):
                result["sharer_mismatches"] += 1
                if len(result["sharer_locations"]) < max_locations:
                    result["sharer_locations"].append(
                        f"{side.get('side')}: {sharer} != its target {entry['target']}"
                    )
    return result


def _by_position(record: Mapping[str, Any], g: str) -> dict[int, tuple[int, int]]:
    """Position -> (index in the record's lists, block id), null blocks left out."""
    pairs = zip(record["positions"][g], record["groups"][g], strict=True)
    return {p: (i, b) for i, (p, b) in enumerate(pairs) if b != NULL_BLOCK}


# ---- tensor parallelism: per-head records -----------------------------------------------


def rank_path(out: str | Path, rank: int) -> Path:
    path = Path(out)
    return path.with_name(f"{path.stem}.r{rank}{path.suffix}")


def head_record(
    topology: Any,
    shard: Any,
    views: Mapping[str, Any],
    sharer_views: Mapping[str, Any],
    groups: Sequence[Sequence[int]],
    num_tokens: int,
    **fields: Any,
) -> dict[str, Any]:
    """``request_record`` one local head at a time, keyed ``layer#h<global>``."""
    counts = {g.count for g in shard.groups}
    if len(counts) != 1:
        raise ValueError(f"per-head digests need one head count per rank, got {counts}")
    merged: dict[str, Any] | None = None
    for h in range(counts.pop()):
        record = request_record(
            topology,
            {n: _head(v, topology, n, h) for n, v in views.items()},
            {n: _head(v, topology, n, h) for n, v in sharer_views.items()},
            groups,
            num_tokens,
            tp_rank=shard.tp_rank,
            tp_size=shard.tp_size,
            **fields,
        )
        merged = _rename_heads(record, shard, h, merged)
    assert merged is not None
    return merged


def _head(view: Any, topology: Any, name: str, h: int) -> Any:
    owner = topology.owners[topology.resolve(name)]
    return view.narrow(owner.labels.index(HEAD), h, 1)


def _rename_heads(
    record: dict[str, Any], shard: Any, h: int, into: dict[str, Any] | None
) -> dict[str, Any]:
    """``record``'s per-layer entries as ``layer#h<global head>`` (added to ``into``)."""
    groups = record["layer_groups"]
    if into is None:
        empty = {"digests": {}, "token_bytes": {}, "layer_groups": {}, "sharers": {}}
        into = {**record, **empty, "num_sharers": 0, "seconds": 0.0}
    out = into
    for name, digests in record["digests"].items():
        key = f"{name}#h{shard.groups[groups[name]].start + h}"
        out["digests"][key] = digests
        out["token_bytes"][key] = record["token_bytes"][name]
        out["layer_groups"][key] = groups[name]
    for sharer, entry in record["sharers"].items():
        head = shard.groups[groups[entry["target"]]].start + h
        out["sharers"][f"{sharer}#h{head}"] = {
            "target": f"{entry['target']}#h{head}",
            "digests": entry["digests"],
        }
    out["num_sharers"] += record["num_sharers"]
    out["seconds"] += record["seconds"]
    return out


def merge_ranks(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One side's records of one request, from each rank, as one record; a head several
    ranks hold (replicated) keeps the first rank's digests (pass the ranks in the order
    to prefer). ``replica_mismatches``: such heads whose digests differ between ranks."""
    first = records[0]
    out = json.loads(json.dumps(first))
    out["replica_mismatches"] = 0
    for record in records[1:]:
        if record["groups"] != first["groups"] or record["num_tokens"] != first["num_tokens"]:
            raise ValueError("ranks disagree on the request's blocks")
        for key, digests in record["digests"].items():
            if key in out["digests"]:
                out["replica_mismatches"] += out["digests"][key] != digests
                continue
            out["digests"][key] = digests
            out["token_bytes"][key] = record["token_bytes"][key]
            out["layer_groups"][key] = record["layer_groups"][key]
        for key, entry in record["sharers"].items():
            out["sharers"].setdefault(key, entry)
        out["seconds"] = out.get("seconds", 0) + record.get("seconds", 0)
    # sharers no tensor was found for, on any rank, stay counted as missing
    missing = sum(r["num_sharers"] - len(r["sharers"]) for r in records)
    out["num_sharers"] = len(out["sharers"]) + missing
    return out
