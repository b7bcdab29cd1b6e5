"""The decode half of the NIXL transfer tests: a ``KVSink`` over vLLM's real KV memory.

Shared by ``test_transfer.py`` (reads between layouts) and ``test_transfer_faults.py``
(what goes wrong); each module starts its own prefill peers. Every wait is bounded.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

from kvshare_connector.demo import kvcheck
from kvshare_connector.demo.parts import build, cpu_packer, read_and_check
from kvshare_connector.layout.matching import EngineIdentity

TOKENS = 300  # g4tiny: 5 blocks in each sliding group (window 128), 19 in the full group
E2B = "gemma4_e2b_shape"
# Decode side KV sizes; the peer's caches are larger, so num_blocks differ too (E2B needs
# 48 MiB for one request of vLLM's max_model_len 2048).
DECODE_KV_MIB = {"g4tiny": 16, "g4uniform": 16, E2B: 48}
HANDSHAKE_S = 10.0  # real peers (a loaded CI box answers slowly, never this slowly)
TRANSFER_S = 10.0
FAULT_HANDSHAKE_S = 1.0  # sinks that talk to broken side channels


def with_defaults(sources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Peer source specs with this suite's token count and KV sizes filled in."""
    for spec in sources:
        spec.setdefault("tokens", TOKENS)
        spec.setdefault("kv_mib", 64 if spec["model"] == E2B else 32)
    return sources


class Decoder:
    """One decode engine's KV memory (vLLM's real objects) and its ``KVSink``."""

    def __init__(
        self,
        model: str,
        layout: str,
        kv_mib: int,
        handshake_s: float,
        name: str,
        identity: EngineIdentity | None = None,
        packed_mib: int = 0,
        progress_thread: bool = False,
        probe_mib: int = 0,
    ):
        from kvshare_connector.transfer.decode.sink import KVSink
        from kvshare_connector.transfer.device.nixl import NixlTransport
        from kvshare_connector.transfer.device.probe import ProbeBuffer
        from kvshare_connector.transfer.wire.settings import EngineSettings

        self.stack, self.topology = build(model, layout, kv_mib, 2048)
        self.transport = NixlTransport(
            f"decode-{name}-{os.getpid()}", progress_thread=progress_thread
        )
        settings = EngineSettings(
            f"decode-{name}",
            handshake_timeout_s=handshake_s,
            transfer_timeout_s=TRANSFER_S,
            identity=identity,
        )
        self.sink = KVSink(
            self.topology,
            self.transport,
            settings,
            packer=cpu_packer(self.stack, packed_mib),
            probe=ProbeBuffer(probe_mib << 20, "cpu") if probe_mib else None,
        )

    def zero(self) -> None:
        for region in self.topology.regions:
            ctypes.memset(region.addr, 0, region.nbytes)

    def untouched(self) -> bool:
        """Every block of every owner is still zero."""
        return kvcheck.nonzero_blocks_outside(self.stack.kv_caches, self.topology, []) == []

    def read(
        self, request: dict[str, Any], local_ids, request_id: str, check_ids=None, **params: Any
    ):
        """Read through ``read_and_check`` (bounded), with some kv_transfer_params replaced;
        the bytes are checked at ``check_ids`` (default: where they were read to)."""
        self.zero()
        return read_and_check(
            self.sink,
            self.stack,
            self.topology,
            dict(request["kv_transfer_params"], **params),
            local_ids,
            seed=request["seed"],
            request_id=request_id,
            timeout_s=HANDSHAKE_S + TRANSFER_S + 5,
            check_ids=check_ids,
        )

    def wait(self, request_id: str, timeout_s: float) -> tuple[bool, str | None, float]:
        """Poll until ``request_id`` is done or failed: (done, failure, seconds)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            done, failed = self.sink.poll()
            if request_id in done or request_id in failed:
                return request_id in done, failed.get(request_id), time.monotonic() - start
            time.sleep(0.002)
        raise AssertionError(f"{request_id} neither finished nor failed in {timeout_s:g} s")

    def close(self) -> None:
        self.sink.close()


def decoder_pool():
    """Decoders by (model, layout), built on first use; a module's ``decoders`` fixture
    yields ``get`` and closes them all at its end."""
    made: dict[tuple[Any, ...], Decoder] = {}

    def get(
        model: str,
        layout: str,
        kv_mib: int | None = None,
        handshake_s=HANDSHAKE_S,
        identity: EngineIdentity | None = None,
        packed_mib: int = 0,
        progress_thread: bool = False,  # off: see transfer_peer.peer_env; tests poll
        probe_mib: int = 0,
    ):
        kv_mib = kv_mib or DECODE_KV_MIB[model]
        key = (
            model, layout, kv_mib, handshake_s, repr(identity), packed_mib, progress_thread,
            probe_mib,
        )  # fmt: skip
        if key not in made:
            made[key] = Decoder(
                model,
                layout,
                kv_mib,
                handshake_s,
                f"{len(made)}",
                identity,
                packed_mib,
                progress_thread,
                probe_mib,
            )
        return made[key]

    yield get
    for decoder in made.values():
        decoder.close()


def _counter():
    n = iter(range(10**6))
    return lambda prefix: f"{prefix}-{next(n)}"


new_id = _counter()


def scattered(ids: list[int]) -> bool:
    """Not one ascending run of consecutive ids."""
    return ids != list(range(ids[0], ids[0] + len(ids)))


def expected_bytes(topology, ids) -> int:
    return sum(
        len(block_ids) * group.spec.page_bytes * len(group.layer_names)
        for group, block_ids in zip(topology.groups, ids, strict=True)
    )


def assert_landed(decoder: Decoder, result, local_ids) -> None:
    """The read finished and every layer (sharers through their alias) holds prefill's KV."""
    assert result.done, result.failure
    assert result.mismatches == []
    assert result.stray == []
    assert result.bytes == expected_bytes(decoder.topology, local_ids)
    assert 0 < result.descriptors <= result.bytes
    layers = set(decoder.stack.kv_caches)
    assert layers == set(decoder.topology.owners) | set(decoder.topology.sharers)
    for sharer, target in decoder.topology.sharers.items():
        assert decoder.stack.kv_caches[sharer].data_ptr() == (
            decoder.stack.kv_caches[target].data_ptr()
        )
