"""What the transfer layer knows of its engine and deployment: set once, passed whole.

``KVSource`` and ``KVSink`` (and the peers and side channel under them) read their engine
id, addresses, bounds and security settings from one ``EngineSettings``; the collaborators
they drive (transport, packer, digester, probe) are passed beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshare_connector.layout.matching import EngineIdentity


@dataclass(frozen=True)
class EngineSettings:
    engine_id: str
    host: str = "127.0.0.1"  # prefill: the side channel's host, as kv_transfer_params name it
    port: int = 0  # prefill: its port (0: any free one)
    lease_s: float = 30.0  # prefill: how long a finished request's blocks wait for decode
    handshake_timeout_s: float = 10.0  # decode: bound on each side-channel ask
    transfer_timeout_s: float = 60.0  # decode: bound on each READ
    secret: bytes | None = None  # HMAC key of every side-channel message
    insecure: bool = False  # prefill: serve beyond loopback without a secret anyway
    identity: EngineIdentity | None = None  # model, dtypes, block size, vLLM version
    # decode: the prefills it may connect to ("host" or "host:port"; None: any)
    allowed_prefills: frozenset[str] | None = None
    # decode: verify_kv asked for explicitly: a pairing it cannot check (TP head slices)
    # fails instead of reading unverified
    verify_required: bool = False

    def allows(self, host: str, port: int) -> bool:
        """Decode may connect to a prefill side channel at ``host:port``."""
        allowed = self.allowed_prefills
        if allowed is None:
            return True
        return bool({host, f"{host}:{port}", f"[{host}]:{port}"} & allowed)
