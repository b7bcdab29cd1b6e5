"""What carried a probe READ's bytes, seen from decode's own process and host.

UCX names its choice only in its log (``UCX_PROTO_INFO=y``), and an engine cannot read
that back. What it can read: the bytes each of its own TCP sockets received (the kernel's
``tcpi_bytes_received``, per socket, from ``/proc/self/fd``) and the bytes each RDMA port of
the host received (``/sys/class/infiniband/*/ports/*/counters/port_rcv_data``). A READ whose
bytes arrived on one of this process's TCP sockets went over tcp, on the interface that
socket's address belongs to; one whose bytes arrived on an RDMA port went over RDMA; one
that touched neither stayed inside the machine (cuda_ipc, shared memory, CMA). Other
traffic only adds bytes, so a lane is named by a socket or port that received at least
the READ's bytes while it ran; the socket whose peer is prefill's address first, else the
one that received most.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

_TCP_INFO_LEN = 232
_BYTES_RECEIVED = 128  # offset of tcpi_bytes_received (u64, Linux >= 4.1) in struct tcp_info
_SIOCGIFADDR = 0x8915
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8
SYS_NET = Path("/sys/class/net")
SYS_RDMA = Path("/sys/class/infiniband")


@dataclass(frozen=True)
class Seen:
    """The transport that carried the bytes (``tcp``, ``rdma``; None: neither, so they
    stayed inside the machine), and where: the interface and the socket's two ends, or the
    RDMA port."""

    transport: str | None
    where: str = ""
    interface: str | None = None  # tcp: the local interface that received the bytes
    loopback: bool = False  # tcp over the loopback interface: both ends on this host


def tcp_bytes_received() -> dict[tuple[str, str], int]:
    """``(local, peer) -> bytes received`` for every TCP socket this process holds."""
    found: dict[tuple[str, str], int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            dup = os.dup(int(name))
        except (OSError, ValueError):
            continue
        try:
            with socket.socket(fileno=dup) as sock:
                if sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                if sock.type != socket.SOCK_STREAM:
                    continue
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
                if len(info) < _BYTES_RECEIVED + 8:
                    continue
                (received,) = struct.unpack_from("=Q", info, _BYTES_RECEIVED)
                local, peer = _ends(sock)
                found[(local, peer)] = received
        except OSError:  # closed meanwhile, a listener, not a socket any more
            continue
    return found


def _ends(sock: socket.socket) -> tuple[str, str]:
    local, peer = sock.getsockname(), sock.getpeername()
    return f"{_host(local[0])}:{local[1]}", f"{_host(peer[0])}:{peer[1]}"


def _host(address: str) -> str:
    return address.removeprefix("::ffff:")  # an IPv4 peer on a dual-stack socket


def rdma_bytes_received(root: Path = SYS_RDMA) -> dict[str, int]:
    """``device:port -> bytes received`` for every RDMA port of the host (its counter counts
    4-byte words)."""
    found: dict[str, int] = {}
    try:
        devices = sorted(root.iterdir())
    except OSError:
        return found
    for device in devices:
        try:
            ports = sorted((device / "ports").iterdir())
        except OSError:
            continue
        for port in ports:
            try:
                words = int((port / "counters" / "port_rcv_data").read_text().strip())
            except (OSError, ValueError):
                continue
            found[f"{device.name}:{port.name}"] = words * 4
    return found


def rdma_ports(root: Path = SYS_RDMA) -> list[str]:
    """The host's active RDMA ports (``mlx5_0:1``), as ``UCX_NET_DEVICES`` names them."""
    active = []
    for key in rdma_bytes_received(root) or _ports_without_counters(root):
        device, port = key.split(":")
        try:
            state = (root / device / "ports" / port / "state").read_text()
        except OSError:
            continue
        if "ACTIVE" in state:
            active.append(key)
    return active


def _ports_without_counters(root: Path) -> list[str]:
    try:
        return [f"{d.name}:{p.name}" for d in root.iterdir() for p in (d / "ports").iterdir()]
    except OSError:
        return []


def interface_of(address: str, root: Path = SYS_NET) -> str | None:
    """The network interface that holds ``address`` (IPv4 through SIOCGIFADDR, IPv6
    through /proc/net/if_inet6)."""
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    if wanted.version == 6:
        return _interface_of_v6(wanted)
    try:
        names = sorted(p.name for p in root.iterdir())
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                name_arg = struct.pack("256s", name[:15].encode())
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, name_arg)
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == str(wanted):
                return name
    return None


def _interface_of_v6(wanted: ipaddress.IPv6Address) -> str | None:
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and ipaddress.IPv6Address(int(fields[0], 16)) == wanted:
            return fields[5]
    return None


def link_speeds(root: Path = SYS_NET) -> dict[str, int]:
    """Mb/s of every interface that is up, not loopback and says its speed."""
    speeds: dict[str, int] = {}
    try:
        devices = sorted(root.iterdir())
    except OSError:
        return speeds
    for dev in devices:
        try:
            flags = int((dev / "flags").read_text().strip(), 16)
            speed = int((dev / "speed").read_text().strip())
        except (OSError, ValueError):  # no carrier or no speed (virtual devices)
            continue
        if flags & _IFF_UP and not flags & _IFF_LOOPBACK and speed > 0:
            speeds[dev.name] = speed
    return speeds


class LaneWatch:
    """Counters before a READ (``start``), and what carried its bytes after (``seen``)."""

    def __init__(self, peer_host: str):
        self.peer_host = peer_host
        self._tcp: dict[tuple[str, str], int] = {}
        self._rdma: dict[str, int] = {}

    def start(self) -> None:
        self._tcp = tcp_bytes_received()
        self._rdma = rdma_bytes_received()

    def seen(self, nbytes: int) -> Seen:
        """What received at least ``nbytes`` since ``start``."""
        grown = {
            ends: received - self._tcp.get(ends, 0)
            for ends, received in tcp_bytes_received().items()
        }
        carriers = [ends for ends, n in grown.items() if n >= nbytes]
        if carriers:
            ours = [e for e in carriers if e[1].rpartition(":")[0].strip("[]") == self.peer_host]
            local, peer = max(ours or carriers, key=lambda e: grown[e])
            address = local.rpartition(":")[0].strip("[]")
            interface = interface_of(address)
            loopback = _is_loopback(address)
            where = f"{interface or 'an interface'}, {local} -> {peer}"
            return Seen("tcp", where, interface, loopback)
        rdma = {k: n - self._rdma.get(k, 0) for k, n in rdma_bytes_received().items()}
        ports = [k for k, n in rdma.items() if n >= nbytes]
        if ports:
            return Seen("rdma", max(ports, key=lambda k: rdma[k]))
        return Seen(None)


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False
