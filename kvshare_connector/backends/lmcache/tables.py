"""Block tables: checked, and the first position of each group to store or load.

Full attention is stored for every token. A sliding-window group is stored only from the
block holding the first position decode can still attend to (``num_tokens - window``: the
last prompt token, recomputed by decode, attends to ``[n - window, n)``), because vLLM frees
older blocks and they are never read again. Decode writes a sliding group only where it
holds blocks and from the first position prefill stored; it fails if it holds a needed
position that prefill did not store.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvshare_connector.backends.lmcache.errors import LMCacheLoadError, LMCacheStoreError
from kvshare_connector.layout.topology import KVTopology


def cut_tables(
    topology: KVTopology, block_ids: Sequence[Sequence[int]], n: int, error: type[Exception]
) -> list[np.ndarray]:
    """Each group's block table cut to the blocks of ``n`` tokens, checked."""
    groups = topology.groups
    if len(block_ids) != len(groups):
        raise error(
            f"block ids cover {len(block_ids)} KV cache group(s), the layout has {len(groups)}"
        )
    tables = []
    for group, ids in zip(groups, block_ids, strict=True):
        need = -(-n // group.spec.block_size)
        arr = np.asarray(list(ids), dtype=np.int64)
        if arr.size < need:
            raise error(
                f"group {group.index} has {arr.size} block(s) for {n} tokens "
                f"(block size {group.spec.block_size}: {need} needed)"
            )
        arr = arr[:need]
        bad = arr[(arr < 0) | (arr >= topology.num_blocks)]
        if bad.size:
            raise error(
                f"group {group.index}: block id {int(bad[0])} out of range "
                f"[0, {topology.num_blocks})"
            )
        tables.append(arr)
    return tables


def held_from(topology: KVTopology, group: int, table: np.ndarray, error: type[Exception]) -> int:
    """First position whose block is held (null blocks only before it)."""
    held = table != 0
    first = int(np.argmax(held)) if held.any() else table.size
    if not held[first:].all():
        gap = first + int(np.argmin(held[first:]))
        raise error(f"group {group} has the null block at block #{gap}, after held blocks")
    return first * topology.groups[group].spec.block_size


def store_from(topology: KVTopology, group: int, table: np.ndarray, n: int) -> int:
    """First position of a group to store: 0 for full attention; for a sliding window
    the block holding ``n - window``, the first key the last prompt token attends to.
    vLLM frees only blocks wholly before ``computed - window + 1`` (at most ``n - window``
    in the step that computes the prompt's end), so that block is still held."""
    spec = topology.groups[group].spec
    held = held_from(topology, group, table, LMCacheStoreError)
    if spec.sliding_window is None:
        if held > 0:
            raise LMCacheStoreError(
                f"store: full-attention group {group} no longer holds positions < {held}"
            )
        return 0
    needed = max(0, n - spec.sliding_window) // spec.block_size * spec.block_size
    return max(held, needed)


def load_from(
    topology: KVTopology,
    request_id: str,
    group: int,
    table: np.ndarray,
    n: int,
    num_computed: int,
    stored: int,
) -> int:
    """First position of a group to write: where this engine holds blocks and has not
    computed the tokens itself, but never before what prefill stored (``stored``); a
    position this engine still attends to that prefill did not store is an error."""
    spec = topology.groups[group].spec
    start = max(num_computed, held_from(topology, group, table, LMCacheLoadError))
    needed = 0 if spec.sliding_window is None else max(0, n - spec.sliding_window)
    if stored > max(start, needed):
        raise LMCacheLoadError(
            f"request {request_id}: prefill stored group {group} from position {stored}, "
            f"this engine needs it from {max(start, needed)}"
        )
    return max(start, stored)
