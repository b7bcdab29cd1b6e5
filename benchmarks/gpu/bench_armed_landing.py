"""The landing of a packed READ with and without a gate (``transfer.gates``), on one GPU.

What a packed load does after its READ is posted, with the READ itself played by a device
copy into the staging slot on a stream of its own (UCX's cuda_ipc GET is such a copy, made
in decode's process), so no NIXL and no vLLM are needed: the host polls the READ's event
as decode polls NIXL, then either launches the scatter (unarmed, as ``Lander.land`` does
without gates) or only opens the gate the scatter was queued behind right after the post
(armed). Timed per load: post -> bytes in place, and done -> in place; both modes
alternate, every load's blocks are checked against the source.

    python3 -m benchmarks.gpu.bench_armed_landing [--tokens 16384 32768] [--rounds 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from benchmarks.copy_references import spread_ms

RUN = 32768  # bytes of one layer-block run of Gemma-4 E2B's KV (block 16 tokens)
RUNS_PER_TOKEN = 6348 / 32768  # a 32k request: 6,348 runs (207.6 MB)


def main() -> None:
    import torch

    from kvshare_connector.transfer.gates import StreamGates
    from kvshare_connector.transfer.packing import MemoryMap, Packer, StagingArea

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--kv-gib", type=float, default=2.0)
    args = ap.parse_args()
    kv = torch.zeros(int(args.kv_gib * 2**30), dtype=torch.uint8, device="cuda")
    packer = Packer(MemoryMap([kv]), StagingArea(512 << 20, "cuda"))
    gates, how = StreamGates.create("cuda")
    if gates is None:
        raise SystemExit(f"armed landing {how}")
    wire = torch.cuda.Stream()
    rng = np.random.default_rng(0)
    out: dict[str, object] = {"gpu": torch.cuda.get_device_name(), "gates": how}
    for tokens in args.tokens:
        runs = round(tokens * RUNS_PER_TOKEN)
        slots = kv.numel() // RUN
        addr = kv.data_ptr() + RUN * np.sort(rng.choice(slots, runs, replace=False))
        length = np.full(runs, RUN, dtype=np.int64)
        staged = np.arange(runs, dtype=np.int64) * RUN
        nbytes = runs * RUN
        source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
        rows = torch.from_numpy((addr - kv.data_ptr()) // RUN).cuda()
        times: dict[str, dict[str, list[float]]] = {
            m: {"post_to_in_place_ms": [], "done_to_in_place_ms": [], "host_after_done_ms": []}
            for m in ("unarmed", "armed")
        }
        for r in range(args.rounds + 2):
            for mode in ("unarmed", "armed") if r % 2 else ("armed", "unarmed"):
                plan = packer.plan_copy(addr, length, staged)  # planned ahead, as decode does
                slot = packer.staging.allocate(nbytes)
                assert slot is not None
                into = packer.staging.buffer[slot : slot + nbytes]
                torch.cuda.synchronize()
                posted = time.perf_counter()
                with torch.cuda.stream(wire):  # the READ: a device copy into the slot
                    into.copy_(source, non_blocking=True)
                    read_done = torch.cuda.Event()
                    read_done.record(wire)
                gate = copy = None
                if mode == "armed":
                    gate = gates.arm()
                    copy = packer.scatter(addr, length, staged, slot=slot, plan=plan,
                                          stream=gate.stream)  # fmt: skip
                while not read_done.query():
                    pass
                done = time.perf_counter()
                if gate is not None:
                    gate.open()
                else:
                    copy = packer.scatter(addr, length, staged, slot=slot, plan=plan)
                launched = time.perf_counter()
                while not copy.done():
                    pass
                in_place = time.perf_counter()
                torch.cuda.synchronize()
                landed = kv.view(-1, RUN)[rows].reshape(-1)
                if not torch.equal(landed, source):
                    raise SystemExit(f"{mode} {tokens}: the blocks differ from the source")
                kv.view(-1, RUN)[rows] = 0
                packer.staging.release(slot)
                if r >= 2:
                    t = times[mode]
                    t["post_to_in_place_ms"].append((in_place - posted) * 1e3)
                    t["done_to_in_place_ms"].append((in_place - done) * 1e3)
                    t["host_after_done_ms"].append((launched - done) * 1e3)
        out[str(tokens)] = {
            "bytes": nbytes,
            **{m: {k: spread_ms(v) for k, v in t.items()} for m, t in times.items()},
            "post_to_in_place_gbps_p50": {
                m: round(nbytes / statistics.median(t["post_to_in_place_ms"]) / 1e6, 1)
                for m, t in times.items()
            },
        }
    gates.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
