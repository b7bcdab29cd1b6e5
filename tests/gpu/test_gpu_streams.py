"""GPU (skipped without CUDA): the work a load waits on runs on the device's highest-priority
stream (``packing.side_stream``), and a gather and scatter through it move the bytes."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_gather_scatter_and_digests_use_the_highest_priority_stream():
    from kvshare_connector.transfer.digests import Digester
    from kvshare_connector.transfer.packing import MemoryMap, Packer, StagingArea

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
