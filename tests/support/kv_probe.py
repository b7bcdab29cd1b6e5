"""KVShareConnector that records per-block digests of the KV it serves and loads.

Proof that PD moves KV exactly: prefill digests every (owner layer, block) of a request it
holds for decode; decode digests the same logical blocks once its load finished and before
vLLM runs a forward on them; the two must be equal byte for byte. Sharing layers are
digested through the tensor the model reads for them (the forward context's binding) and
must equal their target's. ``scramble`` (a negative control) rotates each group's block ids
of a load order before it is posted while recording the unscrambled ids, so bytes land in
the wrong blocks and the comparison must report them.

    --kv-transfer-config '{"kv_connector": "KVProbeConnector",
        "kv_connector_module_path": "tests.support.kv_probe",
        "kv_connector_extra_config": {"kv_probe": {"out": "decode.jsonl", "scramble": false}}}'

A decode request whose kv_transfer_params carry ``"kvshare_probe_scramble": true`` is
scrambled too. ``"kvshare_probe_tamper": true`` (a negative control of ``verify_kv``)
overwrites 64 bytes of the request's first block after the READ landed and before the
connector verifies it: the load must fail. Digests cover the request's token slots only
(LMCache moves tokens, not the stale tail of a last block), in one dim order (block, token,
head, kv, dim, content), so two engines with different physical layouts compare.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvshare_connector.connector import KVShareConnector
from kvshare_connector.layout.topology import BLOCK, CONTENT, DIM, HEAD, KV, TOKEN, KVTopology
from kvshare_connector.vllm.metadata import KVShareMetadata

SCRAMBLE = "kvshare_probe_scramble"
TAMPER = "kvshare_probe_tamper"
NULL_BLOCK = 0
CANONICAL = (BLOCK, TOKEN, HEAD, KV, DIM, CONTENT)


# ---- digests (pure torch: the same code runs on CPU tests and on the GPU) -----------------


def positions_of(ids: Sequence[int], num_tokens: int, block_size: int) -> list[int]:
    """Position in the request of each listed block: a table from position 0 (as long as
    the request needs, or longer) or a tail clipped to a sliding window."""
    need = math.ceil(num_tokens / block_size)
    if len(ids) >= need:
        return list(range(need))
    return list(range(need - len(ids), need))


def layer_digests(
    view: Any,
    labels: Sequence[str],
    block_size: int,
    block_ids: Sequence[int],
    positions: Sequence[int],
    num_tokens: int,
) -> tuple[list[str | None], int]:
    """sha256 of each listed block's token slots < ``num_tokens`` in one layer's logical
    view (None for the null block), and the bytes of one token slot. One gather and one
    copy to the host per layer."""
    import torch

    b_axis, t_axis = labels.index(BLOCK), labels.index(TOKEN)
    kernel_tokens = view.shape[t_axis]
    per_block = block_size // kernel_tokens
    real = [(i, b) for i, b in enumerate(block_ids[: len(positions)]) if b != NULL_BLOCK]
    out: list[str | None] = [None] * len(positions)
    token_bytes = math.prod(view.shape) // view.shape[b_axis] // kernel_tokens
    token_bytes *= view.element_size()
    if not real:
        return out, token_bytes
    kernel = [b * per_block + k for _, b in real for k in range(per_block)]
    index = torch.tensor(kernel, dtype=torch.long, device=view.device)
    rest = [labels.index(label) for label in CANONICAL[2:] if label in labels]
    gathered = view.index_select(b_axis, index).permute(b_axis, t_axis, *rest)
    host = gathered.reshape(len(real), per_block * kernel_tokens, *gathered.shape[2:]).cpu()
    for row, (i, _) in enumerate(real):
        valid = min(block_size, num_tokens - positions[i] * block_size)
        data = host[row, :valid].contiguous().view(torch.uint8).numpy()
        out[i] = hashlib.sha256(data.tobytes()).hexdigest()
    return out, token_bytes


def request_record(
    topology: KVTopology,
    views: Mapping[str, Any],
    sharer_views: Mapping[str, Any],
    groups: Sequence[Sequence[int]],
    num_tokens: int,
    **fields: Any,
) -> dict[str, Any]:
    """One side's digests of one request: every owner layer's blocks (per KV cache group)
    and every sharer's blocks read through the tensor given for it."""
    started = time.perf_counter()
    positions = {
        g.index: positions_of(groups[g.index], num_tokens, g.spec.block_size)
        for g in topology.groups
    }
    record: dict[str, Any] = {
        **fields,
        "num_tokens": num_tokens,
        "layout": topology.layout,
        "groups": {g: list(groups[g][: len(p)]) for g, p in positions.items()},
        "positions": positions,
        "group_specs": {
            g.index: {"block_size": g.spec.block_size, "sliding_window": g.spec.sliding_window}
            for g in topology.groups
        },
        "layer_groups": {name: o.group for name, o in topology.owners.items()},
        "num_sharers": len(topology.sharers),
        "digests": {},
        "token_bytes": {},
        "sharers": {},
    }
    for name, owner in topology.owners.items():
        g = owner.group
        record["digests"][name], record["token_bytes"][name] = layer_digests(
            views[name], owner.labels, owner.spec.block_size, groups[g], positions[g], num_tokens
        )
    for sharer, target in topology.sharers.items():
        if sharer not in sharer_views:
            continue
        owner = topology.owners[target]
        g = owner.group
        digests, _ = layer_digests(
            sharer_views[sharer],
            owner.labels,
            owner.spec.block_size,
            groups[g],
            positions[g],
            num_tokens,
        )
        record["sharers"][sharer] = {"target": target, "digests": digests}
    record["seconds"] = round(time.perf_counter() - started, 4)
    return record


def scrambled(block_ids: Sequence[Sequence[int]]) -> tuple[list[int], ...]:
    """Each group's non-null block ids rotated by one among their places (null blocks
    stay put, so a load's null-block checks still pass): every block moves when a
    group has two or more."""
    out = []
    for ids in block_ids:
        places = [i for i, b in enumerate(ids) if b != NULL_BLOCK]
        real = [ids[i] for i in places]
        rotated = real[1:] + real[:1]
        new = list(ids)
        for i, b in zip(places, rotated, strict=True):
            new[i] = b
        out.append(new)
    return tuple(out)


# ---- comparison ---------------------------------------------------------------------------


def needed_from(num_tokens: int, spec: Mapping[str, Any]) -> int:
    """First position a sliding-window group needs for the prompt's last token (LMCache
    stores from there); 0 for full attention."""
    window = spec.get("sliding_window")
    return max(0, num_tokens - window) // spec["block_size"] if window else 0


def compare(
    prefill: Mapping[str, Any],
    decode: Mapping[str, Any],
    needed_only: bool = False,
    max_locations: int = 5,
) -> dict[str, Any]:
    """Decode's digests against prefill's, per owner layer and block, aligned by position
    in the request (blocks tail-aligned per group, null block 0 on either side skipped);
    and each sharer against its target on each side. ``needed_only``: sliding-window
    groups from the first position the last token attends to (what LMCache moves)."""
    prefill, decode = json.loads(json.dumps(prefill)), json.loads(json.dumps(decode))
    result: dict[str, Any] = {
        "request_id": decode.get("request_id"),
        "remote_request_id": decode.get("remote_request_id"),
        "num_tokens": decode.get("num_tokens"),
        "blocks_compared": 0,
        "bytes_compared": 0,
        "mismatches": 0,
        "locations": [],
        "groups_without_blocks": [],
        "sharers_checked": 0,
        "sharer_mismatches": 0,
        "sharer_locations": [],
        "sharers_missing": {  # sharers no tensor was found for (not checked)
            name: side.get("num_sharers", 0) - len(side.get("sharers", {}))
            for name, side in (("prefill", prefill), ("decode", decode))
        },
        "problems": [],
    }
    if prefill.get("num_tokens") != decode.get("num_tokens"):
        result["problems"].append(
            f"prompt lengths differ: prefill {prefill.get('num_tokens')}, "
            f"decode {decode.get('num_tokens')}"
        )
        return result
    n = int(decode["num_tokens"])
    pairs: dict[str, list[tuple[int, int, int, int, int]]] = {}
    for g, spec in decode["group_specs"].items():
        first = needed_from(n, spec) if needed_only else 0
        d_at, p_at = _by_position(decode, g), _by_position(prefill, g)
        common = sorted(p for p in d_at.keys() & p_at.keys() if p >= first)
        # (position, decode index, prefill index, decode block, prefill block)
        pairs[g] = [(p, d_at[p][0], p_at[p][0], d_at[p][1], p_at[p][1]) for p in common]
        if not common:
            result["groups_without_blocks"].append(int(g))
    for layer, group in decode["layer_groups"].items():
        g = str(group)
        mine, theirs = decode["digests"].get(layer), prefill["digests"].get(layer)
        if mine is None or theirs is None:
            result["problems"].append(f"layer {layer} missing on one side")
            continue
        block_size = decode["group_specs"][g]["block_size"]
        for pos, d_i, p_i, block, remote in pairs[g]:
            result["blocks_compared"] += 1
            valid = min(block_size, n - pos * block_size)
            result["bytes_compared"] += valid * decode["token_bytes"][layer]
            if mine[d_i] != theirs[p_i]:
                result["mismatches"] += 1
                if len(result["locations"]) < max_locations:
                    result["locations"].append(
                        f"layer {layer}, group {g}, block {block} (position {pos}; "
                        f"prefill block {remote})"
                    )
    for side in (prefill, decode):
        for sharer, entry in side.get("sharers", {}).items():
            result["sharers_checked"] += 1
            if entry["digests"] != side["digests"].get(entry["target"]):
                result["sharer_mismatches"] += 1
                if len(result["sharer_locations"]) < max_locations:
                    result["sharer_locations"].append(
                        f"{side.get('side')}: {sharer} != its target {entry['target']}"
                    )
    return result


def _by_position(record: Mapping[str, Any], g: str) -> dict[int, tuple[int, int]]:
    """Position -> (index in the record's lists, block id), null blocks left out."""
    pairs = zip(record["positions"][g], record["groups"][g], strict=True)
    return {p: (i, b) for i, (p, b) in enumerate(pairs) if b != NULL_BLOCK}


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

    # -- scheduler side ---------------------------------------------------------------------

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            self._pending_decode[request.request_id] = {
                "remote_request_id": params.get("remote_request_id"),
                "num_tokens": len(request.prompt_token_ids or ()),
                "scramble": self._scramble_all or bool(params.get(SCRAMBLE)),
                "tamper": bool(params.get(TAMPER)),
            }
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        hold, params = super().request_finished_all_groups(request, block_ids)
        self._note_finished(request, hold, params)
        return hold, params

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        hold, params = super().request_finished(request, block_ids)
        self._note_finished(request, hold, params)
        return hold, params

    def _note_finished(self, request: Any, hold: bool, params: dict[str, Any] | None) -> None:
        self._pending_decode.pop(request.request_id, None)
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
        meta.kv_probe = {"prefill": self._pending_prefill, "decode": decode}
        self._pending_prefill = {}
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
        """Wrap the sink's verification once: tampered loads get a block overwritten."""
        sink = getattr(getattr(self.worker, "backend", None), "sink", None)
        sink = getattr(sink, "sink", sink)  # the KVSink inside a ShardedSink
        if sink is None or getattr(sink, "probe_tamper", False):
            return
        verify = sink._verify

        def tampered(read: Any) -> None:
            if read.request_id in self._tamper:
                self._tamper.discard(read.request_id)
                _overwrite_first_block(sink, read)
            verify(read)

        sink._verify = tampered
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
        assert self.worker is not None and self.worker.topology is not None
        _synchronize(self._views)
        record = request_record(
            self.worker.topology,
            self._views,
            self._sharer_views(),
            info["groups"],
            int(info["num_tokens"]),
            side=side,
            request_id=request_id,
            remote_request_id=remote_id,
            bindings_differ=self._bindings_differ(),
            **fields,
        )
        self._append(record)

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
        with open(self._out, "a") as out:
            out.write(json.dumps(record) + "\n")


def _overwrite_first_block(sink: Any, read: Any) -> None:
    """64 bytes of the first owner layer's first loaded block, on its device."""
    topology = sink.topology
    owner = topology.owners[sorted(topology.owners)[0]]
    block = read.local_read[owner.group][0]
    g = owner.geometry
    addr = g.base + block * g.block_stride + g.segment_offsets[0]
    memory = (sink.digester or sink.packer).memory
    span = memory.span_of(addr, 64)
    span.flat[addr - span.start : addr - span.start + 64].fill_(0x77)


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "data_ptr") and hasattr(value, "shape") and value.numel() > 0


def _synchronize(views: Mapping[str, Any]) -> None:
    """Wait for every stream of the KV's device (a load may copy on its own stream)."""
    import torch

    for view in views.values():
        if view.is_cuda:
            torch.cuda.synchronize(view.device)
        return
