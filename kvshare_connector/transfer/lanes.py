"""The UCX lane of a READ: chosen before UCX starts, then measured and named.

NIXL 1.5.1 bundles UCX 1.23, and UCX alone decides which transport carries a READ of GPU
memory. Measured on one H200 (two processes, 2026-12-02, ``bench_nixl_read.py``):

* ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto`` (UCX's default) turns cuda_ipc GET zero-copy off
  when NVML shows no NVLink: a one-GPU host or a PCIe server READs through tcp software
  emulation at ~0.5 GB/s; ``=y`` gives 8.3 GB/s at 64 KiB and 1,281 GB/s at 16 MiB.
* memory from cuMemCreate without a shareable handle (kvcached, torch's expandable
  segments) is not legacy-IPC capable: cuda_ipc cannot export it (0.4-0.5 GB/s);
  ``UCX_RMA_PPLN_ENABLE=y`` pipelines it through UCX's own buffers (211 GB/s at 16 MiB).

So before the NIXL agent exists (UCX reads its settings when the agent starts) the
connector sets what gives the fast lane (``plan_lane`` / ``apply``); a user's own ``UCX_*``
value always wins, and ``ucx_lane: off`` leaves UCX's defaults alone. It does not trust
the choice: decode READs a small probe after each handshake (``transfer.probe``), and
``verdict`` names the lane that reached and says how to fix a slow one.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field

GET_ZCOPY = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
RMA_PPLN = "UCX_RMA_PPLN_ENABLE"
LANE_VARS = (GET_ZCOPY, RMA_PPLN)
MODES = ("auto", "off")
LANE_ENV = "KVSHARE_UCX_LANE"  # the ucx_lane option for tools without kv_connector_extra_config
SLOW_GBPS = 5.0  # below this a READ of GPU memory is not on a zero-copy or pipelined lane

_APPLIED: dict[str, str] = {}  # what this process set itself (not the user's)

_CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10


@dataclass(frozen=True)
class LanePlan:
    """UCX settings the connector applies (``chosen``) and the user's own it keeps."""

    chosen: Mapping[str, str] = field(default_factory=dict)
    kept: Mapping[str, str] = field(default_factory=dict)  # user's UCX_* values, untouched
    reasons: Mapping[str, str] = field(default_factory=dict)  # why each chosen one

    def describe(self) -> str:
        parts = [f"{k}={v} ({self.reasons.get(k, 'chosen')})" for k, v in self.chosen.items()]
        parts += [f"{k}={v} (yours, kept)" for k, v in self.kept.items()]
        return ", ".join(parts) if parts else "UCX defaults"


@dataclass(frozen=True)
class LaneInfo:
    """What prefill tells decode of its lane: its UCX settings, and whether cuda_ipc can
    export its KV memory (False: VMM, e.g. kvcached; None: unknown or host memory)."""

    settings: Mapping[str, str] = field(default_factory=dict)
    kv_ipc_capable: bool | None = None


def user_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The lane variables set by the user (not by ``apply`` in this process)."""
    return {
        k: environ[k] for k in LANE_VARS if k in environ and _APPLIED.get(k) != environ[k]
    }


def effective(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The lane variables in force (set by anyone)."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in LANE_VARS if k in environ}


def plan_lane(
    mem_kinds: Iterable[str],
    vmm: bool,
    environ: Mapping[str, str] | None = None,
    mode: str = "auto",
) -> LanePlan:
    """What to set for memory of ``mem_kinds`` (``VRAM`` / ``DRAM``); ``vmm``: some of it
    is not legacy-IPC capable (kvcached), so blocks read from it unpacked (no staging room,
    packing off) need UCX's pipelined protocol."""
    if mode not in MODES:
        raise ValueError(f"ucx_lane must be one of {MODES}, got {mode!r}")
    environ = os.environ if environ is None else environ
    kept = user_settings(environ)
    if mode == "off" or "VRAM" not in set(mem_kinds):
        return LanePlan(kept=kept)
    wanted = {GET_ZCOPY: ("y", "cuda_ipc GET zero-copy, off by UCX's default without NVLink")}
    if vmm:
        wanted[RMA_PPLN] = ("y", "VMM KV memory that cuda_ipc cannot export")
    chosen = {k: v for k, (v, _) in wanted.items() if k not in kept}
    reasons = {k: why for k, (_, why) in wanted.items() if k not in kept}
    return LanePlan(chosen, kept, reasons)


def apply(plan: LanePlan, environ: MutableMapping[str, str] | None = None) -> None:
    """Set the plan's variables (before the NIXL agent, hence UCX, starts)."""
    environ = os.environ if environ is None else environ
    for key, value in plan.chosen.items():
        environ[key] = value
        _APPLIED[key] = value


def legacy_ipc_capable(addr: int) -> bool | None:
    """Whether CUDA can export the memory at ``addr`` with a legacy IPC handle (what UCX's
    cuda_ipc needs); None where the driver cannot be asked (no CUDA, host memory)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    value = ctypes.c_int(0)
    rc = cuda.cuPointerGetAttribute(
        ctypes.byref(value),
        _CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
        ctypes.c_uint64(addr),
    )
    return None if rc else bool(value.value)


def is_local_host(host: str) -> bool:
    """``host`` is this machine (loopback, or this host's name or address)."""
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        if host == "localhost":
            return True
    try:
        names = socket.gethostbyname_ex(socket.gethostname())
    except OSError:
        return False
    return host in (names[0], *names[1], *names[2])


@dataclass(frozen=True)
class Verdict:
    """A probe's reading: the lane's name, whether it is the slow one, and the fix."""

    lane: str
    slow: bool
    fix: str | None = None


def verdict(
    local_kind: str,
    remote_kind: str,
    gbps: float,
    same_host: bool,
    environ: Mapping[str, str] | None = None,
) -> Verdict:
    """Name the lane a probe READ of ``remote_kind`` memory into ``local_kind`` took."""
    environ = os.environ if environ is None else environ
    if "VRAM" not in (local_kind, remote_kind):
        return Verdict("host memory", False)
    if gbps >= SLOW_GBPS:
        return Verdict("cuda_ipc zero-copy" if same_host else "GPU RDMA", False)
    zcopy = environ.get(GET_ZCOPY, "auto")
    if zcopy.lower() not in ("y", "yes", "1", "on", "true"):
        fix = (
            f"set {GET_ZCOPY}=y in both engines' environment (it is {zcopy!r} here; UCX "
            "turns cuda_ipc GET off without NVLink)"
        )
    elif same_host:
        # Enabled, and still slow for the whole probe: either UCX took another lane or the
        # device was busy with other processes' work all along; speed alone cannot tell.
        return Verdict(
            "slow with cuda_ipc GET enabled",
            True,
            "check that UCX_TLS allows cuda_ipc and that both GPUs can reach each other "
            "(peer access), and whether other processes kept the GPU busy; UCX_PROTO_INFO=y "
            "prints UCX's choice",
        )
    else:
        fix = "no RDMA lane between the hosts: check UCX_TLS and UCX_NET_DEVICES"
    return Verdict("software emulation (tcp)", True, fix)
