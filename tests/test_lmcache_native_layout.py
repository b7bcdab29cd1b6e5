"""Why the LMCache backend copies KV through its own views instead of LMCache's kernels.

On this stack LMCache 0.5.6's compiled ``cuda_ops`` do not load (torch 2.11), so LMCache runs
its torch fallback for every copy; on the H200 (results/gpu/2026-11-29c) ``LMCacheConnectorV1``
logged exactly that and then decoded differently from the colocated engine on every prompt
it loaded. Here, on the CPU, the same fallback function against a layer laid out the way
vLLM 0.26's FlashAttention backend lays it out (K and V packed in the last dimension): it
reads slot ``s``'s "K" from half of slot ``s // 2``, and a store/load round trip does not
give the request's KV back. If a later LMCache fixes this, this test fails: time to revisit
docs/lmcache.md's "Why not LMCache's own connector".
"""

from __future__ import annotations

import pytest

from .support.lmcache_util import quiet_lmcache

quiet_lmcache()
pytest.importorskip("lmcache", reason="LMCache is an optional extra: pip install .[lmcache]")
torch = pytest.importorskip("torch")

from lmcache.lmcache_native import EngineKVFormat, TransferDirection  # noqa: E402
from lmcache.v1.platform.torch_ops.mem_kernels import multi_layer_kv_transfer  # noqa: E402

from kvshare_connector.demo.cpu_stack import build_cpu_stack  # noqa: E402


def _copy(rows: torch.Tensor, layer: torch.Tensor, slots: torch.Tensor, direction) -> None:
    num_blocks, _, block_size, packed = layer.shape
    multi_layer_kv_transfer(
        rows,
        torch.tensor([layer.data_ptr()], dtype=torch.int64),
        slots,
        torch.device("cpu"),
        num_blocks * block_size,
        direction,
        EngineKVFormat.NL_X_NB_BS_NH_CS,  # what LMCache detected for this layout on the H200
        block_size=block_size,
        head_size=packed // 2,
    )


def test_lmcache_torch_fallback_misreads_vllm_packed_kv():
    # g4uniform's first layer as vLLM 0.26 allocates it (the model of the H200 run): logical
    # (blocks, heads, block_size, K|V packed), memory in (blocks, block_size, heads, K|V).
    stack = build_cpu_stack("g4uniform", "per_layer", kv_bytes=8 << 20)
    layer = stack.kv_caches["model.layers.0.self_attn.attn"]
    num_blocks, heads, block_size, packed = layer.shape
    head_size = packed // 2
    layer.copy_(torch.randn(layer.shape, generator=torch.Generator().manual_seed(0)))
    per_slot = layer.permute(0, 2, 1, 3).reshape(num_blocks * block_size, heads * packed)
    assert per_slot.data_ptr() == layer.data_ptr()  # a view in memory order, no copy
    slots = torch.arange(block_size, 3 * block_size)  # a request in blocks 1 and 2
    true_k = per_slot[slots].view(len(slots), heads, packed)[..., :head_size]

    rows = torch.zeros(2, 1, len(slots), heads * head_size, dtype=layer.dtype)
    _copy(rows, layer, slots, TransferDirection.D2H)  # LMCache's [K|V, layer, token, hidden]
    assert rows.abs().sum() > 0  # it did copy something
    assert not torch.equal(rows[0, 0], true_k.reshape(len(slots), -1))
    for i, slot in enumerate(slots.tolist()):  # what it took as slot s's K: half of s // 2
        half = slot % 2
        taken = per_slot[slot // 2, half * head_size : (half + 1) * head_size]
        assert torch.equal(rows[0, 0, i], taken)

    decode = torch.zeros_like(layer)
    _copy(rows, decode, slots, TransferDirection.H2D)
    decode_slots = decode.permute(0, 2, 1, 3).reshape_as(per_slot)
    restored = decode_slots[slots] == per_slot[slots]
    assert decode.abs().sum() > 0 and not restored.all()
    assert restored.float().mean() < 0.5  # most of the request's KV never lands
