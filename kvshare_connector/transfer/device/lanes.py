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
the choice: decode READs a small probe after each handshake (``transfer.device.probe``), and
``verdict`` names the lane that reached and says how to fix a slow one.

UCX's reach follows the side channel's (``side_channel_reach``): creating an agent opens
a TCP listener on every network interface (seen: 127.0.0.1 and the host's 192.0.2.2 for
a prefill whose side channel listens on 127.0.0.1 only). Where every side channel the
engine serves or may connect to is on loopback, ``UCX_NET_DEVICES`` names the loopback
interface; otherwise, or with ``ucx_lane: off``, the plan says UCX uses every device, and
why.

Between hosts without RDMA a READ is tcp, where UCX emulates it with messages: prefill
answers a READ of any size with a train of messages of ``UCX_TCP_TX_SEG_SIZE`` (8 KiB by
default), each copied into a send buffer and sent, decode receives at most
``UCX_TCP_RX_SEG_SIZE`` (64 KiB) per call. Measured between two network namespaces on 2
cores (results/cpu/2026-12-07b): a packed READ of a 107 MB request at 0.3-0.4x the
throughput of plain TCP between the same addresses with UCX's defaults. Where the side
channels reach beyond loopback the plan sets ``REMOTE_TCP`` (larger segments; UCX's
worker lock a mutex, since the engine thread asking a READ's state and NIXL's progress
thread receiving its bytes otherwise spin against each other for the CPU). A segment
larger than the peer receives crashes UCX (a decode at 64 KiB read a prefill sending
1 MiB: SIGSEGV), so decode refuses a prefill whose segments exceed its own
(``segment_problem``) before any READ.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvshare_connector.transfer.device import lane_watch
from kvshare_connector.transfer.device.lane_watch import Seen
from kvshare_connector.transfer.wire.kv_params import is_loopback

GET_ZCOPY = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
RMA_PPLN = "UCX_RMA_PPLN_ENABLE"
NET_DEVICES = "UCX_NET_DEVICES"
TLS = "UCX_TLS"
TX_SEG = "UCX_TCP_TX_SEG_SIZE"
RX_SEG = "UCX_TCP_RX_SEG_SIZE"
MT_MUTEX = "UCX_USE_MT_MUTEX"
UCX_DEFAULT_TX_SEG = 8 << 10
UCX_DEFAULT_RX_SEG = 64 << 10
SMALL_SEG = 64 << 10  # a prefill sending tcp READs in smaller segments is the slow lane
# what ``auto`` sets where the side channels reach beyond loopback (a READ may be tcp)
REMOTE_TCP = {
    TX_SEG: ("256k", "a tcp READ in 256 KiB messages, not UCX's 8 KiB"),
    RX_SEG: ("256k", "each received whole: a larger one than this crashes UCX"),
    MT_MUTEX: ("y", "the engine thread and NIXL's progress thread wait for UCX, not spin"),
}
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
    """Every ``UCX_*`` variable set by the user (not by ``apply`` in this process)."""
    return {
        k: v for k, v in sorted(environ.items())
        if k.startswith("UCX_") and _APPLIED.get(k) != v
    }  # fmt: skip


def effective(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every ``UCX_*`` variable in force in this process (set by anyone)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in sorted(environ.items()) if k.startswith("UCX_")}


def describe_settings(settings: Mapping[str, str]) -> str:
    """``K=V, ...`` or "UCX defaults"."""
    return ", ".join(f"{k}={v}" for k, v in sorted(settings.items())) or "UCX defaults"


def memunits(text: str | None, default: int) -> int:
    """Bytes of a UCX memory-units value (``64k``, ``1m``, ``65536``, ``256kb``); ``default``
    where unset or not a size UCX would take ("auto", "inf")."""
    if not text:
        return default
    value = text.strip().lower().removesuffix("b")
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(value[-1:], 1)
    digits = value[:-1] if scale > 1 else value
    return int(digits) * scale if digits.isdigit() else default


def segment_problem(prefill: Mapping[str, str], decode: Mapping[str, str]) -> str | None:
    """Why decode (its ``UCX_*`` settings) cannot READ over tcp from prefill (its own), or
    None: prefill's send segments must fit decode's receive segments (UCX does not check;
    a larger one crashes decode's process)."""
    sends = memunits(prefill.get(TX_SEG), UCX_DEFAULT_TX_SEG)
    takes = memunits(decode.get(RX_SEG), UCX_DEFAULT_RX_SEG)
    if sends <= takes:
        return None
    return (
        f"prefill sends tcp segments of {prefill.get(TX_SEG)} ({TX_SEG}), this decode "
        f"receives at most {decode.get(RX_SEG) or '64k, UCX default'} ({RX_SEG}): UCX "
        f"would crash on the first READ; give both engines ucx_lane auto, or {RX_SEG} here "
        f"at least {TX_SEG} there"
    )


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
    if mode == "auto" and reach is not None and not reach.loopback:
        wanted.update(REMOTE_TCP)
        # UCX refuses a TX segment larger than the RX one: fit ours around the user's
        tx, rx = (memunits(REMOTE_TCP[k][0], 0) for k in (TX_SEG, RX_SEG))
        if TX_SEG in kept and memunits(kept[TX_SEG], 0) > rx:
            wanted[RX_SEG] = (kept[TX_SEG], f"as large as {TX_SEG} (yours)")
        if RX_SEG in kept and memunits(kept[RX_SEG], rx) < tx:
            wanted[TX_SEG] = (kept[RX_SEG], f"no larger than {RX_SEG} (yours)")
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
    """A probe's reading: the lane's name (``tcp``, ``rdma``, ``cuda_ipc``, ``shm/cma``),
    where its bytes went, whether it is a slow one, and the fix."""

    lane: str
    slow: bool
    fix: str | None = None
    where: str = ""


def wire_settings(settings: Mapping[str, str]) -> dict[str, str]:
    """``settings`` as prefill sends them (bounded: 64 variables, 256 characters each)."""
    return {k[:64]: v[:256] for k, v in list(sorted(settings.items()))[:64]}


def verdict(
    local_kind: str,
    remote_kind: str,
    gbps: float,
    seen: Seen,
    same_host: bool,
    mine: Mapping[str, str] | None = None,
    theirs: Mapping[str, str] | None = None,
    rdma: Sequence[str] | None = None,
    speeds: Mapping[str, int] | None = None,
) -> Verdict:
    """Name the lane a probe READ of ``remote_kind`` memory into ``local_kind`` took, from
    what carried its bytes (``seen``); ``mine``/``theirs``: decode's and prefill's UCX
    settings; ``rdma``: this host's active RDMA ports; ``speeds``: its links' Mb/s
    (None: read from the host)."""
    mine = effective() if mine is None else mine
    theirs = theirs or {}
    gpu = "VRAM" in (local_kind, remote_kind)
    if seen.transport == "tcp":
        rdma = lane_watch.rdma_ports() if rdma is None else rdma
        speeds = lane_watch.link_speeds() if speeds is None else speeds
        fix = _tcp_fix(seen, same_host or seen.loopback, gpu, mine, theirs, rdma, speeds)
        return Verdict("tcp", fix is not None, fix, seen.where)
    if seen.transport == "rdma":
        if gpu and gbps < SLOW_GBPS:
            fix = (
                "GPU memory over RDMA without GPUDirect: load nvidia-peermem (or use dmabuf) "
                "so UCX reads GPU memory directly; UCX_PROTO_INFO=y prints its choice"
            )
            return Verdict("rdma", True, fix, seen.where)
        return Verdict("rdma", False, None, seen.where)
    if not (local_kind == remote_kind == "VRAM"):
        return Verdict("shm/cma", False, None, "inside this machine")
    if gbps >= SLOW_GBPS:
        return Verdict("cuda_ipc", False, None, "inside this machine")
    return _slow_cuda_ipc(mine)


def _slow_cuda_ipc(mine: Mapping[str, str]) -> Verdict:
    zcopy = mine.get(GET_ZCOPY, "auto")
    if not _enabled(zcopy):
        fix = (
            f"set {GET_ZCOPY}=y in both engines' environment (it is {zcopy!r} here; UCX "
            "turns cuda_ipc GET off without NVLink)"
        )
        return Verdict("cuda_ipc", True, fix, "inside this machine")
    # Enabled, and still slow for the whole probe: either UCX took another lane or the
    # device was busy with other processes' work all along; speed alone cannot tell.
    fix = (
        "check that UCX_TLS allows cuda_ipc and that both GPUs can reach each other (peer "
        "access), and whether other processes kept the GPU busy; UCX_PROTO_INFO=y prints "
        "UCX's choice"
    )
    return Verdict("cuda_ipc", True, fix, "inside this machine")


def _tcp_fix(
    seen: Seen,
    one_host: bool,
    gpu: bool,
    mine: Mapping[str, str],
    theirs: Mapping[str, str],
    rdma: Sequence[str],
    speeds: Mapping[str, int],
) -> str | None:
    """Why a tcp lane is the slow one and what to set, or None (tcp is the lane there is)."""
    tls, devices = mine.get(TLS), mine.get(NET_DEVICES)
    if one_host and gpu and not _enabled(mine.get(GET_ZCOPY, "auto")):
        return _slow_cuda_ipc(mine).fix
    if one_host:
        why = (
            f"{TLS}={tls} leaves them out: unset it or add sm,cma{',cuda_ipc' if gpu else ''}"
            if tls
            else "the engines do not share an IPC and PID namespace (containers: "
            "--ipc=host --pid=host)"
        )
        return f"prefill is on this host, yet the READ went over tcp ({seen.where}): {why}"
    if rdma:
        return (
            f"this host has RDMA ({', '.join(rdma)}), the READ went over tcp: let UCX use it, "
            f"{TLS} (now {tls or 'unset'}) allowing rc and {NET_DEVICES} (now "
            f"{devices or 'unset'}) naming {rdma[0]}, on both engines"
        )
    if gpu:
        return (
            "GPU memory over tcp is copied through host memory: no RDMA lane between the "
            f"hosts; check {TLS} and {NET_DEVICES} (and the RDMA fabric) on both engines"
        )
    faster = {n: v for n, v in speeds.items() if v > speeds.get(seen.interface or "", 1 << 62)}
    if faster:
        best = max(faster, key=lambda n: faster[n])
        return (
            f"the READ took {seen.interface} ({speeds[seen.interface or '']} Mb/s), {best} "
            f"has {faster[best]} Mb/s: {NET_DEVICES}={best} on both engines"
        )
    sends = memunits(theirs.get(TX_SEG), UCX_DEFAULT_TX_SEG)
    if sends < SMALL_SEG:
        return (
            f"prefill sends a READ's bytes in {sends >> 10} KiB messages ({TX_SEG}, UCX's "
            f"8 KiB unless set): give prefill ucx_lane auto, or {TX_SEG}="
            f"{REMOTE_TCP[TX_SEG][0]} and {RX_SEG}={REMOTE_TCP[RX_SEG][0]} on both engines"
        )
    return None


def _enabled(value: str) -> bool:
    return value.strip().lower() in ("y", "yes", "1", "on", "true")
