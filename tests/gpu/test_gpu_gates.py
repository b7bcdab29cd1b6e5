"""GPU (skipped without CUDA): a gate (``transfer.gates``) holds a scatter queued on its
stream until the host opens it, and the scatter then copies what the staging slot holds at
that moment, not at its launch: the bytes of a READ that landed after the launch."""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _packer():
    from kvshare_connector.transfer.packing import MemoryMap, Packer, StagingArea

    kv = torch.zeros(1 << 22, dtype=torch.uint8, device="cuda")
    return kv, Packer(MemoryMap([kv]), StagingArea(1 << 22, "cuda"))


def test_a_gated_scatter_copies_the_bytes_there_when_it_opens():
    from kvshare_connector.transfer.gates import StreamGates

    gates = StreamGates("cuda", hold_s=60.0)  # the keeper out of the way
    kv, packer = _packer()
    base = kv.data_ptr()
    addr = np.array([base + 65536, base + 3 * 65536], dtype=np.int64)
    length = np.array([65536, 32768], dtype=np.int64)
    staged = np.array([0, 65536], dtype=np.int64)
    slot = packer.staging.buffer
    slot[: 1 << 17].fill_(1)  # what the slot holds when the scatter is launched
    torch.cuda.synchronize()
    gate = gates.arm()
    assert gate is not None
    copy = packer.scatter(addr, length, staged, plan=packer.plan_copy(addr, length, staged),
                          stream=gate.stream)  # fmt: skip
    time.sleep(0.05)
    assert not copy.done()  # held
    fresh = torch.randint(2, 255, (98304,), dtype=torch.uint8, device="cuda")
    slot[:98304].copy_(fresh)  # the READ's bytes, landing after the launch
    torch.cuda.current_stream().synchronize()  # never the device's: a held stream is in it
    assert not copy.done()
    # The held copy's indices came from the packer's stream: a plan made now must not get
    # their memory while the copy has not run (the caching allocator reuses freed blocks).
    other = np.array([base + 2 * 65536, base + 5 * 65536], dtype=np.int64)
    later = packer.plan_copy(other, length, staged)
    torch.cuda.current_stream().synchronize()
    gate.open()
    copy.wait()
    assert torch.equal(kv[65536 : 2 * 65536], fresh[:65536])
    assert torch.equal(kv[3 * 65536 : 3 * 65536 + 32768], fresh[65536:])
    assert int(kv[:65536].count_nonzero()) == 0  # nothing else written
    assert int(kv[2 * 65536 : 3 * 65536].count_nonzero()) == 0  # not where ``later`` points
    assert later.rows > 0
    assert gates.armed == 0 and not gate.early
    gates.close()


def test_every_stream_held_means_no_gate_until_one_opens():
    from kvshare_connector.transfer.gates import STREAMS, StreamGates

    made, how = StreamGates.create("cuda")
    assert made is not None and how.startswith(f"on ({STREAMS} streams"), how
    made.close()
    gates = StreamGates("cuda", hold_s=60.0)
    held = [gates.arm() for _ in range(STREAMS)]
    assert all(g is not None for g in held) and gates.armed == STREAMS
    assert gates.arm() is None
    events = []
    for g in held:
        event = torch.cuda.Event()
        event.record(g.stream)
        events.append(event)
    time.sleep(0.02)
    assert not any(e.query() for e in events)
    held[3].open()
    events[3].synchronize()
    assert gates.arm() is not None  # the opened stream, held again
    gates.close()  # opens every held gate
    for e in events:
        e.synchronize()
    assert gates.armed == 0 and gates.arm() is None  # closed: no more gates


def test_the_keeper_opens_a_gate_held_past_its_bound():
    """A held stream holds a device-wide synchronize too: no gate outlives ``hold_s``."""
    from kvshare_connector.transfer.gates import StreamGates

    gates = StreamGates("cuda", hold_s=0.02)
    gate = gates.arm()
    assert gate is not None
    event = torch.cuda.Event()
    event.record(gate.stream)
    torch.cuda.synchronize()  # returns once the keeper opened the gate
    assert event.query() and gate.opened and gate.early
    gates.close()
