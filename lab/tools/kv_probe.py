"""KVShareConnector that records per-block digests of the KV it serves and loads.

Proof that PD moves KV exactly: prefill digests every (owner layer, block) of a request it
holds for decode; decode digests the same logical blocks once its load finished and before
vLLM runs a forward on them; the two must be equal byte for byte (``kv_digests``). Sharing
layers are digested through the tensor the model reads for them (the forward context's
binding) and must equal their target's. ``scramble`` (a negative control) rotates each
group's block ids of a load order before it is posted while recording the unscrambled ids,
so bytes land in the wrong blocks and the comparison must report them.

    --kv-transfer-config '{"kv_connector": "KVProbeConnector",
        "kv_connector_module_path": "lab.tools.kv_probe",
        "kv_connector_extra_config": {"kv_probe": {"out": "decode.jsonl", "scramble": false}}}'

A decode request whose kv_transfer_params carry ``"kvshare_probe_scramble": true`` is
scrambled too. ``"kvshare_probe_tamper": true`` (a negative control of ``verify_kv``)
overwrites 64 bytes of the request's first block after the READ landed and before the
connector verifies it: the load must fail. ``"kvshare_probe_reorder": true`` marks a request
whose params a proxy reordered (the driver rotates ``remote_block_ids``): its load must be
refused, and once decode computed the prompt itself and the request finished, its blocks are
digested (``at: recomputed``) to compare with prefill's. ``KVProbeTPConnector`` is the same
under tensor parallelism: digests per KV head, one file per rank (``<out stem>.r<rank>.jsonl``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvshare_connector.connector import KVShareConnector
from kvshare_connector.vllm.metadata import KVShareMetadata
from lab.tools.kv_digests import head_record, rank_path, request_record, scrambled

SCRAMBLE = "kvshare_probe_scramble"
TAMPER = "kvshare_probe_tamper"
REORDER = "kvshare_probe_reorder"


# ---- the connector ------------------------------------------------------------------------


class KVProbeConnector(KVShareConnector):
    """KVShareConnector plus digests of what prefill serves and what decode received."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        probe = extra.get("kv_probe") or {}
        self._out: str | None = probe.get("out")
        self._scramble_all = bool(probe.get("scramble", False))
        self._pending_decode: dict[str, dict[str, Any]] = {}  # scheduler: decode requests
        self._pending_prefill: dict[str, dict[str, Any]] = {}  # scheduler: held requests
        self._views: dict[str, Any] = {}  # worker: owner (and alias) views as handed over
        self._loads: dict[str, dict[str, Any]] = {}  # worker: loads in flight
        self._tamper: set[str] = set()  # worker: loads to overwrite before verification
        self._reordered: dict[str, dict[str, Any]] = {}  # scheduler: reordered decode requests
        self._recomputed: dict[str, dict[str, Any]] = {}  # scheduler: finished ones, to digest

    # -- scheduler side ---------------------------------------------------------------------

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            self._pending_decode[request.request_id] = {
                "remote_request_id": params.get("remote_request_id"),
                "num_tokens": len(request.prompt_token_ids or ()),
                "scramble": self._scramble_all or bool(params.get(SCRAMBLE)),
                "tamper": bool(params.get(TAMPER)),
                "reorder": bool(params.get(REORDER)),
            }
            if params.get(REORDER):
                self._reordered[request.request_id] = {
                    "remote_request_id": params.get("remote_request_id"),
                    "num_tokens": len(request.prompt_token_ids or ()),
                }
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        hold, params = super().request_finished_all_groups(request, block_ids)
        self._note_finished(request, hold, params, block_ids)
        return hold, params

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        hold, params = super().request_finished(request, block_ids)
        self._note_finished(request, hold, params, (block_ids,))
        return hold, params

    def _note_finished(
        self, request: Any, hold: bool, params: dict[str, Any] | None, blocks: Any
    ) -> None:
        self._pending_decode.pop(request.request_id, None)
        reordered = self._reordered.pop(request.request_id, None)
        if reordered is not None:  # its blocks, as decode computed them: digested next step
            groups = [list(ids) for ids in blocks]
            self._recomputed[request.request_id] = {**reordered, "groups": groups}
        if hold and params and params.get("remote_block_ids"):
            self._pending_prefill[request.request_id] = {
                "num_tokens": len(request.prompt_token_ids or ()),
                "groups": [list(ids) for ids in params["remote_block_ids"]],
            }

    def build_connector_meta(self, scheduler_output: Any) -> KVShareMetadata:
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, KVShareMetadata)
        decode = {}
        for order in meta.to_load:
            info = self._pending_decode.pop(order.request_id, None)
            if info is not None and any(order.local_block_ids):
                decode[order.request_id] = info
        meta.kv_probe = {
            "prefill": self._pending_prefill,
            "decode": decode,
            "recomputed": self._recomputed,
        }
        self._pending_prefill, self._recomputed = {}, {}
        return meta

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        self._views = dict(kv_caches)

    def register_cross_layers_kv_cache(self, kv_cache: Any, attn_backend: Any) -> None:
        super().register_cross_layers_kv_cache(kv_cache, attn_backend)
        from kvshare_connector.vllm.adapter import cross_layer_views

        assert self.worker is not None
        self._views, _ = cross_layer_views(
            self.worker.kv_cache_config, kv_cache, attn_backend, self.worker.vllm_config
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        probe = getattr(meta, "kv_probe", None) or {}
        if self._out and self.worker is not None:
            for request_id, info in probe.get("prefill", {}).items():  # held since last step
                self._write("prefill", request_id, request_id, info, at="held")
            for request_id, info in probe.get("recomputed", {}).items():  # before any forward
                remote = info["remote_request_id"]  # writes the blocks freed with the request
                self._write("decode", request_id, remote, info, at="recomputed", reordered=True)
            orders = []
            for order in meta.to_load:
                info = probe.get("decode", {}).get(order.request_id)
                if info is not None:
                    ids = [list(g) for g in order.local_block_ids]
                    self._loads[order.request_id] = {**info, "groups": ids}
                    if info.get("tamper"):
                        self._tamper.add(order.request_id)
                        self._install_tamper()
                    if info["scramble"]:
                        order = dataclasses.replace(
                            order, local_block_ids=scrambled(order.local_block_ids)
                        )
                orders.append(order)
            meta.to_load = orders
        super().start_load_kv(forward_context, **kwargs)

    def _install_tamper(self) -> None:
        """Wrap the sink's landing once: a tampered load gets a block overwritten once its
        READ is done, before decode scatters and digests it (what a faulty transfer or a
        stray write would leave; verify_kv must refuse the load)."""
        sink = getattr(getattr(self.worker, "backend", None), "sink", None)
        sink = getattr(sink, "sink", sink)  # the KVSink inside a ShardedSink
        if sink is None or getattr(sink, "probe_tamper", False):
            return
        land = sink.lander.land

        def tampered(read: Any) -> None:
            if read.request_id in self._tamper:
                self._tamper.discard(read.request_id)
                if read.transfer is not None and read.transfer.slot is not None:
                    _corrupt_staging(sink, read.transfer.slot)  # the scatter carries it
                else:
                    _overwrite_first_block(sink, read)
            land(read)

        sink.lander.land = tampered
        sink.probe_tamper = True

    def wait_for_save(self) -> None:
        """LMCache backend: prefill holds nothing for decode; digest the blocks the store
        copies out, right after the forward that computed them."""
        if self._out and self.worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            for order in getattr(meta, "to_store", ()):
                info = {"num_tokens": len(order.token_ids), "groups": order.block_ids}
                self._write("prefill", order.request_id, order.request_id, info, at="store")
        super().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = super().get_finished(finished_req_ids)
        self._record_loads(recving)
        return sending, recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM >= 0.30 asks for completions here instead of ``get_finished``."""
        results = super().get_transfer_results(finished_req_ids)
        self._record_loads(results.finished_recving)
        return results

    def _record_loads(self, recving: set[str] | None) -> None:
        """Digest every finished load (or note its failure) before vLLM runs on it."""
        if self._out and self.worker is not None and recving:
            failed = dict(self.worker._failed)  # kept until worker_meta() of this step
            for request_id in recving & self._loads.keys():
                info = self._loads.pop(request_id)
                if request_id in failed:
                    self._append(
                        {
                            "side": "decode",
                            "request_id": request_id,
                            "remote_request_id": info["remote_request_id"],
                            "scrambled": info["scramble"],
                            "tampered": info.get("tamper", False),
                            "reordered": info.get("reorder", False),
                            "failed": failed[request_id],
                        }
                    )
                    continue
                self._write(
                    "decode",
                    request_id,
                    info["remote_request_id"],
                    info,
                    at="loaded",
                    scrambled=info["scramble"],
                )

    def _write(
        self, side: str, request_id: str, remote_id: str, info: Mapping[str, Any], **fields: Any
    ) -> None:
        """Digest a request's blocks now (after the device finished writing them)."""
        _synchronize(self._views)
        fields = dict(side=side, request_id=request_id, remote_request_id=remote_id, **fields)
        self._append(self._digest(info["groups"], int(info["num_tokens"]), fields))

    def _digest(
        self, groups: list[list[int]], num_tokens: int, fields: dict[str, Any]
    ) -> dict[str, Any]:
        """One record of the request's blocks: per (owner layer, block)."""
        assert self.worker is not None and self.worker.topology is not None
        views, sharers = self._views, self._sharer_views()
        fields["bindings_differ"] = self._bindings_differ()
        return request_record(self.worker.topology, views, sharers, groups, num_tokens, **fields)

    def _sharer_views(self) -> dict[str, Any]:
        """What the model reads for each sharer: its attention layer's bound KV tensor
        (else the alias handed to register_kv_caches)."""
        assert self.worker is not None and self.worker.topology is not None
        context = self.worker.vllm_config.compilation_config.static_forward_context
        out = {}
        for sharer, target in self.worker.topology.sharers.items():
            bound = getattr(context.get(sharer), "kv_cache", None)
            if _is_tensor(bound) and tuple(bound.shape) == tuple(self._views[target].shape):
                out[sharer] = bound
            elif sharer in self._views:
                out[sharer] = self._views[sharer]
        return out

    def _bindings_differ(self) -> list[str]:
        """Owners whose tensor bound for the forward is not the view digested here."""
        assert self.worker is not None and self.worker.topology is not None
        context = self.worker.vllm_config.compilation_config.static_forward_context
        differ = []
        for name in self.worker.topology.owners:
            bound, mine = getattr(context.get(name), "kv_cache", None), self._views[name]
            if _is_tensor(bound) and (bound.data_ptr(), bound.stride(), bound.shape) != (
                mine.data_ptr(),
                mine.stride(),
                mine.shape,
            ):
                differ.append(name)
        return differ

    def _append(self, record: Mapping[str, Any]) -> None:
        assert self._out is not None
        with open(self._record_path(), "a") as out:
            out.write(json.dumps(record) + "\n")

    def _record_path(self) -> str:
        assert self._out is not None
        return self._out


class KVProbeTPConnector(KVProbeConnector):
    """Under tensor parallelism: each rank digests one KV head at a time, keyed by the
    head's global index, into a file of its own (the ranks are separate processes)."""

    def _digest(
        self, groups: list[list[int]], num_tokens: int, fields: dict[str, Any]
    ) -> dict[str, Any]:
        from kvshare_connector.transfer.decode.shards import rank_shard

        assert self.worker is not None and self.worker.topology is not None
        c = self.worker.context
        shard = rank_shard(self.worker.topology, c.tp_size, c.tp_rank, c.model_kv_heads)
        topology, views, sharers = self.worker.topology, self._views, self._sharer_views()
        return head_record(topology, shard, views, sharers, groups, num_tokens, **fields)

    def _record_path(self) -> str:
        assert self._out is not None and self.worker is not None
        return str(rank_path(self._out, self.worker.context.tp_rank))


def _overwrite_first_block(sink: Any, read: Any) -> None:
    """64 bytes of the first owner layer's first loaded block, on its device."""
    topology = sink.topology
    owner = topology.owners[sorted(topology.owners)[0]]
    block = read.local_read[owner.group][0]
    g = owner.geometry
    addr = g.base + block * g.block_stride + g.segment_offsets[0]
    window = (sink.digester or sink.packer).memory.check(np.array([addr]), np.array([64]))
    window.flat[addr - window.start : addr - window.start + 64].fill_(0x77)


def _corrupt_staging(sink: Any, slot: int) -> None:
    """64 bytes at the start of a packed read's staging slot, on its device."""
    sink.packer.staging.buffer[slot : slot + 64].fill_(0x77)


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "data_ptr") and hasattr(value, "shape") and value.numel() > 0


def _synchronize(views: Mapping[str, Any]) -> None:
    """Wait for every stream of the KV's device (a load may copy on its own stream)."""
    import torch

    for view in views.values():
        if view.is_cuda:
            torch.cuda.synchronize(view.device)
        return
