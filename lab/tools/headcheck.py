"""``kvcheck`` per KV head: fill and check a TP rank's blocks by global head index.

Under tensor parallelism a rank holds some of the model's KV heads; two engines with
different TP sizes hold the same head at different positions of their blocks. The
pattern here depends on the owner layer, the block's position in the request and the
GLOBAL head index (``shard.groups[g].start + local head``), so a check compares each head
slice with what that head must hold, whichever rank it came from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvshare_connector.demo.kvcheck import _as_int16, _block_slice, pattern
from kvshare_connector.layout.sharding import Shard
from kvshare_connector.layout.topology import HEAD, KVTopology


def _heads(view: Any, labels: Sequence[str]) -> tuple[int, int]:
    axis = labels.index(HEAD)
    return axis, view.shape[axis]


def fill_heads(
    kv_caches: Mapping[str, Any],
    topology: KVTopology,
    shard: Shard,
    block_ids: Sequence[Sequence[int]],
    seed: int = 0,
) -> None:
    """Every owner's blocks of a request get the pattern of the global heads they hold."""
    for group, ids in zip(topology.groups, block_ids, strict=True):
        start = shard.groups[group.index].start
        for name in group.layer_names:
            owner = topology.owners[name]
            view = _as_int16(kv_caches[name])
            for position, block in enumerate(ids):
                target = _block_slice(view, owner.labels, owner.spec.block_size, block)
                axis, count = _heads(target, owner.labels)
                for h in range(count):
                    part = target.narrow(axis, h, 1)
                    part.copy_(pattern(f"{name}#h{start + h}", position, part.shape, seed))


def head_mismatches(
    kv_caches: Mapping[str, Any],
    topology: KVTopology,
    shard: Shard,
    block_ids: Sequence[Sequence[int]],
    seed: int = 0,
) -> tuple[int, list[str]]:
    """``(head slices compared, "layer block head" of each that is not its pattern)``;
    sharers are read through their alias, like vLLM's attention reads them."""
    compared, problems = 0, []
    for name in kv_caches:
        owner = topology.owners[topology.resolve(name)]
        start = shard.groups[owner.group].start
        view = _as_int16(kv_caches[name])
        for position, block in enumerate(block_ids[owner.group]):
            got = _block_slice(view, owner.labels, owner.spec.block_size, block)
            axis, count = _heads(got, owner.labels)
            for h in range(count):
                part = got.narrow(axis, h, 1)
                compared += 1
                want = pattern(f"{owner.name}#h{start + h}", position, part.shape, seed)
                if not bool((part == want).all()):
                    problems.append(f"{name} block {block} head {start + h}")
    return compared, problems
