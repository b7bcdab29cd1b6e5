"""The demo's parts, shared by its one-host run (``demo.run``) and its two-host roles
(``demo.hosts``): the KV the processes build, the requests' blocks, the read and its check,
the report."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from kvshare_connector.demo import kvcheck

MAX_MODEL_LEN = 2048  # of the demo's KV caches: a request has at most this many tokens


PROBE_MIB = 4  # the lane probe decode READs and checks after the handshake


def blocks_per_group(topology: Any, tokens: int) -> list[int]:
    """Blocks of one request of ``tokens`` tokens per group; sliding-window groups keep
    only the blocks of the window (+1 for alignment, as vLLM clips them)."""
    counts = []
    for group in topology.groups:
        blocks = math.ceil(tokens / group.spec.block_size)
        if group.spec.sliding_window:
            blocks = min(blocks, math.ceil(group.spec.sliding_window / group.spec.block_size) + 1)
        counts.append(blocks)
    return counts


def requests_block_ids(topology: Any, tokens: int, count: int, seed: int) -> list[list[list[int]]]:
    """Block ids a vLLM block pool could give ``count`` requests, per group: distinct
    across groups and requests, shuffled, never the null block 0."""
    import numpy as np

    per_group = blocks_per_group(topology, tokens)
    need = count * sum(per_group)
    if need >= topology.num_blocks:
        raise ValueError(
            f"{count} request(s) of {tokens} tokens need {need} blocks, the cache has "
            f"{topology.num_blocks}"
        )
    pool = np.random.default_rng(seed).permutation(np.arange(1, topology.num_blocks))
    out, start = [], 0
    for _ in range(count):
        request = []
        for n in per_group:
            request.append([int(b) for b in pool[start : start + n]])
            start += n
        out.append(request)
    return out


def request_block_ids(topology: Any, tokens: int, seed: int) -> list[list[int]]:
    """Block ids of one request (see ``requests_block_ids``)."""
    return requests_block_ids(topology, tokens, 1, seed)[0]


def build(model: str, layout: str, kv_mib: int, max_model_len: int) -> tuple[Any, Any]:
    from kvshare_connector.demo.cpu_stack import build_cpu_stack, topology_of

    stack = build_cpu_stack(model, layout, kv_bytes=kv_mib << 20, max_model_len=max_model_len)
    return stack, topology_of(stack)


def cpu_packer(stack: Any, packed_mib: int) -> Any:
    """A host staging area over this process's KV tensors (None: packing off)."""
    if packed_mib <= 0:
        return None
    from kvshare_connector.transfer.device.packing import MemoryMap, Packer, StagingArea

    return Packer(MemoryMap(stack.kv_caches.values()), StagingArea(packed_mib << 20, "cpu"))


def cpu_digester(stack: Any) -> Any:
    """``verify_kv`` digests over this process's KV tensors, on the host."""
    from kvshare_connector.transfer.device.digests import Digester
    from kvshare_connector.transfer.device.packing import MemoryMap

    return Digester(MemoryMap(stack.kv_caches.values()), "cpu")


def held_params(source: Any, request_id: str, ids: list[list[int]], tokens: int) -> dict:
    """The ``kv_transfer_params`` decode reads a request ``source`` holds with: what a
    prefill engine's connector would hand back for it."""
    from kvshare_connector.transfer.wire.kv_params import kv_transfer_params

    return kv_transfer_params(
        remote_block_ids=ids,
        remote_engine_id=source.settings.engine_id,
        remote_request_id=request_id,
        remote_host=source.host,
        remote_port=source.port,
        remote_num_tokens=tokens,
    )


@dataclass
class ReadResult:
    done: bool
    failure: str | None
    seconds: float
    bytes: int
    descriptors: int
    mismatches: list[str]
    stray: list[str]
    packed: bool = False


def read_and_check(
    sink: Any,
    stack: Any,
    topology: Any,
    params: dict[str, Any],
    local_ids: list[list[int]],
    seed: int,
    request_id: str,
    timeout_s: float = 60.0,
    check_ids: list[list[int]] | None = None,
) -> ReadResult:
    """Read one request through ``sink`` and check the pattern landed in ``local_ids``."""
    from kvshare_connector.transfer.wire.kv_params import remote_prefill_params

    start = time.monotonic()
    sink.request(request_id, remote_prefill_params(params), local_ids)
    done, failed = set(), {}
    while request_id not in done and request_id not in failed:
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"read of {request_id} neither finished nor failed")
        d, f = sink.poll()
        done |= d
        failed.update(f)
        time.sleep(0.001)
    seconds = time.monotonic() - start
    record = next((r for r in sink.records if r.request_id == request_id), None)
    expected = check_ids if check_ids is not None else local_ids
    return ReadResult(
        done=request_id in done,
        failure=failed.get(request_id),
        seconds=seconds,
        bytes=record.bytes if record else 0,
        descriptors=record.descriptors if record else 0,
        packed=bool(record and record.packed),
        mismatches=kvcheck.mismatches(stack.kv_caches, topology, expected, seed=seed),
        stray=kvcheck.nonzero_blocks_outside(stack.kv_caches, topology, expected),
    )


def report_table(
    ready: dict[str, Any],
    stack: Any,
    topology: Any,
    local_ids: list[list[int]],
    result: Any,
    lanes: list[Any],
    released: bool | None,
    negative: Any,
    refused: bool,
    extra: list[tuple[str, str]] | None = None,
) -> None:
    """The demo's table: what was registered, read and checked (``released`` None: prefill,
    on another host, says), then the ``extra`` rows."""
    layers = len(stack.kv_caches)
    bad_layers = len({m.split(" ")[0] for m in result.mismatches})
    rows = [
        ("prefill layout", ready["layout"]),
        ("decode layout", topology.layout),
        (
            "owner layers registered",
            f"{ready['owners']} (prefill), {len(topology.owners)} (decode)",
        ),
        ("sharing layers", f"{len(topology.sharers)} (never registered)"),
        ("registered bytes (prefill)", f"{ready['registered_bytes']:,}"),
        ("KV cache groups", str(len(topology.groups))),
        ("blocks read", str(sum(len(i) for i in local_ids))),
        ("bytes read", f"{result.bytes:,}"),
        ("descriptors", str(result.descriptors)),
        ("moved packed (staging areas, a few large runs)", str(result.packed)),
        ("read time (incl. handshake)", f"{result.seconds * 1000:.1f} ms"),
        (
            "lane (probe READ, bytes checked)",
            ", ".join(f"{lane.lane}, {lane.gbps:.2f} GB/s" for lane in lanes) or "not measured",
        ),
        ("layers holding prefill's KV (owners + sharers)", f"{layers - bad_layers}/{layers}"),
        ("stray writes outside the request", str(len(result.stray))),
        (
            "prefill released the blocks",
            "see prefill's output" if released is None else str(released),
        ),
        (
            "negative control (blocks misplaced) detected",
            f"{negative.done and bool(negative.mismatches)} ({len(negative.mismatches)} bad "
            "blocks)",
        ),
        ("negative control (reordered block list) refused by prefill", str(refused)),
        *(extra or []),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def zero_kv(topology: Any) -> None:
    import ctypes

    for region in topology.regions:
        ctypes.memset(region.addr, 0, region.nbytes)

