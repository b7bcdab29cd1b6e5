"""What the transfer layer knows of its engine and deployment: set once, passed whole.

``KVSource`` and ``KVSink`` (and the peers and side channel under them) read their engine
id, addresses, bounds and security settings from one ``EngineSettings``; the collaborators
they drive (transport, packer, digester, probe) are passed beside it.

Decode's ``allowed_prefills`` entries (``AllowedPrefill``), each one of:

* ``host:port``: the side channels of the prefill whose ``kv_transfer_params`` name that
  base port: ``port`` up to ``port + 63``, since TP rank r (and each data-parallel rank of
  one engine) serves on the base port + r, and decode learns prefill's TP size only from
  the params, which may state up to 64 ranks.
* ``host:first-last``: exactly the ports ``first`` to ``last``.
* ``host``: every port of that host (warned about: any process that listens there can
  pose as a prefill).

IPv6 addresses with a port are written in brackets (``[::1]:5600``). Hosts are compared
as written, never resolved (a lookup at the check and another at the connection could
differ): ``localhost`` admits ``localhost``, not ``127.0.0.1``; names compare without
case or a final dot, addresses in their canonical form (``0:0:0:0:0:0:0:1`` is ``::1``).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

from kvshare_connector.layout.matching import EngineIdentity
from kvshare_connector.transfer.wire.kv_params import host_problem
from kvshare_connector.transfer.wire.protocol import MAX_TP

_ENTRY = re.compile(
    r"\[(?P<v6>[^\]]*)\](?::(?P<v6ports>.*))?|(?P<host>[^:\[\]]*)(?::(?P<ports>.*))?"
)
_PRINTABLE = re.compile(r"[\x21-\x7e]+")
_PORTS = re.compile(r"(?P<first>[0-9]{1,5})(?:-(?P<last>[0-9]{1,5}))?")


class AllowListError(ValueError):
    """An ``allowed_prefills`` entry that admits nothing or is not an entry."""


def canonical_host(host: str) -> str:
    """The form hosts are compared in: an address's canonical text, a name in lower case
    without a final dot."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.lower().rstrip(".")


@dataclass(frozen=True)
class AllowedPrefill:
    """One ``allowed_prefills`` entry: a host and the ports it admits (None: every port)."""

    host: str  # canonical_host
    ports: tuple[int, int] | None

    @classmethod
    def parse(cls, entry: str) -> AllowedPrefill:
        """The entry, or ``AllowListError`` naming what is wrong with it."""
        if not isinstance(entry, str):
            raise AllowListError(f"{entry!r}: not a string")
        if not _PRINTABLE.fullmatch(entry):
            raise AllowListError(f"{entry[:80]!r}: empty, or holds spaces or control characters")
        bare_v6 = entry.count(":") > 1 and not entry.startswith("[")  # ``::1``, no port
        match = _ENTRY.fullmatch(f"[{entry}]" if bare_v6 else entry)
        if match is None:
            raise AllowListError(f"{entry!r}: not host, host:port or host:first-last")
        host = match["v6"] if match["v6"] is not None else match["host"]
        ports = match["v6ports"] if match["v6"] is not None else match["ports"]
        if match["v6"] is not None and ":" not in host:
            raise AllowListError(f"{entry!r}: brackets hold an IPv6 address only")
        why = host_problem(host)
        if why is not None:
            raise AllowListError(f"{entry!r}: host {host[:80]!r}: {why}")
        return cls(canonical_host(host), None if ports is None else _port_span(entry, ports))

    @property
    def every_port(self) -> bool:
        return self.ports is None

    def admits(self, host: str, port: int) -> bool:
        if canonical_host(host) != self.host:
            return False
        return self.ports is None or self.ports[0] <= port <= self.ports[1]


def _port_span(entry: str, text: str) -> tuple[int, int]:
    """``port`` (with its 63 rank ports after it) or ``first-last``, within [1, 65535]."""
    match = _PORTS.fullmatch(text)
    if match is None:
        raise AllowListError(f"{entry!r}: port {text[:20]!r} is not a number or first-last")
    first = int(match["first"])
    if match["last"] is None:
        if not 1 <= first <= 65535:
            raise AllowListError(f"{entry!r}: port {first} not in [1, 65535]")
        return first, min(first + MAX_TP - 1, 65535)
    last = int(match["last"])
    if not 1 <= first <= last <= 65535:
        raise AllowListError(f"{entry!r}: ports {first}-{last} not a span within [1, 65535]")
    return first, last


@dataclass(frozen=True)
class EngineSettings:
    engine_id: str
    host: str = "127.0.0.1"  # prefill: the side channel's host, as kv_transfer_params name it
    bind_host: str | None = None  # prefill: where it listens, if not ``host`` (0.0.0.0)
    port: int = 0  # prefill: its port (0: any free one)
    lease_s: float = 30.0  # prefill: how long a finished request's blocks wait for decode
    handshake_timeout_s: float = 10.0  # decode: bound on each side-channel ask
    transfer_timeout_s: float = 60.0  # decode: bound on each READ
    secret: bytes | None = None  # HMAC key of every side-channel message
    insecure: bool = False  # prefill: serve beyond loopback without a secret anyway
    identity: EngineIdentity | None = None  # model, dtypes, block size, vLLM version
    # decode: the prefills it may connect to (AllowedPrefill entries; None: any)
    allowed_prefills: frozenset[str] | None = None
    # decode: verify_kv asked for explicitly: a pairing it cannot check (TP head slices)
    # fails instead of reading unverified
    verify_required: bool = False
    _allowed: tuple[AllowedPrefill, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Parsed once; a bad entry fails here (options parsing names it first).
        entries = sorted(self.allowed_prefills or ())
        object.__setattr__(self, "_allowed", tuple(AllowedPrefill.parse(e) for e in entries))

    def allows(self, host: str, port: int) -> bool:
        """Decode may connect to a prefill side channel at ``host:port``."""
        if self.allowed_prefills is None:
            return True
        return any(entry.admits(host, port) for entry in self._allowed)

    def allowed_hosts(self) -> tuple[str, ...] | None:
        """The hosts decode may connect to (canonical), or None: any host."""
        if self.allowed_prefills is None:
            return None
        return tuple(sorted({entry.host for entry in self._allowed}))
