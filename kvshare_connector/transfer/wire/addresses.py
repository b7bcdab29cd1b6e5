"""The address a prefill's side channel advertises: what its ``kv_transfer_params`` name as
``remote_host``, what decode dials, and what every signed request is addressed to.

A side channel listens on ``VLLM_NIXL_SIDE_CHANNEL_HOST``. Where that is one host's address
or name, it is also the advertised one. Where it is every interface (``0.0.0.0``, ``::``),
it names no host a decode could dial, nor one a request can be addressed to: prefill then
advertises its routable address instead, in this order:

1. ``advertise_host`` (the connector option, or ``KVSHARE_ADVERTISE_HOST``), as written;
2. the address of the default route's interface (Linux's routing table names it; the
   address is the one the kernel picks as source toward the route's gateway: a UDP socket
   is connected, nothing is sent);
3. without a default route, the host's one address beyond loopback, if it has exactly one.

Otherwise the engine stops at start, naming the addresses it saw and ``advertise_host``.
Every process of an engine (scheduler, each TP worker) works this out alike.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from kvshare_connector.transfer.wire.kv_params import host_problem

ADVERTISE_ENV = "KVSHARE_ADVERTISE_HOST"
_RTF_UP = 0x1  # a route's flag in /proc/net/route and ipv6_route: in use


class AdvertiseError(ValueError):
    """No single address to advertise: the operator must name one."""


@dataclass(frozen=True)
class Advertised:
    """The host a side channel advertises, and why that one (for the start line)."""

    host: str
    why: str


def every_interface(host: str) -> bool:
    """``host`` is the unspecified address (listen on every interface), or empty."""
    if host == "":
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def default_route(family: int) -> tuple[str, str | None] | None:
    """The interface of the default route (of the lowest metric) and its gateway (None:
    the route has none), from Linux's routing tables; None without a default route."""
    best: tuple[int, str, str | None] | None = None
    try:
        if family == socket.AF_INET:
            for line in Path("/proc/net/route").read_text().splitlines()[1:]:
                f = line.split()
                if len(f) >= 8 and f[1] == f[7] == "00000000" and int(f[3], 16) & _RTF_UP:
                    gateway = socket.inet_ntoa(struct.pack("<I", int(f[2], 16)))
                    route = (int(f[6]), f[0], None if gateway == "0.0.0.0" else gateway)
                    best = route if best is None or route[0] < best[0] else best
        else:
            for line in Path("/proc/net/ipv6_route").read_text().splitlines():
                f = line.split()
                zero = "0" * 32
                up = len(f) == 10 and int(f[8], 16) & _RTF_UP
                if up and f[0] == zero and f[1] == "00" and f[9] != "lo":
                    hop = None if f[4] == zero else str(ipaddress.IPv6Address(bytes.fromhex(f[4])))
                    route = (int(f[5], 16), f[9], hop)
                    best = route if best is None or route[0] < best[0] else best
    except (OSError, ValueError):
        return None
    return None if best is None else (best[1], best[2])


def _source_toward(family: int, gateway: str) -> str | None:
    """The source address the kernel picks toward ``gateway`` (a UDP socket is connected,
    nothing is sent)."""
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((gateway, 9))
        return str(sock.getsockname()[0]).split("%", 1)[0]
    return None


def interface_addresses(family: int) -> dict[str, list[str]]:
    """Each interface's addresses of ``family`` beyond loopback and link-local ones (a
    link-local address needs a zone a side channel cannot carry)."""
    import psutil  # vLLM's dependency; only needed to name interfaces

    out: dict[str, list[str]] = {}
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family != family:
                continue
            ip = ipaddress.ip_address(a.address.split("%", 1)[0])
            if not (ip.is_loopback or ip.is_link_local):
                out.setdefault(name, []).append(str(ip))
    return out


def routable_address(family: int = socket.AF_INET) -> Advertised:
    """This host's address that other hosts reach it at (see the module's order)."""
    kind = "IPv6" if family == socket.AF_INET6 else "IPv4"
    interfaces = interface_addresses(family)
    route = default_route(family)
    if route is not None:
        name, gateway = route
        address = _source_toward(family, gateway) if gateway else None
        if address is None and interfaces.get(name):
            address = interfaces[name][0]
        if address is not None:
            return Advertised(address, f"the default route's interface ({name})")
    found = [(n, a) for n, addresses in sorted(interfaces.items()) for a in addresses]
    if len(found) == 1:
        name, address = found[0]
        return Advertised(address, f"the host's only {kind} address ({name}; no default route)")
    seen = ", ".join(f"{a} ({n})" for n, a in found) or "none beyond loopback"
    raise AdvertiseError(
        f"the KV side channel listens on every interface, and this host has no default "
        f"{kind} route and {len(found)} {kind} addresses to choose from ({seen}): set "
        f"advertise_host (or {ADVERTISE_ENV}) to the address decode engines dial"
    )


def advertised_host(bind_host: str, advertise_host: str | None = None) -> Advertised:
    """What a side channel listening on ``bind_host`` advertises: ``advertise_host`` where
    given, else ``bind_host`` itself, or for every interface the routable address."""
    if advertise_host:
        why = host_problem(advertise_host)
        if why is not None:
            raise AdvertiseError(f"advertise_host {advertise_host[:80]!r} is {why}")
        return Advertised(advertise_host, "advertise_host")
    if not every_interface(bind_host):
        return Advertised(bind_host, "the host it listens on")
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    return routable_address(family)


def host_port(host: str, port: int) -> str:
    """``host:port`` as an ``allowed_prefills`` entry writes it (IPv6 in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
