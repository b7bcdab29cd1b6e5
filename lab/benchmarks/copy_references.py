"""Reference copies for the transfer benchmark: what a READ of the same bytes is measured
against on one host (a memcpy, the kernel's cross-process copy that UCX's CMA transport
makes, a memmove into the READ's own rows), and how rounds are timed and summarised.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np


def summary(times: list[float], nbytes: int) -> dict[str, float]:
    median = statistics.median(times)
    return {
        "median_s": median,
        "min_s": min(times),
        "max_s": max(times),
        "stdev_s": statistics.stdev(times) if len(times) > 1 else 0.0,
        "gb_per_s": nbytes / median / 1e9,
    }


def spread_ms(values: list[float]) -> dict[str, float]:
    """Median and range of per-round milliseconds, as the GPU landing benchmarks report them."""
    return {"p50": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4)}  # fmt: skip


def timed(fn: Callable[[], object], warmup: int, repeat: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def time_memcpy(nbytes: int, warmup: int, repeat: int) -> list[float]:
    src = np.full(nbytes, 0x33, dtype=np.uint8)
    dst = np.empty_like(src)
    return timed(lambda: np.copyto(dst, src), warmup, repeat)


def time_cma(pid: int, regions: list[list[int]], nbytes: int, warmup: int, repeat: int):
    """``process_vm_readv`` of ``nbytes`` of the prefill's KV memory, 64 MiB per call: the
    kernel copy UCX's CMA transport makes for a READ between two processes of one host, with
    no UCX around it (None where the kernel refuses it)."""
    libc = ctypes.CDLL(None, use_errno=True)

    class Iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    dst = np.empty(nbytes, dtype=np.uint8)
    chunk = 64 << 20
    calls, done = [], 0
    for addr, size in regions:
        offset = 0
        while offset < size and done < nbytes:
            n = min(chunk, size - offset, nbytes - done)
            calls.append((addr + offset, done, n))
            offset, done = offset + n, done + n

    def copy() -> None:
        for remote, local, n in calls:
            liov = Iovec(dst.ctypes.data + local, n)
            riov = Iovec(remote, n)
            if libc.process_vm_readv(pid, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0) != n:
                raise OSError(ctypes.get_errno(), "process_vm_readv")

    try:
        return timed(copy, warmup, repeat)
    except OSError as exc:
        print(f"process_vm_readv refused: {exc}", file=sys.stderr)
        return None


def time_memmove(rows: list[np.ndarray], warmup: int, repeat: int) -> list[float]:
    """Copy a contiguous buffer into the same local rows the READ filled, row by row."""
    nbytes = sum(int(r[:, 1].sum()) for r in rows)
    src = np.full(nbytes, 0x33, dtype=np.uint8)
    flat = np.concatenate(rows)[:, :2].tolist()

    def copy() -> None:
        src_addr = src.ctypes.data
        for addr, length in flat:
            ctypes.memmove(addr, src_addr, length)
            src_addr += length

    return timed(copy, warmup, repeat)


def idle_cpu(seconds: float) -> float:
    """CPU cores this process uses while it waits (no NIXL call from this thread)."""
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(seconds)
    return (time.process_time() - cpu0) / (time.monotonic() - wall0)
