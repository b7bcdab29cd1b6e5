"""The host's part of decode's digests once a READ is done, before and after 48dbcac.

``verify_kv``'s digests of a request's blocks are planned while its claim is out and
launched once its READ is done (``Lander.land``). Since 48dbcac the plan also allocates the
digests' device output and the pinned host memory they come back in, and digests queued
behind a scatter no longer make their stream wait for the compute stream again. Both modes
run here on one GPU, alternating, over an E2B-shaped request (3 full-attention owner layers
of 32 KiB blocks over every block, 12 sliding ones of 16 KiB over a window's blocks, each
layer its own tensor laid out as vLLM lays out one), with no NIXL and no vLLM:

- ``before``: the launch allocates the output and its host copy and waits for the compute
  stream (what ``Lander.land`` did before 48dbcac);
- ``after``: the plan's output and host copy, no wait for the compute stream.

Timed per load: the launch's host seconds (``launch_ms``, what sits between NIXL's "done"
and the next poll) and launch -> digests on the host (``ready_ms``). Every load's digests
must equal the first load's, and a load with one byte changed must differ (the control).

    python3 -m lab.benchmarks.gpu.bench_digest_launch [--tokens 16384 32768] [--rounds 30]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from kvshare_connector.layout.topology import (
    BLOCK,
    CONTENT,
    HEAD,
    TOKEN,
    GroupSpec,
    KVTopology,
    LayerSpec,
    TensorView,
    build_topology,
)
from lab.benchmarks.copy_references import spread_ms

BLOCK_TOKENS = 16
SLIDING_WINDOW = 512
LAYERS = {"full": (3, 512), "sliding": (12, 256)}  # E2B's owners: (count, head size)


def e2b_shaped_kv(num_blocks: int, device: str) -> tuple[KVTopology, list[Any]]:
    """Per-layer KV tensors of E2B's 15 owner layers (one KV head, bf16), as vLLM views
    them: ``(blocks, heads, tokens, 2 * head_size)`` over NHD memory; two groups."""
    import torch

    groups, views, labels, tensors = [], {}, {}, []
    for index, (kind, (count, head)) in enumerate(LAYERS.items()):
        names = tuple(f"{kind}.{i}" for i in range(count))
        window = SLIDING_WINDOW if kind == "sliding" else None
        spec = LayerSpec(BLOCK_TOKENS, 1, head, "bfloat16", 2, kind, window)
        groups.append(GroupSpec(index, spec, names))
        for name in names:
            kv = torch.randint(-30000, 30000, (num_blocks, BLOCK_TOKENS, 1, 2 * head),
                               dtype=torch.int16, device=device).view(torch.bfloat16)  # fmt: skip
            tensors.append(kv)
            views[name] = TensorView.of(kv.permute(0, 2, 1, 3))
            labels[name] = (BLOCK, HEAD, TOKEN, CONTENT)
    return build_topology(groups, views, labels, {}, num_blocks), tensors


def request_blocks(tokens: int, num_blocks: int, rng: np.random.Generator) -> list[list[int]]:
    """Block ids per group as the scheduler hands a finished prefill over: every block for
    full attention, the window's last blocks for sliding (earlier ones null, 0)."""
    count = -(-tokens // BLOCK_TOKENS)
    full = (1 + rng.choice(num_blocks - 1, count, replace=False)).tolist()
    kept = -(-SLIDING_WINDOW // BLOCK_TOKENS) + 1
    sliding = [0] * (count - kept) + (1 + rng.choice(num_blocks - 1, kept, replace=False)).tolist()
    return [full, sliding]


def main() -> None:
    import torch

    from kvshare_connector.transfer.device.digests import Digester
    from kvshare_connector.transfer.device.packing import MemoryMap

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--blocks", type=int, default=4096, help="KV blocks per layer")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    topology, tensors = e2b_shaped_kv(args.blocks, args.device)
    digester = Digester(MemoryMap(tensors), args.device)
    on_gpu = args.device == "cuda"
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if on_gpu else "cpu"}
    for tokens in args.tokens:
        ids = request_blocks(tokens, args.blocks, rng)
        times = {m: {"launch_ms": [], "ready_ms": []} for m in ("before", "after")}
        reference = None
        for r in range(args.rounds + 2):
            for mode in ("before", "after") if r % 2 else ("after", "before"):
                plan = digester.plan(topology, ids)
                if mode == "before":  # as before 48dbcac: the launch allocates its own
                    plan.out = plan.host = None
                if on_gpu:
                    torch.cuda.synchronize()
                started = time.perf_counter()
                pending = digester.launch(plan, after_compute=mode == "before")
                launched = time.perf_counter()
                while not pending.ready():
                    pass
                digests = pending.result()
                ready = time.perf_counter()
                if reference is None:
                    reference = digests
                elif any(not np.array_equal(digests[k], v) for k, v in reference.items()):
                    raise SystemExit(f"{mode} {tokens}: digests differ from the first load's")
                if r >= 2:
                    times[mode]["launch_ms"].append((launched - started) * 1e3)
                    times[mode]["ready_ms"].append((ready - started) * 1e3)
        first = tensors[0]  # the control: one byte of a digested block changed
        saved = first[ids[0][0]].clone()
        first[ids[0][0]].view(torch.int16)[0, 0, 0] += 1
        changed = digester.start(topology, ids).result()
        first[ids[0][0]] = saved
        if np.array_equal(changed["full.0"], reference["full.0"]):
            raise SystemExit(f"{tokens}: a changed byte left the digests as they were")
        digested = sum(
            int(v.size) * topology.owners[k].geometry.block_bytes for k, v in reference.items()
        )
        out[str(tokens)] = {"bytes_digested": digested, **{
            m: {k: spread_ms(v) for k, v in t.items()} for m, t in times.items()}}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
