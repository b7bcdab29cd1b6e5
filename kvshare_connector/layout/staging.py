"""Where each byte of a request goes when it travels packed: the staged layout, pure numpy.

A NIXL READ costs a few microseconds per descriptor whatever its size (measured between two
H200s over cuda_ipc: 2.9 GB/s with 16 KiB descriptors, 190-250 GB/s with 16 MiB ones), and a
request's KV is thousands of block-sized pieces scattered over the owner layers. Packed
transfer gathers them into one contiguous staging area on prefill, READs that as a few large
descriptors, and scatters it on decode. It also lets memory that cannot be exported over
CUDA IPC (kvcached's cuMemCreate pages) travel at NVLink speed: only the staging areas are
read remotely.

Both sides must agree on the packed order without sending it: it is the prefill rows of the
request (``request_descriptors`` of the held block ids) sorted by address, with runs that
touch merged. Prefill computes it from its topology; decode from prefill's topology, which
it has from the handshake. Decode may read a subset (a local prefix-cache hit leaves only
the tail): each of its remote runs is located in the packed order by address.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvshare_connector.layout.descriptors import request_descriptors
from kvshare_connector.layout.topology import KVTopology


class StagingError(ValueError):
    """Runs that do not lie inside the packed layout (the sides disagree on the request)."""


@dataclass(frozen=True)
class PackedLayout:
    """Sorted, merged source runs of one request and their offsets in the packed area."""

    addr: np.ndarray  # int64, ascending run starts
    length: np.ndarray  # int64
    offset: np.ndarray  # int64, where each run starts in the packed area
    device: np.ndarray  # int64
    nbytes: int

    @classmethod
    def of(cls, rows: np.ndarray) -> PackedLayout:
        """From ``(addr, len, device)`` rows, in any order (adjacent runs merge)."""
        if rows.size == 0:
            empty = np.zeros(0, dtype=np.int64)
            return cls(empty, empty, empty, empty, 0)
        order = np.lexsort((rows[:, 0].astype(np.int64), rows[:, 2].astype(np.int64)))
        addr = rows[order, 0].astype(np.int64)
        length = rows[order, 1].astype(np.int64)
        device = rows[order, 2].astype(np.int64)
        ends = addr + length
        if np.any((addr[1:] < ends[:-1]) & (device[1:] == device[:-1])):
            raise StagingError("the request's source runs overlap")
        joins = (addr[1:] == ends[:-1]) & (device[1:] == device[:-1])
        starts = np.flatnonzero(np.concatenate(([True], ~joins)))
        merged_len = np.add.reduceat(length, starts)
        offset = np.concatenate(([0], np.cumsum(merged_len)[:-1])).astype(np.int64)
        return cls(addr[starts], merged_len, offset, device[starts], int(merged_len.sum()))

    def locate(self, rows: np.ndarray) -> np.ndarray:
        """Packed offset of each ``(addr, len, device)`` row; every row must lie in one run."""
        addr = rows[:, 0].astype(np.int64)
        length = rows[:, 1].astype(np.int64)
        device = rows[:, 2].astype(np.int64)
        run = np.searchsorted(self.addr, addr, side="right") - 1
        ok = run >= 0
        safe = np.where(ok, run, 0)
        ok &= self.device[safe] == device
        ok &= addr + length <= self.addr[safe] + self.length[safe]
        if not np.all(ok):
            bad = int(np.flatnonzero(~ok)[0])
            raise StagingError(
                f"run at {addr[bad]:#x} (+{length[bad]}) is not part of the packed request"
            )
        return self.offset[safe] + (addr - self.addr[safe])


@dataclass(frozen=True)
class PackedRead:
    """Decode's plan for one packed request.

    ``read_remote``/``read_local``: (packed offset, len) runs to READ from prefill's packed
    area into decode's (the same lengths, merged where both sides continue). ``scatter``:
    (local addr, local packed offset, len, device) runs to copy out of decode's packed area
    into its blocks once the READ is done.
    """

    read_remote: np.ndarray  # int64 N x 2
    read_local: np.ndarray  # int64 N x 2
    scatter: np.ndarray  # int64 M x 4
    nbytes: int  # bytes decode receives

    @staticmethod
    def rows(runs: np.ndarray, base: int, device_id: int) -> np.ndarray:
        """``(offset, len)`` runs of a staging slot at ``base`` as transport rows."""
        rows = np.empty((len(runs), 3), dtype=np.uint64)
        rows[:, 0] = base + runs[:, 0]
        rows[:, 1] = runs[:, 1]
        rows[:, 2] = max(device_id, 0)  # NIXL wants device 0 for host memory
        return rows


def packed_read(
    layout: PackedLayout, local_rows: np.ndarray, remote_rows: np.ndarray
) -> PackedRead:
    """Pair decode's rows with their place in prefill's packed area.

    ``local_rows``/``remote_rows`` are ``transfer_descriptors``' matching rows. Decode packs
    what it receives in prefill's packed order, so the READ is a few large runs even when
    decode's blocks are scattered.
    """
    if local_rows.shape != remote_rows.shape:
        raise StagingError("local and remote rows differ in shape")
    if local_rows.size == 0:
        empty = np.zeros((0, 2), dtype=np.int64)
        return PackedRead(empty, empty.copy(), np.zeros((0, 4), dtype=np.int64), 0)
    remote_off = layout.locate(remote_rows)
    order = np.argsort(remote_off, kind="stable")
    remote_off = remote_off[order]
    length = local_rows[order, 1].astype(np.int64)
    local_off = np.concatenate(([0], np.cumsum(length)[:-1])).astype(np.int64)
    # Local packed offsets are dense by construction; a READ run breaks where prefill's don't.
    breaks = remote_off[1:] != remote_off[:-1] + length[:-1]
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    run_len = np.add.reduceat(length, starts)
    read_remote = np.stack([remote_off[starts], run_len], axis=1)
    read_local = np.stack([local_off[starts], run_len], axis=1)
    scatter = np.stack(
        [
            local_rows[order, 0].astype(np.int64),
            local_off,
            length,
            local_rows[order, 2].astype(np.int64),
        ],
        axis=1,
    )
    return PackedRead(read_remote, read_local, scatter, int(length.sum()))


def word_size(offsets: np.ndarray, lengths: np.ndarray, limit: int = 4096) -> int:
    """The largest power of two (up to ``limit``) dividing every offset and length: the unit
    a gather or scatter kernel can move without splitting a run."""
    values = np.concatenate([offsets.astype(np.int64), lengths.astype(np.int64)])
    word = limit
    while word > 1 and np.any(values % word):
        word //= 2
    return word


def word_indices(starts: np.ndarray, lengths: np.ndarray, word: int) -> np.ndarray:
    """Every word of every run, in run order: ``starts``/``lengths`` in bytes."""
    counts = lengths // word
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    first = starts // word
    # arange per run without a Python loop: a ramp reset at every run's start.
    run_starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    ramp = np.arange(total, dtype=np.int64) - np.repeat(run_starts, counts)
    return np.repeat(first, counts) + ramp


def packed_layout_of(prefill: KVTopology, held_block_ids: Sequence[Sequence[int]]) -> PackedLayout:
    """The order prefill packs a request in, from its topology and the request's held
    blocks (null blocks never travel): decode can know it before prefill answers."""
    held = [[b for b in ids if b] for ids in held_block_ids]
    return PackedLayout.of(request_descriptors(prefill, held))


def packed_read_of(
    prefill: KVTopology,
    held_block_ids: Sequence[Sequence[int]],
    packed_nbytes: int,
    local_rows: np.ndarray,
    remote_rows: np.ndarray,
) -> PackedRead:
    """Decode's plan for a request prefill packed: the packed order from prefill's topology
    and held blocks, checked against the size prefill reports (another size means the two
    sides disagree on the request)."""
    layout = packed_layout_of(prefill, held_block_ids)
    if layout.nbytes != packed_nbytes:
        raise StagingError(
            f"prefill packed {packed_nbytes} bytes, its layout and held block ids give "
            f"{layout.nbytes}"
        )
    return packed_read(layout, local_rows, remote_rows)
