"""Topology of vLLM's real KV objects: owners only, sharers resolved, groups as vLLM made them."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from kvshare_connector.layout.topology import (
    GroupSpec,
    LayerSpec,
    TensorView,
    TopologyError,
    build_topology,
    resolve_sharing,
)
from kvshare_connector.vllm import adapter as vllm_adapter
from kvshare_connector.vllm import compat


def gemma4_sharing_rule(model: str) -> dict[str, str]:
    """Gemma-4's rule, from its config alone: the last ``num_kv_shared_layers`` layers read
    the KV of the last earlier layer of the same attention type."""
    config = json.loads(
        resources.files("kvshare_connector.demo.models").joinpath(f"{model}.json").read_text()
    )
    types = config["layer_types"]
    first_shared = config["num_hidden_layers"] - config["num_kv_shared_layers"]
    name = "model.layers.{}.self_attn.attn".format
    sharing = {}
    for index in range(first_shared, config["num_hidden_layers"]):
        target = max(i for i in range(first_shared) if types[i] == types[index])
        sharing[name(index)] = name(target)
    return sharing


def assert_owner_only(stack, topology, model):
    sharing = gemma4_sharing_rule(model)
    assert topology.sharers == sharing
    assert not set(topology.owners) & set(sharing)
    tensors = stack.kv_cache_config.kv_cache_tensors
    owners = {n for t in tensors for n in compat.kv_cache_tensor_layers(t)}
    assert set(topology.owners) == owners
    # Every registered byte belongs to an owner's blocks; no region was added for a sharer
    # (sharers alias their target, so they may not widen the registered spans either).
    spans = [o.geometry.span(topology.num_blocks) for o in topology.owners.values()]
    for region in topology.regions:
        assert any(s[0] >= region.addr and s[1] <= region.addr + region.nbytes for s in spans)
        assert region.addr == min(
            s[0] for s in spans if region.addr <= s[0] < region.addr + region.nbytes
        )
    # Groups and block sizes are vLLM's own.
    vllm_groups = stack.kv_cache_config.kv_cache_groups
    assert len(topology.groups) == len(vllm_groups)
    for ours, theirs in zip(topology.groups, vllm_groups, strict=True):
        assert ours.spec.block_size == theirs.kv_cache_spec.block_size
        assert ours.spec.head_size == theirs.kv_cache_spec.head_size
        assert set(ours.layer_names) == set(theirs.layer_names) - set(sharing)


def test_gemma4_e2b_shape_per_layer(stack_topology):
    stack, topology = stack_topology("gemma4_e2b_shape", "per_layer")
    assert len(topology.owners) == 15
    assert len(topology.sharers) == 20
    assert_owner_only(stack, topology, "gemma4_e2b_shape")
    # HMA: 4 sliding groups (head 256) and 1 full group (head 512), each of 3 owners;
    # vLLM doubles the sliding block size so every group has the same page size.
    kinds = sorted((g.spec.kind, g.spec.head_size, g.spec.block_size) for g in topology.groups)
    assert kinds == [("full", 512, 16)] + [("sliding", 256, 32)] * 4
    assert {g.spec.page_bytes for g in topology.groups} == {32768}
    if compat.HAS_KV_CACHE_LAYOUT:
        # vLLM 0.33: one buffer; each group's 3 layers strided across all of it.
        (region,) = topology.regions
        assert region.nbytes == topology.num_blocks * 3 * 32768
    else:
        # One raw buffer per vLLM KVCacheTensor, shared by one layer of each group.
        assert len(topology.regions) == len(stack.kv_cache_config.kv_cache_tensors) == 3
        assert all(r.nbytes == topology.num_blocks * 32768 for r in topology.regions)


def test_sharers_resolve_to_their_targets(stack_topology):
    _, topology = stack_topology("gemma4_e2b_shape", "per_layer")
    assert topology.resolve("model.layers.15.self_attn.attn") == "model.layers.13.self_attn.attn"
    assert topology.resolve("model.layers.34.self_attn.attn") == "model.layers.14.self_attn.attn"
    assert topology.resolve("model.layers.3.self_attn.attn") == "model.layers.3.self_attn.attn"
    with pytest.raises(TopologyError, match="neither an owner nor a sharer"):
        topology.resolve("model.layers.99.self_attn.attn")


def test_g4tiny_hma_overlay(stack_topology):
    stack, topology = stack_topology("g4tiny", "per_layer")
    assert len(topology.owners) == 6 and len(topology.sharers) == 4
    assert_owner_only(stack, topology, "g4tiny")
    assert len(topology.groups) == 6  # vLLM: one group per owner, all over one raw tensor
    assert len(topology.regions) == 1
    heads = {(g.spec.kind, g.spec.head_size) for g in topology.groups}
    assert heads == {("sliding", 64), ("full", 128)}


def test_single_group_cross_layer_blocks(stack_topology):
    stack, topology = stack_topology("g4uniform", "cross_layer")
    assert_owner_only(stack, topology, "g4uniform")
    assert len(topology.groups) == 1 and len(topology.owners) == 6
    # One region: the used part of the single cross-layer tensor (vLLM 0.33: of the one
    # buffer its block-major BLNHC layout puts every layer in).
    (region,) = topology.regions
    if compat.HAS_CROSS_LAYER_TENSOR:
        assert region.addr == stack.cross_layer_tensor.data_ptr()
    else:
        assert stack.vllm_config.cache_config.kv_cache_layout == "BLNHC"
        assert region.addr == next(iter(stack.kv_caches.values())).untyped_storage().data_ptr()
    assert region.nbytes == topology.num_blocks * 6 * topology.groups[0].spec.page_bytes
    # Blocks are outermost: a block of one layer sits next to the same block of the next.
    geometries = [topology.owners[n].geometry for n in topology.groups[0].layer_names]
    assert {g.block_stride for g in geometries} == {6 * topology.groups[0].spec.page_bytes}
    bases = sorted(g.base for g in geometries)
    assert [b - bases[0] for b in bases] == [i * geometries[0].block_bytes for i in range(6)]


@pytest.mark.parametrize("layout", ["kvcached_contiguous", "kvcached_per_layer"])
def test_kvcached_layouts(stack_topology, layout):
    stack, topology = stack_topology("gemma4_e2b_shape", layout)
    assert_owner_only(stack, topology, "gemma4_e2b_shape")
    page = topology.groups[0].spec.page_bytes
    capacity = next(iter(stack.kv_caches.values())).shape[0]
    assert capacity > topology.num_blocks  # the reservation is larger than what vLLM uses
    if layout == "kvcached_contiguous":
        # One reservation; only the blocks vLLM can hand out are registered.
        (region,) = topology.regions
        assert region.nbytes == topology.num_blocks * 3 * page
        assert {o.geometry.block_stride for o in topology.owners.values()} == {3 * page}
    else:
        assert len(topology.regions) == 3
        assert all(r.nbytes == topology.num_blocks * page for r in topology.regions)


def test_module_import_is_pure():
    import subprocess
    import sys

    code = (
        "import sys, kvshare_connector.layout.topology, kvshare_connector.layout.descriptors, "
        "kvshare_connector.transfer.wire.protocol; "
        "bad = [m for m in ('vllm', 'nixl', 'nixl_cu13', 'torch') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# ---- bad input ---------------------------------------------------------------------------

SPEC = LayerSpec(
    block_size=16, num_kv_heads=1, head_size=64, dtype="bfloat16", itemsize=2, kind="full"
)


def _view(num_blocks=8, heads=1, tokens=16, width=128, itemsize=2, ptr=1 << 20):
    strides = (heads * tokens * width, width, heads * width, 1)
    nbytes = num_blocks * heads * tokens * width * itemsize
    return TensorView(ptr, (num_blocks, heads, tokens, width), strides, itemsize, ptr, nbytes, -1)


LABELS = ("block", "head", "token", "content")


def test_sharer_whose_target_is_not_registered():
    groups = [GroupSpec(0, SPEC, ("a", "b"))]
    with pytest.raises(TopologyError, match="'b' reads the KV of 'x'.*owns no registered KV"):
        build_topology(groups, {"a": _view()}, {"a": LABELS}, {"b": "x"}, num_blocks=8)


def test_sharing_loop_and_chain():
    assert resolve_sharing({"c": "b", "b": "a"}, ["a"]) == {"c": "a", "b": "a"}
    with pytest.raises(TopologyError, match="loops"):
        resolve_sharing({"c": "b", "b": "c"}, ["a"])


def test_tensor_that_does_not_match_its_spec():
    groups = [GroupSpec(0, SPEC, ("a",))]
    with pytest.raises(TopologyError, match="layer 'a': content dim is 256 but the spec says 128"):
        build_topology(groups, {"a": _view(width=256)}, {"a": LABELS}, {}, num_blocks=8)
    with pytest.raises(TopologyError, match="layer 'a': tensor element size 4 B"):
        build_topology(groups, {"a": _view(itemsize=4)}, {"a": LABELS}, {}, num_blocks=8)
    with pytest.raises(TopologyError, match="layer 'a': tensor holds 4 kernel blocks.*needs 8"):
        build_topology(groups, {"a": _view(num_blocks=4)}, {"a": LABELS}, {}, num_blocks=8)


def test_sharer_handed_its_own_buffer():
    groups = [GroupSpec(0, SPEC, ("a", "b"))]
    views = {"a": _view(), "b": _view(ptr=1 << 30)}
    with pytest.raises(TopologyError, match="'b' was handed its own KV buffer"):
        build_topology(groups, views, {"a": LABELS}, {"b": "a"}, num_blocks=8)


def test_missing_owner_tensor():
    groups = [GroupSpec(0, SPEC, ("a", "c"))]
    with pytest.raises(TopologyError, match="no KV tensor for owner layer.*'c'"):
        build_topology(groups, {"a": _view()}, {"a": LABELS, "c": LABELS}, {}, num_blocks=8)


def test_labels_come_from_the_backend():
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    spec = LayerSpec(32, 2, 256, "bfloat16", 2, "sliding", 512)
    assert vllm_adapter.dim_labels(FlashAttentionBackend, spec, 32) == LABELS
