"""Thin wrapper over NIXL's Python agent: register regions, read, notify.

Regions are registered as raw ``(addr, len, device)`` rows: NIXL's tensor helpers reject
non-contiguous tensors, and the regions we register are byte spans of owners' storage,
not tensors. Descriptor lists are built per request from numpy arrays (no prepared
per-block lists sized by the whole cache, which is what makes kvcached's whole-GPU
reservation expensive elsewhere).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvshare_connector.common.log import get_logger
from kvshare_connector.layout.topology import Region

logger = get_logger(__name__)


class TransportError(RuntimeError):
    """NIXL refused or failed an operation."""


class PeerNotLoaded(TransportError):
    """NIXL does not know the peer's agent (removed, or never loaded): handshake again."""


def _nixl_api() -> Any:
    try:
        from nixl import _api
    except ImportError:
        try:
            from nixl_cu13 import _api
        except ImportError as exc:
            raise TransportError("NIXL is not installed: pip install nixl-cu13==1.5.1") from exc
    return _api


_AGENT_START = threading.Lock()


def _start_agent(api: Any, name: str, config: Any, poll_ms: float) -> tuple[Any, bool]:
    """``api.nixl_agent(name, config)`` with the progress thread's poll delay set, and
    whether it was set.

    NIXL's Python API hard-codes that delay to 0, and UCX's progress thread then calls
    ``poll()`` with a 0 ms timeout: it spins, one core per agent whether anything moves or
    not (9 engines on a 16-core host spin 9 cores). With a delay the thread sleeps on UCX's
    event descriptors and wakes when something arrives, or after the delay rounded up to
    whole ms. NIXL's binding exposes the field the API leaves at 0, so the API is handed its
    bindings module with ``nixlAgent`` wrapped to set it; every other name passes through,
    and the lock keeps two agents of one process from starting across the swap."""
    real = getattr(api, "nixlBind", None)
    if poll_ms <= 0 or not config.enable_pthread:
        return api.nixl_agent(name, config), False
    if real is None or not hasattr(real.nixlAgentConfig(), "pthrDelay"):
        logger.warning("NIXL %s: this NIXL's Python API has no bindings module with the "
                       "progress thread's poll delay; its progress thread spins a core",
                       name)  # fmt: skip
        return api.nixl_agent(name, config), False
    delay_us = max(1, round(poll_ms * 1000))

    class _Bindings:
        def __getattr__(self, attr: str) -> Any:
            return getattr(real, attr)

        @staticmethod
        def nixlAgent(agent_name: str, agent_config: Any) -> Any:  # NIXL binding's name
            agent_config.pthrDelay = delay_us
            return real.nixlAgent(agent_name, agent_config)

    with _AGENT_START:
        api.nixlBind = _Bindings()
        try:
            return api.nixl_agent(name, config), True
        finally:
            api.nixlBind = real


def _name(peer: str | bytes) -> str:
    return peer.decode(errors="replace") if isinstance(peer, bytes) else peer


class NixlTransport:
    """One NIXL agent with our regions registered on it.

    ``progress_thread``: NIXL's background thread that progresses UCX while the engine is
    not calling NIXL. ``progress_poll_ms``: how long it sleeps on UCX's events before it
    looks anyway (``_start_agent``; 0: NIXL's busy poll, one core per agent even when idle).
    The engine's come from ``ConnectorOptions`` (``nixl_progress_thread``,
    ``nixl_progress_poll_ms``), the one parser of options. Without the thread, UCX moves only while
    this process calls NIXL, which an engine does in its steps. The data of a READ over
    cuda_ipc, RDMA or shared memory needs nothing of prefill, but the first READ between
    two agents wires UCX's connection up, and UCX's TCP transport emulates a GET with
    messages: both need prefill to progress, which an idle prefill engine (no step running)
    does not, and the READ waits (seen: tests/test_kv_probe.py, prefill and decode in one
    process, stalled with it off).
    """

    def __init__(
        self,
        name: str,
        backends: Sequence[str] = ("UCX",),
        num_threads: int = 0,
        progress_thread: bool = True,
        progress_poll_ms: float = 1.0,
    ):
        api = _nixl_api()
        self.progress_thread = progress_thread
        self.progress_poll_ms = progress_poll_ms
        config = api.nixl_agent_config(
            enable_prog_thread=self.progress_thread,
            backends=list(backends),
            num_threads=num_threads,
        )
        self._api = api
        self.name = name
        self.agent, sleeps = _start_agent(api, name, config, self.progress_poll_ms)
        self.progress_mode = (  # for the engine's start line
            "off" if not self.progress_thread
            else f"sleeps on UCX's events, {math.ceil(self.progress_poll_ms):g} ms at most"
            if sleeps else "spins a core (poll 0)"
        )  # fmt: skip
        if not self.agent.backends:
            raise TransportError(f"NIXL agent {name}: none of the backends {list(backends)} loaded")
        self._registered: list[Any] = []
        self._regions: set[Region] = set()
        self.registered_bytes = 0
        self._arrived: dict[str, list[bytes]] = {}  # notifications ``progress`` picked up

    def register(self, regions: Sequence[Region]) -> None:
        """Register regions once each (a kv_both engine's source and sink share an agent)."""
        fresh = [r for r in regions if r not in self._regions]
        self._regions.update(fresh)
        for kind in ("DRAM", "VRAM"):
            rows = [
                (r.addr, r.nbytes, max(r.device_id, 0), "") for r in fresh if r.mem_kind == kind
            ]
            if not rows:
                continue
            try:
                descs = self.agent.register_memory(rows, mem_type=kind)
            except Exception as exc:
                raise TransportError(
                    f"NIXL could not register {len(rows)} {kind} region(s): {exc}"
                ) from exc
            self._registered.append(descs)
            self.registered_bytes += sum(r[1] for r in rows)

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        try:
            return self.agent.add_remote_agent(metadata)
        except Exception as exc:
            raise TransportError(f"NIXL rejected the peer's agent metadata: {exc}") from exc

    def remove_peer(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:
            logger.warning("NIXL: removing peer %s failed: %s", name, exc)

    def read(
        self,
        peer: str,
        local_rows: np.ndarray,
        local_kind: str,
        remote_rows: np.ndarray,
        remote_kind: str,
        notification: bytes,
    ) -> Any:
        """Post a READ of ``remote_rows`` into ``local_rows``; the peer gets ``notification``."""
        handle = self.prepare_read(
            peer, local_rows, local_kind, remote_rows, remote_kind, notification
        )
        self.post(peer, handle)
        return handle

    def prepare_read(
        self,
        peer: str,
        local_rows: np.ndarray,
        local_kind: str,
        remote_rows: np.ndarray,
        remote_kind: str,
        notification: bytes,
    ) -> Any:
        """NIXL's request for a READ, not yet posted: its descriptor lists, and the backend's
        preparation of them (apart from ``post``, so the read log times the two apart)."""
        try:
            local = self.agent.get_xfer_descs(local_rows, local_kind)
            remote = self.agent.get_xfer_descs(remote_rows, remote_kind)
            return self.agent.initialize_xfer("READ", local, remote, peer, notification)
        except Exception as exc:
            kind = PeerNotLoaded if "NOT_FOUND" in str(exc) else TransportError
            raise kind(f"NIXL READ from {_name(peer)} could not start: {exc}") from exc

    def post(self, peer: str, handle: Any) -> None:
        """Post a prepared READ; on failure its handle is released."""
        try:
            # Over UCX's shared-memory transports most of the copy happens inside this
            # call: a peer that dies now makes it raise, mid-transfer.
            state = self.agent.transfer(handle)
        except Exception as exc:
            self.release(handle)
            raise TransportError(f"NIXL READ from {_name(peer)} failed: {exc}") from exc
        if state == "ERR":
            self.release(handle)
            raise TransportError(f"NIXL READ from {_name(peer)} failed at post")

    def state(self, handle: Any) -> str:
        """``DONE``, ``PROC`` or ``ERR``."""
        try:
            return self.agent.check_xfer_state(handle)
        except Exception as exc:
            logger.warning("NIXL: transfer state unavailable: %s", exc)
            return "ERR"

    def release(self, handle: Any) -> bool:
        """Release a transfer; False if NIXL refused (it may still be moving bytes)."""
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as exc:  # a handle of a dead peer may refuse release
            logger.warning("NIXL: releasing a transfer failed: %s", exc)
            return False
        return True

    def notify(self, peer: str, message: bytes) -> None:
        try:
            self.agent.send_notif(peer, message)
        except Exception as exc:
            logger.warning("NIXL: notifying %s failed: %s", peer, exc)

    def _collect(self) -> None:
        for peer, messages in self.agent.get_new_notifs().items():
            self._arrived.setdefault(peer, []).extend(messages)

    def notifications(self) -> dict[str, list[bytes]]:
        self._collect()
        arrived, self._arrived = self._arrived, {}
        return arrived

    def progress(self) -> None:
        """Without the progress thread, move what UCX has pending (a notification posted
        to a peer not yet wired up leaves only while this process progresses); what it
        receives meanwhile is kept for ``notifications``. With the thread: nothing to do."""
        if not self.progress_thread:
            self._collect()

    def close(self) -> None:
        for descs in self._registered:
            try:
                self.agent.deregister_memory(descs)
            except Exception as exc:
                logger.warning("NIXL: deregistering memory failed: %s", exc)
        self._registered.clear()
        self._regions.clear()
