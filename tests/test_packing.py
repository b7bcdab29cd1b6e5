"""Packed transfer checked through memory: gather on one engine, move the packed bytes, scatter
on another engine with other block ids (and another layout), then read the KV back."""

from __future__ import annotations

import numpy as np
import pytest

from kvshare_connector.demo import kvcheck
from kvshare_connector.demo.cpu_stack import build_cpu_stack, topology_of
from kvshare_connector.layout.descriptors import request_descriptors, transfer_descriptors
from kvshare_connector.layout.matching import pair_owners
from kvshare_connector.layout.staging import (
    PackedLayout,
    StagingError,
    packed_read,
    word_indices,
    word_size,
)
from kvshare_connector.transfer.device.packing import (
    ALIGN,
    MemoryMap,
    Packer,
    PackingError,
    StagingArea,
)

from .support.blockutil import disjoint_block_ids

CASES = [
    ("gemma4_e2b_shape", "per_layer", "per_layer"),
    ("g4uniform", "cross_layer", "cross_layer"),
    ("gemma4_e2b_shape", "kvcached_contiguous", "per_layer"),
    ("gemma4_e2b_shape", "per_layer", "kvcached_per_layer"),
]


def fresh(model: str, layout: str):
    stack = build_cpu_stack(model, layout, kv_bytes=32 << 20, max_model_len=1024)
    return stack, topology_of(stack)


def tensors_of(stack) -> list:
    return list(stack.kv_caches.values())  # views of the cross-layer tensor where there is one


def move(prefill, decode, remote_ids, local_ids, corrupt: bool = False, slot_lost: bool = False):
    """Prefill gathers its held blocks, decode READs (a copy here) into a slot that is not
    the area's first and scatters, with the scatter planned before the slot was known (as
    decode plans while its claim is out); bytes moved. Negative controls: ``corrupt`` reads
    a page off, ``slot_lost`` launches the plan at the area's start instead of the slot."""
    (p_stack, p_topo), (d_stack, d_topo) = prefill, decode
    layout = PackedLayout.of(request_descriptors(p_topo, remote_ids))
    p_area = StagingArea(layout.nbytes + ALIGN, "cpu")
    p_slot = p_area.allocate(layout.nbytes)
    Packer(MemoryMap(tensors_of(p_stack)), p_area).gather(
        layout.addr, layout.length, p_slot + layout.offset
    ).wait()

    local_rows, remote_rows = transfer_descriptors(
        pair_owners(d_topo, p_topo), local_ids, remote_ids, d_topo.num_blocks, p_topo.num_blocks
    )
    plan = packed_read(layout, local_rows, remote_rows)
    assert len(plan.read_remote) <= len(layout.addr)  # a few large runs, not one per block
    d_area = StagingArea(plan.nbytes + 2 * ALIGN, "cpu")
    d_packer, scatter = Packer(MemoryMap(tensors_of(d_stack)), d_area), plan.scatter
    ahead = d_packer.plan_copy(scatter[:, 0], scatter[:, 2], scatter[:, 1])
    assert d_area.allocate(1) == 0  # another read's slot
    d_slot = d_area.allocate(plan.nbytes)
    assert d_slot == ALIGN
    d_area.buffer[:] = 0xA5  # what the staging held before
    for (r_off, n), (l_off, _) in zip(plan.read_remote, plan.read_local, strict=True):
        src = p_slot + r_off + (ALIGN if corrupt else 0)  # negative control: a page off
        d_area.buffer[d_slot + l_off : d_slot + l_off + n] = p_area.buffer[src : src + n]
    launch_at = 0 if slot_lost else d_slot
    d_packer.scatter(scatter[:, 0], scatter[:, 2], scatter[:, 1], slot=launch_at, plan=ahead).wait()
    return plan.nbytes


@pytest.mark.parametrize(("model", "prefill_layout", "decode_layout"), CASES)
def test_packed_transfer_lands_every_block(model, prefill_layout, decode_layout):
    prefill, decode = fresh(model, prefill_layout), fresh(model, decode_layout)
    counts = [4 + 3 * g for g in range(len(prefill[1].groups))]
    remote_ids = disjoint_block_ids(prefill[1].num_blocks, counts, seed=3)
    local_ids = disjoint_block_ids(decode[1].num_blocks, counts, seed=4)
    kvcheck.fill(prefill[0].kv_caches, prefill[1], remote_ids)

    moved = move(prefill, decode, remote_ids, local_ids)

    assert moved == int(request_descriptors(prefill[1], remote_ids)[:, 1].sum())
    assert kvcheck.mismatches(decode[0].kv_caches, decode[1], local_ids) == []
    assert kvcheck.nonzero_blocks_outside(decode[0].kv_caches, decode[1], local_ids) == []


@pytest.mark.parametrize("control", ["corrupt", "slot_lost"])
def test_packed_transfer_negative_control_is_caught(control):
    prefill, decode = fresh("gemma4_e2b_shape", "per_layer"), fresh("gemma4_e2b_shape", "per_layer")
    counts = [6] * len(prefill[1].groups)
    remote_ids = disjoint_block_ids(prefill[1].num_blocks, counts, seed=5)
    local_ids = disjoint_block_ids(decode[1].num_blocks, counts, seed=6)
    kvcheck.fill(prefill[0].kv_caches, prefill[1], remote_ids)
    move(prefill, decode, remote_ids, local_ids, **{control: True})
    assert kvcheck.mismatches(decode[0].kv_caches, decode[1], local_ids) != []


def test_decode_reading_only_the_tail_reads_only_its_bytes():
    """A local prefix-cache hit: decode loads the last blocks of each group only."""
    prefill, decode = fresh("g4tiny", "per_layer"), fresh("g4tiny", "per_layer")
    counts = [8] * len(prefill[1].groups)
    remote_ids = disjoint_block_ids(prefill[1].num_blocks, counts, seed=7)
    local_ids = disjoint_block_ids(decode[1].num_blocks, [3] * len(counts), seed=8)
    tail = [ids[-3:] for ids in remote_ids]
    kvcheck.fill(prefill[0].kv_caches, prefill[1], remote_ids)

    layout = PackedLayout.of(request_descriptors(prefill[1], remote_ids))
    local_rows, remote_rows = transfer_descriptors(
        pair_owners(decode[1], prefill[1]), local_ids, tail, 10**9, 10**9
    )
    plan = packed_read(layout, local_rows, remote_rows)
    assert plan.nbytes == int(local_rows[:, 1].sum()) < layout.nbytes

    # Through memory, with the tail only.
    p_area = StagingArea(layout.nbytes + ALIGN, "cpu")
    slot = p_area.allocate(layout.nbytes)
    Packer(MemoryMap(tensors_of(prefill[0])), p_area).gather(
        layout.addr, layout.length, slot + layout.offset
    ).wait()
    d_area = StagingArea(plan.nbytes + ALIGN, "cpu")
    for (r_off, n), (l_off, _) in zip(plan.read_remote, plan.read_local, strict=True):
        d_area.buffer[l_off : l_off + n] = p_area.buffer[slot + r_off : slot + r_off + n]
    Packer(MemoryMap(tensors_of(decode[0])), d_area).scatter(
        plan.scatter[:, 0], plan.scatter[:, 2], plan.scatter[:, 1]
    ).wait()
    first = [len(ids) - 3 for ids in remote_ids]  # positions of the tail in the request
    assert (
        kvcheck.mismatches(decode[0].kv_caches, decode[1], local_ids, first_positions=first) == []
    )


def _copy_ops(fn) -> dict[str, int]:
    """How many indexed-copy ops ``fn`` ran (torch's profiler, CPU)."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = [e.name for e in prof.events()]
    return {op: names.count(op) for op in ("aten::index_copy_", "aten::index_select")}


def test_a_request_over_several_storages_is_one_indexed_copy_each_way(monkeypatch):
    """E2B's KV lies in several storages; a request's gather and scatter go through one
    view over them all (``MemoryMap.window``): one indexed copy each, not two per storage
    (the host's launches were most of a landing on the GPU, 2026-12-06d). kvcached's
    per-layer layout: several storages on every vLLM version (0.33 keeps vLLM's own E2B
    layout in one)."""
    prefill = fresh("gemma4_e2b_shape", "kvcached_per_layer")
    decode = fresh("gemma4_e2b_shape", "kvcached_per_layer")
    counts = [5] * len(prefill[1].groups)
    remote_ids = disjoint_block_ids(prefill[1].num_blocks, counts, seed=11)
    local_ids = disjoint_block_ids(decode[1].num_blocks, counts, seed=12)
    kvcheck.fill(prefill[0].kv_caches, prefill[1], remote_ids)
    storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                for t in tensors_of(decode[0])}  # fmt: skip
    runs = request_descriptors(decode[1], local_ids)[:, 0].astype(np.int64)
    touched = {s for s, n in storages for a in runs.tolist() if s <= a < s + n}
    assert len(touched) > 1  # the case: the request's blocks lie in several storages

    ops: list[dict[str, int]] = []
    real_launch = Packer._launch

    def counted(self, *args, **kwargs):
        result = []
        ops.append(_copy_ops(lambda: result.append(real_launch(self, *args, **kwargs))))
        return result[0]

    monkeypatch.setattr(Packer, "_launch", counted)
    move(prefill, decode, remote_ids, local_ids)
    assert ops == [{"aten::index_copy_": 0, "aten::index_select": 1},  # gather
                   {"aten::index_copy_": 1, "aten::index_select": 0}]  # scatter  # fmt: skip
    assert kvcheck.mismatches(decode[0].kv_caches, decode[1], local_ids) == []


def test_runs_in_the_gap_between_storages_are_refused():
    """The window spans the gaps between storages; a run there (or past the last) is
    refused before any copy, naming its address."""
    import torch

    a, b = torch.zeros(1 << 16, dtype=torch.uint8), torch.zeros(1 << 16, dtype=torch.uint8)
    memory = MemoryMap([a, b])
    lo, hi = sorted([a.data_ptr(), b.data_ptr()])
    window = memory.check(np.array([lo, hi]), np.array([4096, 4096]))
    assert window.start == lo and window.end == hi + (1 << 16)
    with pytest.raises(PackingError, match=f"{lo + (1 << 16):#x}"):
        memory.check(np.array([lo, lo + (1 << 16)]), np.array([4096, 16]))  # just past a
    with pytest.raises(PackingError, match="no KV tensor holds"):
        memory.check(np.array([hi + (1 << 16) - 8]), np.array([16]))  # runs past b's end


def test_a_packed_copy_takes_words_larger_than_a_slot_alignment():
    """Runs of 32 KiB at 32 KiB offsets are copied as 32 KiB rows (8x fewer indices than at
    4 KiB), and the scatter still lands from a slot that starts on 4 KiB only: the staging
    side of a packed copy is a byte range, not rows of the area."""
    import torch

    kv = torch.zeros(1 << 22, dtype=torch.uint8)
    packer = Packer(MemoryMap([kv]), StagingArea(1 << 20, "cpu"))
    base = kv.untyped_storage().data_ptr()
    addr = np.array([base + 5 * 32768, base + 2 * 32768, base + 40 * 32768], dtype=np.int64)
    length = np.full(3, 32768, dtype=np.int64)
    staged = np.array([0, 32768, 65536], dtype=np.int64)
    plan = packer.plan_copy(addr, length, staged)  # before the slot is known
    assert (plan.word, plan.rows, plan.staged_at) == (32768, 3, 0)
    assert packer.staging.allocate(ALIGN) == 0
    slot = packer.staging.allocate(3 * 32768)
    assert slot == ALIGN and slot % plan.word  # not a multiple of the word
    area = packer.staging.buffer
    area[:] = 1
    area[slot : slot + 3 * 32768] = torch.randint(0, 255, (3 * 32768,), dtype=torch.uint8)
    packer.scatter(addr, length, staged, slot=slot, plan=plan).wait()
    for a, o in zip(addr.tolist(), staged.tolist(), strict=True):
        assert torch.equal(kv[a - base : a - base + 32768], area[slot + o : slot + o + 32768])
    assert int(kv.sum()) == int(area[slot : slot + 3 * 32768].sum())  # nothing else written


def test_staging_offsets_with_gaps_still_land():
    """Offsets not back to back in the slot (not how a request is packed, still allowed):
    the staging side takes its own indices."""
    import torch

    kv = torch.zeros(1 << 16, dtype=torch.uint8)
    packer = Packer(MemoryMap([kv]), StagingArea(1 << 16, "cpu"))
    packer.staging.buffer[:] = torch.arange(1 << 16, dtype=torch.int64).to(torch.uint8)
    base = kv.data_ptr()
    addr = np.array([base + 8192, base + 4096], dtype=np.int64)
    length = np.array([4096, 2048], dtype=np.int64)
    staged = np.array([0, 8192], dtype=np.int64)  # a gap after the first run
    plan = packer.plan_copy(addr, length, staged)
    assert plan.staged_at is None
    packer.scatter(addr, length, staged, plan=plan).wait()
    area = packer.staging.buffer
    assert torch.equal(kv[8192:12288], area[:4096])
    assert torch.equal(kv[4096:6144], area[8192:10240])
    assert int(kv[:4096].sum()) == 0 and int(kv[12288:].sum()) == 0


def test_runs_outside_the_packed_request_are_refused():
    rows = np.array([[4096, 512, 0], [8192, 512, 0]], dtype=np.uint64)
    layout = PackedLayout.of(rows)
    assert layout.locate(np.array([[8192 + 256, 256, 0]], dtype=np.uint64)).tolist() == [768]
    with pytest.raises(StagingError, match="not part of the packed request"):
        layout.locate(np.array([[4096 + 256, 512, 0]], dtype=np.uint64))  # runs past its run
    with pytest.raises(StagingError):
        layout.locate(np.array([[0, 16, 0]], dtype=np.uint64))


def test_packed_layout_sorts_and_merges_runs():
    rows = np.array([[3000, 1000, 0], [1000, 1000, 0], [2000, 1000, 0], [9000, 8, 1]], np.uint64)
    layout = PackedLayout.of(rows)
    assert layout.addr.tolist() == [1000, 9000]
    assert layout.length.tolist() == [3000, 8]
    assert layout.offset.tolist() == [0, 3000]
    assert layout.nbytes == 3008


def test_word_indices_and_size():
    assert word_size(np.array([0, 4096, 8192]), np.array([4096, 4096, 512])) == 512
    assert word_size(np.array([6]), np.array([4])) == 2
    idx = word_indices(np.array([0, 1024]), np.array([512, 256]), 256)
    assert idx.tolist() == [0, 1, 4]


def test_staging_area_reuses_freed_slots():
    area = StagingArea(4 * ALIGN, "cpu")
    a, b = area.allocate(ALIGN), area.allocate(2 * ALIGN - 1)
    assert (a, b) == (0, ALIGN)
    assert area.allocate(2 * ALIGN) is None  # one page left
    area.release(a)
    area.release(b)
    assert area.allocate(4 * ALIGN) == 0  # freed slots merged back into one


def test_landing_benchmark_times_each_host_step(tmp_path):
    """lab/benchmarks/bench_landing.py on a short request: every step timed, the digests of the
    same blocks compared equal (it exits 1 otherwise)."""
    import json

    from lab.benchmarks import bench_landing

    out = tmp_path / "landing.json"
    assert bench_landing.main(["--tokens", "512", "--repeat", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    steps = [row["step"].split(" (")[0].split(",")[0] for row in data["rows"]]
    assert steps == ["descriptors", "NIXL descriptor lists + initialize_xfer", "packed plan",
                     "scatter index plan", "digest plan", "scatter", "digests",
                     "compare digests"]  # fmt: skip
    assert data["bytes"] > 0 and all(row["ms"] >= 0 for row in data["rows"])
