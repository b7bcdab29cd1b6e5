"""GPU (skipped without CUDA): the lane probe's buffer is not overtaken by a busy engine stream.

The transport copies on streams of its own, unordered with the engine's. On a busy H200 a
decode's probe found "other bytes than prefill's pattern" (fault matrix, 2026-12-03c): its
clear, queued on the engine's stream behind a forward, ran after the READ had landed. Here
a long kernel stands for the forward, and a copy on another stream for the READ; the
control does what the probe did before (clear on the engine's stream) and must lose the
bytes. Needs only torch, numpy and msgspec (no vLLM, no NIXL).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NBYTES = 8 << 20
BUSY_CYCLES = 200_000_000  # ~0.1 s of one SM at ~2 GHz: longer than any copy here
SEED = 7


def _land(dst, src) -> None:
    """The READ: src's bytes copied into dst on a stream the engine's does not order."""
    wire = torch.cuda.Stream()
    with torch.cuda.stream(wire):
        dst.copy_(src)
    wire.synchronize()


@pytest.mark.parametrize("clear_on_engine_stream", [False, True])
def test_a_clear_before_the_read_is_not_run_after_it(clear_on_engine_stream):
    from kvshare_connector.transfer.device.probe import ProbeBuffer

    prefill = ProbeBuffer(NBYTES, "cuda", seed=SEED)
    decode = ProbeBuffer(NBYTES, "cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)  # the engine's stream is busy with a forward
    if clear_on_engine_stream:
        decode.tensor.zero_()  # the control: the probe's clear until 2026-12-03c
    else:
        decode.clear()
    _land(decode.tensor, prefill.tensor)
    torch.cuda.synchronize()  # the forward ends; a clear queued behind it runs now
    assert decode.holds(SEED, NBYTES) is (not clear_on_engine_stream)


@pytest.mark.parametrize("fill_on_engine_stream", [False, True])
def test_the_pattern_is_in_place_when_the_buffer_is_made_on_a_busy_device(fill_on_engine_stream):
    from kvshare_connector.transfer.device.probe import ProbeBuffer

    reference = ProbeBuffer(NBYTES, "cuda", seed=SEED)
    expected = reference._pattern(SEED).view(torch.uint8)
    stale = torch.full((NBYTES,), 0xAB, dtype=torch.uint8, device="cuda")  # control's memory
    landed = ProbeBuffer(NBYTES, "cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    if fill_on_engine_stream:  # the control: the probe's fill until 2026-12-03c
        stale.view(torch.int64).copy_(expected.view(torch.int64))
        source = stale
    else:
        source = ProbeBuffer(NBYTES, "cuda", seed=SEED).tensor  # advertised once it exists
    _land(landed.tensor, source)
    torch.cuda.synchronize()
    assert torch.equal(landed.tensor, expected) is (not fill_on_engine_stream)
