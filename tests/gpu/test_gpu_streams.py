"""GPU (skipped without CUDA): the work a load waits on runs on the device's highest-priority
stream (``packing.side_stream``), and a gather and scatter through it move the bytes; a
scatter planned before its staging slot was known lands from that slot."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_gather_scatter_and_digests_use_the_highest_priority_stream():
    from kvshare_connector.transfer.device.digests import Digester
    from kvshare_connector.transfer.device.packing import MemoryMap, Packer, StagingArea

    kv = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device="cuda")
    memory = MemoryMap([kv])
    packer = Packer(memory, StagingArea(1 << 20, "cuda"))
    highest = torch.cuda.Stream.priority_range()[1]
    assert packer._stream.priority == highest
    assert Digester(memory, "cuda")._stream.priority == highest
    base = kv.data_ptr()
    addr = np.array([base + 4096, base + 65536], dtype=np.int64)
    length = np.array([8192, 4096], dtype=np.int64)
    packer.gather(addr, length, np.array([0, 8192], dtype=np.int64)).wait()
    staged = packer.staging.buffer
    assert torch.equal(staged[:8192], kv[4096 : 4096 + 8192])
    assert torch.equal(staged[8192 : 8192 + 4096], kv[65536 : 65536 + 4096])
    kv[4096 : 4096 + 8192] = 0
    packer.scatter(addr[:1], length[:1], np.array([0], dtype=np.int64)).wait()
    assert torch.equal(kv[4096 : 4096 + 8192], staged[:8192])


@pytest.mark.parametrize("after_compute", [False, True])
def test_a_hold_time_gather_does_not_wait_for_the_queued_forward(after_compute):
    """Prefill gathers a held request without waiting for the compute stream (the next
    step's forward, queued by then under async scheduling). A long kernel stands for that
    forward: without the wait the gather is done while it still runs; the control (the
    decode side's default) waits for it."""
    from kvshare_connector.transfer.device.packing import MemoryMap, Packer, StagingArea

    kv = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device="cuda")
    packer = Packer(MemoryMap([kv]), StagingArea(1 << 20, "cuda"))
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of a busy compute stream
    forward = torch.cuda.Event()
    forward.record()
    base = kv.data_ptr()
    copy = packer.gather(np.array([base], dtype=np.int64), np.array([65536], dtype=np.int64),
                         np.array([0], dtype=np.int64), after_compute=after_compute)
    copy.wait()
    assert forward.query() is after_compute  # the control waited for the "forward"
    assert torch.equal(packer.staging.buffer[:65536], kv[:65536])
    torch.cuda.synchronize()


@pytest.mark.parametrize("launch_at_slot", [True, False])
def test_a_scatter_planned_before_its_slot_lands_from_the_slot(launch_at_slot):
    """Decode plans a packed read's scatter while its claim is out, in offsets relative to
    the staging slot, and launches it at the slot the post allocated (here not the area's
    first). The control launches the same plan at the area's start: other bytes land."""
    from kvshare_connector.transfer.device.packing import ALIGN, MemoryMap, Packer, StagingArea

    kv = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    packer = Packer(MemoryMap([kv]), StagingArea(4 * ALIGN + (1 << 16), "cuda"))
    base = kv.data_ptr()
    addr = np.array([base + 8192, base + 131072, base + 4096], dtype=np.int64)
    length = np.array([16384, 4096, 2048], dtype=np.int64)
    staged = np.array([0, 16384, 20480], dtype=np.int64)  # packed, in the slot
    plan = packer.plan_copy(addr, length, staged)  # no slot yet
    assert packer.staging.allocate(ALIGN) == 0  # another read's slot
    slot = packer.staging.allocate(int(length.sum()))
    assert slot == ALIGN
    area = packer.staging.buffer
    area[:] = 7  # what the staging held before
    area[slot : slot + int(length.sum())] = torch.randint(
        0, 255, (int(length.sum()),), dtype=torch.uint8, device="cuda"
    )  # the READ's bytes
    packer.scatter(addr, length, staged, slot=slot if launch_at_slot else 0, plan=plan).wait()
    landed = all(
        torch.equal(kv[a - base : a - base + n], area[slot + o : slot + o + n])
        for a, n, o in zip(addr.tolist(), length.tolist(), staged.tolist(), strict=True)
    )
    assert landed is launch_at_slot


def test_one_view_over_several_storages_moves_the_right_bytes():
    """``MemoryMap.window`` on CUDA (a storage made from the lowest storage's pointer,
    spanning both): a gather and a scatter with runs in two storages, one indexed copy
    each, move the right bytes, and nothing else in either storage changes."""
    from kvshare_connector.transfer.device.packing import MemoryMap, Packer, StagingArea

    a = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device="cuda")
    b = torch.randint(0, 255, (8 << 20,), dtype=torch.uint8, device="cuda")
    memory = MemoryMap([a, b])
    assert memory.window is not None
    assert memory.window.flat.data_ptr() == min(a.data_ptr(), b.data_ptr())
    packer = Packer(memory, StagingArea(1 << 20, "cuda"))
    addr = np.array([b.data_ptr() + 65536, a.data_ptr() + 4096], dtype=np.int64)
    length = np.array([16384, 8192], dtype=np.int64)
    staged = np.array([0, 16384], dtype=np.int64)
    packer.gather(addr, length, staged).wait()
    area = packer.staging.buffer
    assert torch.equal(area[:16384], b[65536 : 65536 + 16384])
    assert torch.equal(area[16384 : 16384 + 8192], a[4096 : 4096 + 8192])
    expect_b, expect_a = b[65536 : 65536 + 16384].clone(), a[4096 : 4096 + 8192].clone()
    a.zero_()
    b.zero_()
    packer.scatter(addr, length, staged).wait()
    assert torch.equal(b[65536 : 65536 + 16384], expect_b)
    assert torch.equal(a[4096 : 4096 + 8192], expect_a)
    assert int(a[:4096].sum()) == 0 and int(b[:65536].sum()) == 0
