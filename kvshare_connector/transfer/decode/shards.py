"""Decode under tensor parallelism: one request read from the prefill ranks that hold its
heads (``layout.sharding``), each as an ordinary ``KVSink`` read.

Each TP rank of an engine runs its own connector worker: prefill rank ``p`` serves on
``remote_port + p`` (``kv_transfer_params`` name the base port and prefill's ``tp_size``),
and decode rank ``d`` reads its heads from the prefill ranks ``sharding.sources`` picks.
A request read from several prefill ranks (split heads, prefill TP > decode TP) becomes
one sub-read per rank, ``<request>@tp<p>``; the request is done when every sub-read is,
failed (once none is still writing) if any failed. The decode ranks reading one prefill
rank share one claim token (derived from the request, so every rank of the engine
computes it) and tell prefill how many they are, so prefill frees the blocks after the
last of them; a prefill rank nobody reads is told at once (``Release``).

Head-sliced reads (a peer whose pairing covers part of each block) skip packed transfer:
the staging order is of whole blocks. ``verify_kv`` digests whole blocks, so a head-sliced
pairing is refused when it is on. Both are logged.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import replace

import msgspec

from kvshare_connector.common.log import get_logger
from kvshare_connector.layout.descriptors import BlockIds, PairedOwner
from kvshare_connector.layout.matching import EngineIdentity, LayoutMismatch, pair_owners
from kvshare_connector.layout.sharding import (
    GroupHeads,
    Shard,
    is_sliced,
    pair_sharded,
    readers_of,
    release_duty,
    sources,
)
from kvshare_connector.layout.topology import KVTopology
from kvshare_connector.transfer.decode.peers import Key
from kvshare_connector.transfer.decode.sink import SPIN_S, KVSink
from kvshare_connector.transfer.device.digests import Digester
from kvshare_connector.transfer.device.nixl import NixlTransport
from kvshare_connector.transfer.device.packing import Packer
from kvshare_connector.transfer.device.probe import ProbeBuffer
from kvshare_connector.transfer.device.records import SinkProgress
from kvshare_connector.transfer.wire import kv_params, protocol
from kvshare_connector.transfer.wire.settings import EngineSettings
from kvshare_connector.transfer.wire.side_channel import SideChannelError

logger = get_logger(__name__)

PART = "@tp"  # sub-read ids (opaque keys, mapped back in ``_part_of``): <request>@tp<rank>


def whole_shard(topology: KVTopology) -> Shard:
    """TP 1: every head of every group (what a peer that states no shard holds)."""
    heads = tuple(GroupHeads(g.spec.num_kv_heads, 0, g.spec.num_kv_heads) for g in topology.groups)
    return Shard(1, 0, heads)


def shared_token(engine_id: str, request_id: str, remote_request_id: str) -> str:
    """The claim token every decode rank of one engine computes for one request."""
    text = f"kvshare-tp-v1|{engine_id}|{request_id}|{remote_request_id}"
    return hashlib.sha256(text.encode()).hexdigest()[: protocol.CLAIM_TOKEN_LEN]


class ShardedSink:
    """``KVSink``'s interface for one decode TP rank (``shard``); TP 1 on both sides goes
    straight through to the sink, unchanged."""

    def __init__(
        self,
        shard: Shard | None,
        topology: KVTopology,
        transport: NixlTransport,
        settings: EngineSettings,
        packer: Packer | None = None,
        digester: Digester | None = None,
        probe: ProbeBuffer | None = None,
    ):
        self.shard = shard if shard is not None else whole_shard(topology)
        self.topology = topology
        self.sink = KVSink(
            topology, transport, settings, packer, digester, pairing=self._pair, probe=probe
        )
        self._expected: dict[Key, tuple[int, int]] = {}  # port -> (prefill rank, prefill TP)
        self._parts: dict[str, set[str]] = {}  # request -> sub-reads not finished
        self._part_of: dict[str, str] = {}  # sub-read -> request
        self._reasons: dict[str, list[str]] = {}  # request -> why sub-reads failed
        self._logged: set[str] = set()  # what _log_sliced_once said already

    @property
    def in_flight(self) -> set[str]:
        return {self._part_of.get(r, r) for r in self.sink.in_flight}

    def advance(self, spin_s: float = 0.0) -> None:
        self.sink.advance(spin_s)

    @property
    def reading(self) -> bool:
        return self.sink.reading

    def close(self) -> None:
        self.sink.close()

    def request(
        self,
        request_id: str,
        params: kv_params.RemotePrefillParams,
        local_ids: BlockIds,
        num_tokens: int | None = None,
        num_local_tokens: int | Sequence[int] = 0,
    ) -> None:
        """Queue the reads of ``request_id`` from every prefill rank holding its heads."""
        if self.shard.trivial and params.tp_size == 1:
            self.sink.request(request_id, params, local_ids, num_tokens, num_local_tokens)
            return
        if request_id in self._parts:
            raise ValueError(f"request {request_id} is already being read")
        totals = self.shard.totals
        chosen = sources(self.shard, params.tp_size)  # ShardError: not a split vLLM makes
        token = shared_token(self.sink.engine_id, request_id, params.remote_request_id)
        parts = []
        for src in chosen:
            port = params.remote_port + src.remote_rank
            self._expected[(params.remote_host, port)] = (src.remote_rank, params.tp_size)
            part = f"{request_id}{PART}{src.remote_rank}"
            readers = readers_of(src.remote_rank, totals, self.shard.tp_size, params.tp_size)
            self.sink.request(
                part,
                msgspec.structs.replace(params, remote_port=port),
                local_ids,
                num_tokens,
                num_local_tokens,
                token=token,
                readers=readers,
            )
            parts.append(part)
            self._part_of[part] = request_id
        self._parts[request_id] = set(parts)
        for rank in release_duty(totals, self.shard.tp_size, self.shard.tp_rank, params.tp_size):
            key = (params.remote_host, params.remote_port + rank)
            self.sink.peers.submit(key, self._release, key, params, rank)

    def poll(self, spin_s: float = SPIN_S) -> tuple[set[str], dict[str, str]]:
        done, failed = self.sink.poll(spin_s)
        return self._merge(done, failed)

    def take_progress(self, spin_s: float = SPIN_S) -> SinkProgress:
        """The sink's progress, sub-reads merged into their requests."""
        progress = self.sink.take_progress(spin_s)
        done, failed = self._merge(progress.done, progress.failed)
        return replace(progress, done=done, failed=failed)

    def _merge(self, done: set[str], failed: dict[str, str]) -> tuple[set[str], dict[str, str]]:
        """A request is done once every sub-read is, failed (with every reason) once all
        ended and one failed."""
        out_done = {r for r in done if r not in self._part_of}
        out_failed = {r: why for r, why in failed.items() if r not in self._part_of}
        for part in [*done, *failed]:
            request_id = self._part_of.pop(part, None)
            if request_id is None:
                continue
            if part in failed:
                self._reasons.setdefault(request_id, []).append(f"{part}: {failed[part]}")
            pending = self._parts[request_id]
            pending.discard(part)
            if pending:
                continue  # another prefill rank's heads are still on their way
            del self._parts[request_id]
            reasons = self._reasons.pop(request_id, None)
            if reasons:
                out_failed[request_id] = "; ".join(reasons)
            else:
                out_done.add(request_id)
        return out_done, out_failed

    # -- pairing and release ----------------------------------------------------------------

    def _pair(
        self,
        key: Key,
        remote: KVTopology,
        layout: protocol.LayoutMsg,
        remote_identity: EngineIdentity | None,
    ) -> list[PairedOwner]:
        """Owners to read from the prefill rank at ``key``: whole blocks under TP 1 on both
        sides, else the heads this decode rank takes from that rank."""
        identity = self.sink.settings.identity
        try:
            stated = protocol.shard_from_msg(layout)
        except protocol.ProtocolError as exc:
            raise LayoutMismatch([str(exc)], self.topology.layout, remote.layout) from exc
        remote_shard = stated if stated is not None else whole_shard(remote)
        if self.shard.trivial and remote_shard.trivial:
            return pair_owners(self.topology, remote, identity, remote_identity)
        expected = self._expected.get(key)
        if expected is not None and expected != (remote_shard.tp_rank, remote_shard.tp_size):
            raise LayoutMismatch(
                [
                    f"prefill at {key[0]}:{key[1]} is TP rank {remote_shard.tp_rank} of "
                    f"{remote_shard.tp_size}; decode expected rank {expected[0]} of "
                    f"{expected[1]} there (rank r serves on the base port + r)"
                ],
                self.topology.layout,
                remote.layout,
            )
        owners = pair_sharded(
            self.topology, remote, self.shard, remote_shard, identity, remote_identity
        )
        if is_sliced(self.topology, owners):
            if self.sink.digester is not None and self.sink.settings.verify_required:
                raise LayoutMismatch(
                    [
                        "verify_kv digests whole blocks; this TP pairing reads head slices "
                        f"(decode TP {self.shard.tp_size}, prefill TP {remote_shard.tp_size})"
                    ],
                    self.topology.layout,
                    remote.layout,
                )
            if self.sink.digester is not None:
                self._log_sliced_once(
                    logging.WARNING,
                    "verify_kv digests whole blocks, so those reads are not verified "
                    "(verify_kv: true refuses such pairings instead)",
                    remote_shard.tp_size,
                )
            if self.sink.packer is not None:
                self._log_sliced_once(
                    logging.INFO,
                    "packed transfer off for those reads (block by block)",
                    remote_shard.tp_size,
                )
        return owners

    def _log_sliced_once(self, level: int, consequence: str, remote_tp: int) -> None:
        """Say once per engine what reading head slices costs: every pairing with a
        prefill of another TP size would repeat it."""
        if consequence in self._logged:
            return
        self._logged.add(consequence)
        logger.log(
            level,
            "decode TP rank %d/%d reads head slices from prefill TP %d: %s",
            self.shard.tp_rank,
            self.shard.tp_size,
            remote_tp,
            consequence,
        )

    def _release(self, key: Key, params: kv_params.RemotePrefillParams, rank: int) -> None:
        """Tell a prefill rank no decode rank reads to free the request (best effort: its
        lease frees it anyway)."""
        remote_request_id = params.remote_request_id
        release = protocol.Release(
            protocol.PROTOCOL_VERSION,
            self.sink.engine_id,
            [remote_request_id],
            f"TP: decode reads these heads from another prefill rank than {rank}",
        )
        try:
            self.sink.peers.ask(key, params.remote_engine_id, release)
        except (SideChannelError, protocol.ProtocolError) as exc:
            logger.warning(
                "could not tell prefill rank %d to free request %s: %s",
                rank,
                remote_request_id,
                exc,
            )


def rank_shard(topology: KVTopology, tp_size: int, tp_rank: int, model_heads: int) -> Shard:
    """This worker's shard, from its own KV (heads per group) and vLLM's TP rank; a split
    vLLM would not make fails the engine at start-up, with the reason."""
    from kvshare_connector.layout.sharding import check_shard, group_totals, shard_of

    counts = [g.spec.num_kv_heads for g in topology.groups]
    shard = shard_of(group_totals(counts, tp_size, model_heads), tp_size, tp_rank)
    found = check_shard(shard, topology, "this engine's")
    if found:
        raise ValueError("KV heads of this TP rank: " + "; ".join(found))
    return shard
