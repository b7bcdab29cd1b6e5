"""Small helpers shared by tests."""

from __future__ import annotations

import ctypes

import numpy as np


def disjoint_block_ids(num_blocks: int, counts: list[int], seed: int) -> list[list[int]]:
    """Block ids per group as a shared block pool hands them out: distinct across groups,
    not sorted, not contiguous (block 0 is vLLM's null block)."""
    rng = np.random.default_rng(seed)
    pool = rng.permutation(np.arange(1, num_blocks))
    out, start = [], 0
    for count in counts:
        out.append([int(b) for b in pool[start : start + count]])
        start += count
    return out


def contiguous_block_ids(counts: list[int], start: int = 1) -> list[list[int]]:
    out = []
    for count in counts:
        out.append(list(range(start, start + count)))
        start += count
    return out


def memmove_rows(dst_rows: np.ndarray, src_rows: np.ndarray) -> None:
    """Copy every (addr, len) row of ``src_rows`` to the matching row of ``dst_rows``."""
    assert dst_rows.shape == src_rows.shape
    assert (dst_rows[:, 1] == src_rows[:, 1]).all()
    for (dst, length, _), (src, _, _) in zip(dst_rows.tolist(), src_rows.tolist(), strict=True):
        ctypes.memmove(dst, src, length)


def zero_regions(topology) -> None:
    for region in topology.regions:
        ctypes.memset(region.addr, 0, region.nbytes)
