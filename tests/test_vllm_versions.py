"""What differs between vLLM 0.26, 0.33 and 0.34, on each release's real objects.

vLLM 0.33 lays every KV cache group's layers into one buffer in the ``KVCacheLayout`` it
resolves and hands over strided ``[B, H, N, C]`` views; the topology must find each
owner's bytes in every layout vLLM can build. Sleep mode (0.33 calls it; the methods work
on 0.26 too) must leave nothing registered with memory that is about to be released.
vLLM 0.34 asks a connector how it reaches the KV memory before it decides to map it with
driver virtual memory, and no longer names resumed requests. Tests of one release skip on
the others, saying why.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from kvshare_connector.toolkit.procs import pick_free_port
from kvshare_connector.vllm import compat
from lab.tools.engine_sim import Engine

needs_layouts = pytest.mark.skipif(
    not compat.HAS_KV_CACHE_LAYOUT,
    reason=f"vLLM {compat.vllm_version()} has no KVCacheLayout (vLLM >= 0.29)",
)
needs_kv_cache_access = pytest.mark.skipif(
    compat.KVCacheAccess is None,
    reason=f"vLLM {compat.vllm_version()} does not ask connectors how they reach the KV (0.34)",
)
needs_failed_recving = pytest.mark.skipif(
    not compat.HAS_FAILED_RECVING,
    reason=f"vLLM {compat.vllm_version()} reports load failures by block (failed_recving: 0.30)",
)


def _block_bytes_by_view(view: Any, block: int) -> set[int]:
    """Byte offsets (from the storage start) of every byte of logical block ``block``."""
    item = view.element_size()
    offsets = np.array([view.storage_offset() + 0], dtype=np.int64)
    sub = view[block]
    offsets = offsets + view.stride(0) * block
    for size, stride in zip(sub.shape, sub.stride(), strict=True):
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64) * stride).reshape(-1)
    return set((offsets[:, None] * item + np.arange(item)).reshape(-1).tolist())


def _block_bytes_by_geometry(owner: Any, storage_ptr: int, block: int) -> set[int]:
    g = owner.geometry
    start = g.base - storage_ptr + block * g.block_stride
    return {start + o + i for o in g.segment_offsets for i in range(g.segment_len)}


def _assert_geometry_is_the_views(stack: Any, topology: Any) -> None:
    """Each owner's geometry names exactly the bytes vLLM's own view gives its blocks."""
    for name, owner in topology.owners.items():
        view = stack.kv_caches[name]
        storage = view.untyped_storage().data_ptr()
        for block in (0, 1, topology.num_blocks - 1):
            assert _block_bytes_by_geometry(owner, storage, block) == _block_bytes_by_view(
                view, block
            ), f"{name} block {block}"


# ---- vLLM 0.33: every layout it builds ----------------------------------------------------


@needs_layouts
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC"])
def test_uniform_model_in_every_layout(stack_topology, layout):
    stack, topology = stack_topology("g4uniform", layout)
    assert stack.vllm_config.cache_config.kv_cache_layout == layout
    assert stack.cross_layer_tensor is None  # 0.33 hands strided per-layer views only
    assert len(topology.owners) == 6 and len(topology.sharers) == 4
    (region,) = topology.regions  # one buffer for the whole group
    _assert_geometry_is_the_views(stack, topology)
    page = topology.groups[0].spec.page_bytes
    strides = {o.geometry.block_stride for o in topology.owners.values()}
    # Block-major layouts put every layer's page of a block side by side.
    assert strides == ({6 * page} if layout.startswith("B") else {page})
    assert region.nbytes == topology.num_blocks * 6 * page


@needs_layouts
@pytest.mark.parametrize("layout", ["per_layer", "LBHNC"])
def test_mixed_shapes_layer_major(stack_topology, layout):
    """Gemma-4 E2B (sliding head 256, full head 512, 20 sharers): 5 groups over one buffer."""
    stack, topology = stack_topology("gemma4_e2b_shape", layout)
    assert len(topology.owners) == 15 and len(topology.sharers) == 20
    assert len(topology.groups) == 5
    assert len(topology.regions) == 1
    _assert_geometry_is_the_views(stack, topology)


@needs_layouts
def test_head_order_differs_between_nhd_and_hnd(stack_topology):
    """With 4 KV heads the physical order inside a block differs (tokens or heads first),
    and the handshake's comparison names it instead of reading the wrong bytes."""
    from kvshare_connector.demo.cpu_stack import MODELS
    from kvshare_connector.layout.matching import differences

    if "gemma4_e2b_kv4" not in MODELS:
        pytest.skip("no packaged model with several KV heads")

    nhd = stack_topology("gemma4_e2b_kv4", "LBNHC", 192)
    hnd = stack_topology("gemma4_e2b_kv4", "LBHNC", 192)
    for stack, topology in (nhd, hnd):
        _assert_geometry_is_the_views(stack, topology)
    name = next(iter(nhd[1].owners))
    orders = [t.owners[name].geometry.order for _, t in (nhd, hnd)]
    assert [label for label, _ in orders[0]] == ["token", "head", "content"]
    assert [label for label, _ in orders[1]] == ["head", "token", "content"]
    found = differences(nhd[1], hnd[1])
    assert len(found) == 15 and all("block content order differs" in f for f in found)


@needs_layouts
def test_connector_states_its_layout_wish():
    from vllm.config import KVTransferConfig

    from kvshare_connector.connector import KVShareConnector

    class Config:
        def __init__(self, extra: dict[str, Any]):
            self.kv_transfer_config = KVTransferConfig(
                kv_connector="KVShareConnector",
                kv_role="kv_both",
                kv_connector_extra_config=extra,
            )

    assert KVShareConnector.get_required_kvcache_layout(Config({})) is None
    wish = KVShareConnector.get_required_kvcache_layout(Config({"cross_layer_blocks": True}))
    assert wish == "BLNHC"


def test_vllm_026_asks_for_no_layout():
    if compat.HAS_KV_CACHE_LAYOUT:
        pytest.skip(f"vLLM {compat.vllm_version()} resolves a KVCacheLayout (0.29+)")
    assert compat.required_kv_cache_layout(True) is None
    assert compat.cross_layer_blocks_default(kvcached_on=False) is True


def test_the_releases_own_block_size(stack_topology):
    """Without ``--block-size`` vLLM 0.34 makes 64-token blocks (0.26, 0.33: 16; the tests
    build 16 on every release). The topology reads that geometry off vLLM's views too, and a
    prefill and a decode that differ in it (two releases, both on their default) are told
    apart group by group before a byte moves."""
    from kvshare_connector.demo.cpu_stack import BLOCK_SIZE, build_cpu_stack, topology_of
    from kvshare_connector.layout.matching import differences

    stack = build_cpu_stack("gemma4_e2b_shape", "per_layer", block_size=None)
    topology = topology_of(stack)
    _assert_geometry_is_the_views(stack, topology)
    default = stack.vllm_config.cache_config.block_size
    _, sixteen = stack_topology("gemma4_e2b_shape", "per_layer")
    found = differences(sixteen, topology)
    if default == BLOCK_SIZE:
        assert found == []
        return
    pairs = list(zip(sixteen.groups, topology.groups, strict=True))
    assert all(h.spec.block_size * BLOCK_SIZE == g.spec.block_size * default for g, h in pairs)
    named = [f for f in found if " block_size: local " in f]
    assert named == [
        f"group {g.index} block_size: local {g.spec.block_size}, remote {h.spec.block_size}"
        for g, h in pairs
    ]


# ---- sleep mode: unregister and restore ---------------------------------------------------


def test_sleep_drops_registrations_and_wake_serves_again():
    """A prefill engine that sleeps deregisters its KV memory from NIXL (its agent goes),
    gives back the blocks it held for decode, and after waking serves a new request that a
    decode engine reads byte-exactly."""
    port = pick_free_port()
    prefill = Engine("g4tiny", "per_layer", "kv_producer", port, {"kv_lease_duration": 60})
    decode = None
    try:
        worker = prefill.worker.worker
        prefill.add("p0", 200, 1, {"do_remote_decode": True}, 0)
        prefill.run_until(lambda: "p0" in prefill.outputs)
        pool = prefill.scheduler.kv_cache_manager.block_pool
        total = pool.num_gpu_blocks - 1
        assert pool.get_num_free_blocks() < total  # held for decode
        before = worker.backend
        transport = before.source.transport
        assert transport._regions

        prefill.worker.unregister_kv_caches()
        prefill.worker.unregister_kv_caches()  # idempotent
        assert not transport._regions and not transport._registered
        prefill.step()  # the held request is reported sent: vLLM frees its blocks
        assert pool.get_num_free_blocks() == total

        prefill.worker.restore_kv_caches()
        prefill.worker.restore_kv_caches()  # idempotent
        after = worker.backend
        assert after is not before
        assert set(worker.topology.regions) <= after.source.transport._regions  # (+ staging)

        prefill.add("p1", 200, 1, {"do_remote_decode": True}, 1)
        prefill.run_until(lambda: "p1" in prefill.outputs)
        params = prefill.outputs["p1"].kv_transfer_params
        decode = Engine("g4tiny", "per_layer", "kv_consumer", pick_free_port())
        decode.add("d1", 200, 2, params, 1)
        # A time bound, not a step count: idle steps are fast, and 20,000 of them once ran
        # out before the handshake with the re-registered prefill was done (2026-12-04).
        deadline = time.monotonic() + 60.0
        while "d1" not in decode.outputs and time.monotonic() < deadline:
            decode.step()
            prefill.step()
        assert decode.loaded == {"d1": []}
        assert decode.outputs["d1"].kv_transfer_params is None  # no load error
    finally:
        if decode is not None:
            decode.close()
        prefill.close()


# ---- load failures ------------------------------------------------------------------------


@needs_failed_recving
def test_failed_load_follows_vllms_fail_policy():
    """From vLLM 0.30 a failed load is named in failed_recving: under the default "fail"
    policy vLLM ends the request with an error, under any number of KV cache groups, and
    its blocks go back."""
    decode = Engine(
        "g4tiny",
        "per_layer",
        "kv_consumer",
        pick_free_port(),
        {"handshake_timeout_s": 1.0, "transfer_timeout_s": 2.0},
    )
    try:
        params = {
            "do_remote_prefill": True,
            "remote_block_ids": [[1, 2]] * 6,
            "remote_engine_id": "gone",
            "remote_request_id": "p0",
            "remote_host": "127.0.0.1",
            "remote_port": pick_free_port(),  # nothing listens here
            "tp_size": 1,
        }
        decode.add("d0", 200, 3, params, 0)
        decode.run_until(lambda: "d0" in decode.outputs)
        output = decode.outputs["d0"]
        assert str(output.finish_reason) == "error"
        pool = decode.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
        assert not decode.scheduler.connector.scheduler.load_errors  # nothing left behind
    finally:
        decode.close()


def test_loads_restore_every_group(stack_topology):
    stack, _ = stack_topology("g4tiny", "per_layer")
    assert compat.transfer_group_ids(stack.kv_cache_config) == tuple(range(6))


# ---- vLLM 0.34: how the connector reaches the KV memory -----------------------------------


def _transfer_config(connector: str, extra: dict[str, Any]) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as EngineArgs does: registers KVShareConnector by name
    return KVTransferConfig(
        kv_connector=connector, kv_role="kv_both", kv_connector_extra_config=extra
    )


@needs_kv_cache_access
def test_vllm_learns_that_the_nixl_backend_registers_its_kv():
    """vLLM 0.34's own questions, answered through its factory from the connector class:
    NIXL registers the KV with UCX and a peer on the host maps it (one physical allocation
    per segment, FABRIC handles), so vLLM keeps driver-mapped memory off without an IMEX
    channel; LMCache copies in-process. The control: a connector that declares nothing
    (vLLM's ExampleConnector) is taken to be in-process, which for NIXL would hand UCX
    memory that a peer cannot map."""
    from vllm.v1.worker.extensible_kv_cache import kv_cache_export_handle_types

    access = compat.KVCacheAccess
    nixl = _transfer_config("KVShareConnector", {})
    assert nixl.kv_cache_access() == access.REGISTERS | access.EXPORTS_FABRIC
    assert nixl.registers_kv_cache_memory()

    class Config:
        kv_transfer_config = nixl

    assert kv_cache_export_handle_types(Config()) != 0  # FABRIC: exportable to the peer
    lmcache = _transfer_config("KVShareConnector", {"backend": "lmcache"})
    assert lmcache.kv_cache_access() == access.IN_PROCESS
    assert not lmcache.registers_kv_cache_memory()
    plain = _transfer_config("ExampleConnector", {})
    assert plain.kv_cache_access() == access.IN_PROCESS and not plain.registers_kv_cache_memory()


def test_resumed_requests_by_release():
    """Which scheduled requests bring their whole block table again: 0.33 names resumed ones
    among the cached requests, 0.34 sends them as new ones (none of its cached requests is
    resumed). Read off the ``SchedulerOutput`` each release builds."""
    from vllm.v1.core.sched.output import SchedulerOutput

    from kvshare_connector.vllm.scheduler import scheduled_requests

    output = SchedulerOutput.make_empty()
    cached = output.scheduled_cached_reqs
    cached.req_ids.append("r0")
    cached.new_block_ids.append(([7],))
    cached.num_computed_tokens.append(64)
    if hasattr(cached, "resumed_req_ids"):
        cached.resumed_req_ids.add("r0")
    output.num_scheduled_tokens["r0"] = 1

    (step,) = scheduled_requests(output)
    assert step.restarted == hasattr(cached, "resumed_req_ids")
    assert step.new_block_ids == ([7],) and step.num_computed_tokens == 64
