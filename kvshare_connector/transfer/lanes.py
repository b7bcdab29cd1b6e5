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

UCX's reach follows the side channel's (``side_channel_reach``): creating an agent opens
a TCP listener on every network interface (seen: 127.0.0.1 and the host's 192.0.2.2 for
a prefill whose side channel listens on 127.0.0.1 only). Where every side channel the
engine serves or may connect to is on loopback, ``UCX_NET_DEVICES`` names the loopback
interface; otherwise, or with ``ucx_lane: off``, the plan says UCX uses every device, and
why.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

from kvshare_connector.transfer.kv_params import is_loopback

GET_ZCOPY = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
RMA_PPLN = "UCX_RMA_PPLN_ENABLE"
NET_DEVICES = "UCX_NET_DEVICES"
LANE_VARS = (GET_ZCOPY, RMA_PPLN, NET_DEVICES)
MODES = ("auto", "off")
LANE_ENV = "KVSHARE_UCX_LANE"  # the ucx_lane option for tools without kv_connector_extra_config
SLOW_GBPS = 5.0  # below this a READ of GPU memory is not on a zero-copy or pipelined lane

_APPLIED: dict[str, str] = {}  # what this process set itself (not the user's)

_CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
_IFF_LOOPBACK = 0x8


@dataclass(frozen=True)
class LanePlan:
    """UCX settings the connector applies (``chosen``) and the user's own it keeps."""

    chosen: Mapping[str, str] = field(default_factory=dict)
    kept: Mapping[str, str] = field(default_factory=dict)  # user's UCX_* values, untouched
    reasons: Mapping[str, str] = field(default_factory=dict)  # why each chosen one
    listens: str | None = None  # where UCX listens when the plan does not restrict it

    def describe(self) -> str:
        parts = [f"{k}={v} ({self.reasons.get(k, 'chosen')})" for k, v in self.chosen.items()]
        parts += [f"{k}={v} (yours, kept)" for k, v in self.kept.items()]
        text = ", ".join(parts) if parts else "UCX defaults"
        return f"{text}; {self.listens}" if self.listens else text


@dataclass(frozen=True)
class Reach:
    """Whether every side channel an engine serves or may connect to is on loopback, and
    what decided it (for the start line)."""

    loopback: bool
    why: str


@dataclass(frozen=True)
class LaneInfo:
    """What prefill tells decode of its lane: its UCX settings, and whether cuda_ipc can
    export its KV memory (False: VMM, e.g. kvcached; None: unknown or host memory)."""

    settings: Mapping[str, str] = field(default_factory=dict)
    kv_ipc_capable: bool | None = None


def user_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The lane variables set by the user (not by ``apply`` in this process)."""
    return {k: environ[k] for k in LANE_VARS if k in environ and _APPLIED.get(k) != environ[k]}


def effective(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The lane variables in force (set by anyone)."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in LANE_VARS if k in environ}


def plan_lane(
    mem_kinds: Iterable[str],
    vmm: bool,
    environ: Mapping[str, str] | None = None,
    mode: str = "auto",
    reach: Reach | None = None,
) -> LanePlan:
    """What to set for memory of ``mem_kinds`` (``VRAM`` / ``DRAM``); ``vmm``: some of it
    is not legacy-IPC capable (kvcached), so blocks read from it unpacked (no staging room,
    packing off) need UCX's pipelined protocol. ``reach``: the side channels' reach
    (``side_channel_reach``; None: not known, UCX's devices left alone unsaid)."""
    if mode not in MODES:
        raise ValueError(f"ucx_lane must be one of {MODES}, got {mode!r}")
    environ = os.environ if environ is None else environ
    kept = user_settings(environ)
    wanted: dict[str, tuple[str, str]] = {}
    listens = None
    if reach is not None and NET_DEVICES not in kept:
        if mode == "auto" and reach.loopback:
            wanted[NET_DEVICES] = (loopback_device(), f"{reach.why}: UCX on loopback only")
        else:
            off = "ucx_lane off; " if mode == "off" else ""
            listens = f"UCX listens on every network device ({off}{reach.why})"
    if mode == "auto" and "VRAM" in set(mem_kinds):
        wanted[GET_ZCOPY] = ("y", "cuda_ipc GET zero-copy, off by UCX's default without NVLink")
        if vmm:
            wanted[RMA_PPLN] = ("y", "VMM KV memory that cuda_ipc cannot export")
    chosen = {k: v for k, (v, _) in wanted.items() if k not in kept}
    reasons = {k: why for k, (_, why) in wanted.items() if k not in kept}
    return LanePlan(chosen, kept, reasons, listens)


def apply(plan: LanePlan, environ: MutableMapping[str, str] | None = None) -> None:
    """Set the plan's variables (before the NIXL agent, hence UCX, starts), and unset
    those this process set for an earlier plan that this one does not choose (a second
    agent of the process, e.g. a test's decode after its prefill, gets its own plan)."""
    environ = os.environ if environ is None else environ
    for key, value in list(_APPLIED.items()):
        if key not in plan.chosen and environ.get(key) == value:
            del environ[key]
            del _APPLIED[key]
    for key, value in plan.chosen.items():
        environ[key] = value
        _APPLIED[key] = value


def side_channel_reach(serves: str | None, connects: Iterable[str] | None) -> Reach:
    """The reach of an engine's side channels: ``serves``, the host prefill's side channel
    listens on (None: no prefill role); ``connects``, the hosts decode may connect to
    (``allowed_prefills``; None: any host; empty: no decode role)."""
    if connects is None:
        return Reach(False, "allowed_prefills unset: decode may reach a prefill on any host")
    connects = tuple(connects)
    if serves is not None and not is_loopback(serves):
        return Reach(False, f"side channel on {serves}")
    beyond = [h for h in connects if not is_loopback(h)]
    if beyond:
        return Reach(False, f"allowed_prefills names {beyond[0]}")
    if serves is None and not connects:
        return Reach(False, "no side channel")
    said = [f"side channel on {serves}"] if serves is not None else []
    said += ["every allowed prefill on loopback"] if connects else []
    return Reach(True, " and ".join(said))


def loopback_device() -> str:
    """The loopback interface's name (the one whose flags say IFF_LOOPBACK; ``lo``)."""
    try:
        for dev in sorted(Path("/sys/class/net").iterdir()):
            if int((dev / "flags").read_text().strip(), 16) & _IFF_LOOPBACK:
                return dev.name
    except (OSError, ValueError):
        pass
    return "lo"


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
