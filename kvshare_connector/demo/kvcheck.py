"""Fill KV blocks with a pattern and check where it landed: the proof of a transfer.

The pattern of a logical block depends on the owner layer's name, the block's position
in the request and each element's index, never on the block id, so two engines with
different block ids (and different memory layouts) can compare logical content. Writes
go through 16-bit integer views: exact bits, no float rounding.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvshare_connector.layout.topology import BLOCK, TOKEN, KVTopology


def _block_slice(view: Any, labels: Sequence[str], block_size: int, block_id: int) -> Any:
    axis = labels.index(BLOCK)
    per_block = block_size // view.shape[labels.index(TOKEN)]
    return view.narrow(axis, block_id * per_block, per_block)


def pattern(owner: str, position: int, shape: Sequence[int], seed: int = 0) -> Any:
    import torch

    numel = 1
    for s in shape:
        numel *= s
    base = (zlib.crc32(owner.encode()) ^ (position * 2654435761) ^ (seed * 97)) & 0xFFFF
    values = (torch.arange(numel, dtype=torch.int64) * 40503 + base) % 65536 - 32768
    return values.to(torch.int16).view(*shape)


def _as_int16(view: Any) -> Any:
    import torch

    if view.element_size() != 2:
        raise ValueError(f"pattern checks need a 16-bit KV dtype, got {view.dtype}")
    return view.view(torch.int16)


def fill(
    kv_caches: Mapping[str, Any],
    topology: KVTopology,
    block_ids: Sequence[Sequence[int]],
    seed: int = 0,
    seeds: Sequence[Sequence[int]] | None = None,
    first_positions: Sequence[int] | None = None,
) -> None:
    """Write the pattern into every owner's blocks of a request (block ids per group).

    ``seeds[g][i]``: the seed of group g's i-th listed block, in place of ``seed`` (a
    pattern keyed by the tokens up to each block, as a causal model's KV is);
    ``first_positions[g]``: the position in the request of group g's first listed block."""
    for g, (group, ids) in enumerate(zip(topology.groups, block_ids, strict=True)):
        first = first_positions[g] if first_positions is not None else 0
        for name in group.layer_names:
            owner = topology.owners[name]
            view = _as_int16(kv_caches[name])
            for i, block in enumerate(ids):
                target = _block_slice(view, owner.labels, owner.spec.block_size, block)
                s = seeds[g][i] if seeds is not None else seed
                target.copy_(pattern(name, first + i, target.shape, s))


def mismatches(
    kv_caches: Mapping[str, Any],
    topology: KVTopology,
    block_ids: Sequence[Sequence[int]],
    layers: Iterable[str] | None = None,
    seed: int = 0,
    first_positions: Sequence[int] | None = None,
    num_tokens: int | None = None,
    seeds: Sequence[Sequence[int]] | None = None,
) -> list[str]:
    """Layers (sharers read through their alias) whose blocks do not hold the pattern.

    ``first_positions[g]``: the position in the request of group g's first listed block
    (a sliding-window group keeps only its tail). ``num_tokens``: compare only the slots
    of the request's tokens (a per-token transfer leaves the rest of a last block alone).
    ``seeds[g][i]``: the seed of group g's i-th listed block (see ``fill``).
    """
    problems = []
    for name in layers if layers is not None else kv_caches:
        owner = topology.owners[topology.resolve(name)]
        view = _as_int16(kv_caches[name])
        first = first_positions[owner.group] if first_positions is not None else 0
        for i, block in enumerate(block_ids[owner.group]):
            position = first + i
            s = seeds[owner.group][i] if seeds is not None else seed
            got = _block_slice(view, owner.labels, owner.spec.block_size, block)
            same = got == pattern(owner.name, position, got.shape, s)
            if num_tokens is not None:
                valid = num_tokens - position * owner.spec.block_size
                same |= _token_index(got, owner.labels) >= valid
            if not bool(same.all()):
                problems.append(f"{name} (group {owner.group}, block {block}, #{position})")
    return problems


def _token_index(block: Any, labels: Sequence[str]) -> Any:
    """Each element's token position inside its logical block (kernel blocks in order)."""
    import torch

    tokens = block.shape[labels.index(TOKEN)]
    shape = [1] * block.dim()
    sub = torch.arange(block.shape[labels.index(BLOCK)])
    shape[labels.index(BLOCK)] = -1
    index = sub.view(shape) * tokens
    shape = [1] * block.dim()
    shape[labels.index(TOKEN)] = -1
    return index + torch.arange(tokens).view(shape)


def nonzero_blocks_outside(
    kv_caches: Mapping[str, Any],
    topology: KVTopology,
    block_ids: Sequence[Sequence[int]],
) -> list[str]:
    """Owner blocks outside the request that are not all zero (a write went astray)."""
    used = {b for ids in block_ids for b in ids}
    problems = []
    for name, owner in topology.owners.items():
        view = _as_int16(kv_caches[name])
        for block in range(topology.num_blocks):
            if block in used:
                continue
            if bool(_block_slice(view, owner.labels, owner.spec.block_size, block).any()):
                problems.append(f"{name} block {block}")
    return problems
