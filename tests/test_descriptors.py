"""Descriptors checked through memory: copy the bytes they name, then read the KV back."""

from __future__ import annotations

import numpy as np
import pytest

from kvshare_connector.demo import kvcheck
from kvshare_connector.demo.cpu_stack import build_cpu_stack, topology_of
from kvshare_connector.layout.descriptors import (
    DescriptorError,
    request_descriptors,
    transfer_descriptors,
)
from kvshare_connector.layout.matching import pair_owners

from .support.blockutil import disjoint_block_ids, memmove_rows, zero_regions

CASES = [
    ("gemma4_e2b_shape", "per_layer"),
    ("g4tiny", "per_layer"),
    ("g4uniform", "cross_layer"),
    ("g4uniform", "per_layer"),
    ("gemma4_e2b_shape", "kvcached_contiguous"),
    ("gemma4_e2b_shape", "kvcached_per_layer"),
]


def fresh(model: str, layout: str):
    stack = build_cpu_stack(model, layout, kv_bytes=32 << 20, max_model_len=1024)
    return stack, topology_of(stack)


def request_ids(topology, seed):
    counts = [5 + 3 * g for g in range(len(topology.groups))]  # a different length per group
    return disjoint_block_ids(topology.num_blocks, counts, seed)


def _region_of(topology, addr: int):
    return next(r for r in topology.regions if r.addr <= addr < r.addr + r.nbytes)


def translate(rows: np.ndarray, src, dst) -> np.ndarray:
    """The same offsets inside the matching region of an identically laid out engine.

    Regions are paired through the owner layers they hold: they are sorted by address,
    and two engines' separate buffers (kvcached per-layer: one per pool) need not come
    out of the allocator in the same address order.
    """
    pairs = {
        _region_of(src, owner.geometry.base): _region_of(dst, dst.owners[name].geometry.base)
        for name, owner in src.owners.items()
    }
    assert len(pairs) == len(src.regions) == len(dst.regions)
    out = rows.copy()
    for s, d in pairs.items():
        inside = (rows[:, 0] >= s.addr) & (rows[:, 0] < s.addr + s.nbytes)
        out[inside, 0] = rows[inside, 0] - np.uint64(s.addr) + np.uint64(d.addr)
    return out


@pytest.mark.parametrize(("model", "layout"), CASES)
def test_request_descriptors_copy_exactly_the_request(model, layout):
    src_stack, src = fresh(model, layout)
    dst_stack, dst = fresh(model, layout)
    ids = request_ids(src, seed=1)
    kvcheck.fill(src_stack.kv_caches, src, ids)

    rows = request_descriptors(src, ids)
    memmove_rows(translate(rows, src, dst), rows)

    # Every layer, sharers included through their alias, now holds the prefill pattern.
    assert kvcheck.mismatches(dst_stack.kv_caches, dst, ids) == []
    assert set(dst_stack.kv_caches) >= set(dst.sharers)
    assert kvcheck.nonzero_blocks_outside(dst_stack.kv_caches, dst, ids) == []

    # Negative control: without one descriptor the same check fails.
    zero_regions(dst)
    memmove_rows(translate(rows[1:], src, dst), rows[1:])
    assert kvcheck.mismatches(dst_stack.kv_caches, dst, ids)


@pytest.mark.parametrize(
    ("src_layout", "dst_layout", "model"),
    [
        ("per_layer", "kvcached_contiguous", "gemma4_e2b_shape"),
        ("kvcached_contiguous", "kvcached_per_layer", "gemma4_e2b_shape"),
        ("cross_layer", "per_layer", "g4uniform"),
        ("per_layer", "cross_layer", "g4uniform"),
    ],
)
def test_transfer_between_layouts_with_other_block_ids(src_layout, dst_layout, model):
    src_stack, src = fresh(model, src_layout)
    dst_stack, dst = fresh(model, dst_layout)
    remote_ids = request_ids(src, seed=2)
    local_ids = request_ids(dst, seed=3)
    kvcheck.fill(src_stack.kv_caches, src, remote_ids)

    paired = pair_owners(dst, src)
    local_rows, remote_rows = transfer_descriptors(
        paired, local_ids, remote_ids, dst.num_blocks, src.num_blocks
    )
    memmove_rows(local_rows, remote_rows)

    assert kvcheck.mismatches(dst_stack.kv_caches, dst, local_ids) == []
    assert kvcheck.nonzero_blocks_outside(dst_stack.kv_caches, dst, local_ids) == []
    # Negative control: pointing at the wrong remote blocks fails the same check.
    zero_regions(dst)
    wrong = [list(reversed(ids)) for ids in remote_ids]
    local_rows, remote_rows = transfer_descriptors(
        paired, local_ids, wrong, dst.num_blocks, src.num_blocks
    )
    memmove_rows(local_rows, remote_rows)
    assert kvcheck.mismatches(dst_stack.kv_caches, dst, local_ids)


def test_coalescing_contiguous_request(stack_topology):
    _, topology = stack_topology("gemma4_e2b_shape", "per_layer")
    count = 120
    ids = [list(range(1 + g * count, 1 + (g + 1) * count)) for g in range(len(topology.groups))]
    rows = request_descriptors(topology, ids)
    slabs = count * len(topology.owners)
    assert rows[:, 1].sum() == slabs * 32768
    assert slabs / len(rows) >= 4
    # A contiguous run of blocks is one descriptor per owner layer.
    assert len(rows) == len(topology.owners)


def test_block_ids_out_of_range(stack_topology):
    _, topology = stack_topology("g4tiny", "per_layer")
    ids = [[1]] * len(topology.groups)
    ids[5] = [3, topology.num_blocks]
    with pytest.raises(DescriptorError, match=f"block id {topology.num_blocks} of group 5 is out"):
        request_descriptors(topology, ids)
    with pytest.raises(DescriptorError, match="block id -1 of group 0"):
        request_descriptors(topology, [[-1]] + [[]] * 5)
    with pytest.raises(DescriptorError, match="cover 2 KV cache group"):
        request_descriptors(topology, [[1], [2]])


def _geometry(base: int, stride: int, kv_stride: int, device: int = -1):
    """A block of K then V (2 x 64 bytes here), ``kv_stride`` bytes apart."""
    from kvshare_connector.layout.topology import BlockGeometry, Dim

    dims = (Dim("kv", 2, kv_stride), Dim("token", 64, 1))
    return BlockGeometry(base, stride, dims, 1, 1, device)


@pytest.mark.parametrize("block_major", [False, True])
def test_one_broadcast_per_group_equals_one_owner_at_a_time(block_major):
    """The fast path (owners cut alike: one broadcast) and the general one (owners cut
    differently: per owner) name the same slabs in the same order."""
    from kvshare_connector.layout.descriptors import _Cut, slab_addresses

    ids = np.array([7, 3, 4, 5, 0, 9], dtype=np.int64)
    alike = [_geometry(1 << 20, 4096, 128), _geometry(2 << 20, 4096, 128)]
    fast = _Cut(alike, block_major)
    assert fast.same_cut
    per_owner = np.stack([slab_addresses(g, ids) for g in alike])  # owner, block x segment
    expected = (
        per_owner.reshape(2, ids.size, 2).transpose(1, 0, 2).ravel()
        if block_major
        else per_owner.ravel()
    )
    assert fast.addresses(ids).tolist() == expected.tolist()

    unlike = [_geometry(1 << 20, 4096, 128, device=0), _geometry(2 << 20, 8192, 256, device=1)]
    general = _Cut(unlike, block_major)
    assert not general.same_cut
    per_owner = np.stack([slab_addresses(g, ids) for g in unlike])
    expected = (
        per_owner.reshape(2, ids.size, 2).transpose(1, 0, 2).ravel()
        if block_major
        else per_owner.ravel()
    )
    assert general.addresses(ids).tolist() == expected.tolist()
    devices = general.per_slab("device_id", ids.size)
    assert devices.tolist() == (
        [0, 0, 1, 1] * ids.size if block_major else [0] * 2 * ids.size + [1] * 2 * ids.size
    )


def test_rows_keep_request_order_and_merge_only_true_neighbours(stack_topology):
    """Ids are not sorted: a descending run stays one row per block, an ascending one
    merges; either way the rows cover exactly the request's slabs."""
    _, topology = stack_topology("g4uniform", "per_layer")
    owners = len(topology.owners)
    ascending = request_descriptors(topology, [[4, 5, 6, 7]])
    descending = request_descriptors(topology, [[7, 6, 5, 4]])
    assert len(ascending) == owners
    assert len(descending) == 4 * owners
    assert ascending[:, 1].sum() == descending[:, 1].sum()
    assert descending[:, 0].min() == ascending[:, 0].min()


def test_the_cpu_stacks_rendezvous_takes_another_port_when_its_own_was_taken(monkeypatch):
    """A port picked free can be bound by another process before torch's rendezvous store
    binds it (EADDRINUSE, seen once in CI): the store is started again on another port; any
    other error, and a port taken every time, still raise."""
    import socket

    import torch.distributed as dist

    from kvshare_connector.demo import cpu_stack

    stores = []

    def listen(port: int) -> None:
        stores.append(dist.TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False))

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        picks = iter([taken, taken])
        real = cpu_stack.pick_free_port
        monkeypatch.setattr(cpu_stack, "pick_free_port", lambda: next(picks, None) or real())
        cpu_stack.on_a_free_port(listen)
        assert len(stores) == 1 and stores[0].port != taken
        monkeypatch.setattr(cpu_stack, "pick_free_port", lambda: taken)
        with pytest.raises(RuntimeError, match="EADDRINUSE"):
            cpu_stack.on_a_free_port(listen, attempts=3)

    def refused(port: int) -> None:
        raise RuntimeError("connection refused")

    with pytest.raises(RuntimeError, match="refused"):
        cpu_stack.on_a_free_port(refused)
