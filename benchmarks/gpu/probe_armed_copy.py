"""Can a copy be launched before its input is there, and started by a host write?

A landing's host launches (scatter ~0.3 ms, digests ~0.4 ms of host time at 32k) sit between
NIXL saying "done" and the bytes in place. CUDA's stream memory operations let a stream wait
on a 32-bit word (``cuStreamWaitValue32``): launch the copy behind such a wait while the READ
is on the wire, and release it with a plain store to pinned host memory once NIXL says done.
This measures, on one GPU: the host's launch of an indexed copy of a 32k request's shape, and
from the host's store to the copy done, against launching it then.

    python3 -m benchmarks.gpu.probe_armed_copy [--rows 6348 --word 32768 --rounds 20]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time

from benchmarks.copy_references import spread_ms


def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=6348)
    ap.add_argument("--word", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    wait_value = _driver()
    dev = torch.device("cuda")
    words = args.word // 8
    kv = torch.zeros((args.rows * 4, words), dtype=torch.int64, device=dev)
    staged = torch.randint(0, 1 << 30, (args.rows, words), dtype=torch.int64, device=dev)
    index = torch.randperm(args.rows * 4, device=dev)[: args.rows]
    stream = torch.cuda.Stream(priority=-(1 << 20))
    flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    flag_np = flag.numpy()
    out: dict[str, list[float]] = {"launch_ms": [], "launch_to_done_ms": [],
                                    "armed_launch_ms": [], "store_to_done_ms": []}
    for r in range(args.rounds + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            kv.index_copy_(0, index, staged)
            ev = torch.cuda.Event()
            ev.record(stream)
        t1 = time.perf_counter()
        while not ev.query():
            pass
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        flag_np[0] = 0
        value = r + 1
        a0 = time.perf_counter()
        rc = wait_value(ctypes.c_void_p(stream.cuda_stream), flag.data_ptr(), value, 0)  # GEQ
        if rc != 0:
            raise SystemExit(f"cuStreamWaitValue32 failed: CUresult {rc}")
        with torch.cuda.stream(stream):
            kv.index_copy_(0, index, staged)
            ev2 = torch.cuda.Event()
            ev2.record(stream)
        a1 = time.perf_counter()
        time.sleep(0.002)
        if ev2.query():
            raise SystemExit("the armed copy ran before its flag was set")
        s0 = time.perf_counter()
        flag_np[0] = value
        while not ev2.query():
            pass
        s1 = time.perf_counter()
        if r >= 2:
            out["launch_ms"].append((t1 - t0) * 1e3)
            out["launch_to_done_ms"].append((t2 - t0) * 1e3)
            out["armed_launch_ms"].append((a1 - a0) * 1e3)
            out["store_to_done_ms"].append((s1 - s0) * 1e3)
    torch.cuda.synchronize()
    summary = {k: spread_ms(v) for k, v in out.items()}
    summary["bytes"] = args.rows * args.word
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
