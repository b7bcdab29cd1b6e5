"""Scheduler side of the connector: which requests load or hold KV, and what to tell workers.

Prefill (``do_remote_decode``): when a request finishes, keep its blocks (clipped to each
sliding window) for decode to read, and hand back ``kv_transfer_params`` in vLLM's
NixlConnector names. Decode (``do_remote_prefill``): claim the prompt's tokens as external,
then ask the worker to read them into the blocks vLLM allocated. Malformed params or a
failed read never stop the engine: the request is computed locally instead, the reason is
logged and returned in the request's ``kv_transfer_params`` as ``kv_load_error``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvshare_connector.log import get_logger
from kvshare_connector.protocol import (
    KVTransferParamsError,
    RemotePrefillParams,
    remote_prefill_params,
)

logger = get_logger(__name__)

BlockIds = tuple[list[int], ...]


@dataclass
class RecvRequest:
    request_id: str
    params: RemotePrefillParams | None  # None: only tell prefill to free (aborted early)
    local_block_ids: BlockIds


@dataclass
class StoreKV:
    """LMCache backend, prefill: this step computes the prompt's last token; store it."""

    request_id: str
    token_ids: list[int]
    block_ids: BlockIds  # full tables from position 0, one per group


@dataclass
class LoadKV:
    """LMCache backend, decode: load the prompt's KV into these blocks."""

    request_id: str
    token_ids: list[int]
    block_ids: BlockIds  # full tables from position 0 (null block 0 kept)
    num_computed_tokens: int  # tokens cached locally before the external ones


@dataclass
class KVShareMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one engine step."""

    to_recv: list[RecvRequest] = field(default_factory=list)
    to_hold: dict[str, float] = field(default_factory=dict)  # request id -> lease seconds
    to_store: list[StoreKV] = field(default_factory=list)  # LMCache backend
    to_load: list[LoadKV] = field(default_factory=list)  # LMCache backend


@dataclass
class _Loading:
    request: Any
    local_tokens: int  # tokens computed locally before the external ones


@dataclass
class _Store:
    """LMCache prefill: a request's block tables, followed through the steps until the one
    that computes its last prompt token, and its prompt (sent only in its first step)."""

    tables: list[list[int]] | None = None
    prompt: list[int] = field(default_factory=list)


class KVShareScheduler:
    """Scheduler-side logic, one per engine."""

    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        engine_id: str,
        side_channel_host: str,
        side_channel_port: int,
        lease_s: float,
        backend: str = "nixl",
    ):
        self.engine_id = engine_id
        self.backend = backend
        self.host = side_channel_host
        self.port = side_channel_port
        self.lease_s = lease_s
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        groups = kv_cache_config.kv_cache_groups
        self.num_groups = len(groups)
        # Blocks of a sliding-window group that can still matter: the window, +1 for a
        # window that straddles a block boundary (vLLM frees the rest before finishing).
        self.window_blocks = [
            math.ceil(window / g.kv_cache_spec.block_size) + 1
            if (window := getattr(g.kv_cache_spec, "sliding_window", None))
            else 0
            for g in groups
        ]
        self._to_recv: list[RecvRequest] = []
        self._to_hold: dict[str, float] = {}
        self._loading: dict[str, _Loading] = {}
        self._local_tokens: dict[str, int] = {}  # tokens cached locally when matched
        self._to_store: dict[str, _Store] = {}  # prefill, LMCache backend
        self._to_load: list[LoadKV] = []
        self.load_errors: dict[str, str] = {}

    # -- decode ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        try:
            remote_prefill_params(params)
        except KVTransferParamsError as exc:
            self._fail_params(request, str(exc))
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._local_tokens[request.request_id] = num_computed_tokens
        return count, True

    def _fail_params(self, request: Any, reason: str) -> None:
        message = f"{reason}; computing the prompt locally instead"
        logger.error("request %s: %s", request.request_id, message)
        self.load_errors[request.request_id] = message
        request.kv_transfer_params["do_remote_prefill"] = False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and self.backend == "lmcache":
            self._to_store.setdefault(request.request_id, _Store())  # tables come with the step
            return
        if not params or not params.get("do_remote_prefill"):
            return
        try:
            parsed = remote_prefill_params(params)
        except KVTransferParamsError as exc:
            self._fail_params(request, str(exc))
            return
        local_tokens = self._local_tokens.pop(request.request_id, 0)
        if self.backend == "lmcache":
            params["do_remote_prefill"] = False
            if num_external_tokens > 0:
                self._loading[request.request_id] = _Loading(request, local_tokens)
                self._to_load.append(
                    LoadKV(
                        request.request_id,
                        list(request.prompt_token_ids),
                        tuple(list(ids) for ids in blocks.get_block_ids()),
                        local_tokens,
                    )
                )
            return
        if num_external_tokens > 0:
            local = self.clip_to_windows(blocks.get_unhashed_block_ids_all_groups())
            self._loading[request.request_id] = _Loading(request, local_tokens)
        else:  # everything is cached locally: only let prefill free its blocks
            local = tuple([] for _ in range(self.num_groups))
        self._to_recv.append(RecvRequest(request.request_id, parsed, local))
        params["do_remote_prefill"] = False  # one transfer per request

    def clip_to_windows(self, block_ids: Any) -> BlockIds:
        """Keep only the blocks a sliding-window group still needs (the tail)."""
        return tuple(
            list(ids[-keep:]) if keep and len(ids) > keep else list(ids)
            for ids, keep in zip(block_ids, self.window_blocks, strict=True)
        )

    def failed_loads(self, failures: dict[str, str]) -> None:
        """The worker could not load these requests: recompute their prompts locally.

        vLLM 0.26's invalid-block path unpacks a single KV cache group, so under HMA the
        connector resets what was counted as computed itself, the same way that path does.
        """
        # One group: the worker reported the blocks and vLLM's kv_load_failure_policy
        # decides (recompute or fail the request); several: recompute.
        then = "recomputed locally" if self.num_groups > 1 else "kv_load_failure_policy applies"
        for request_id, reason in failures.items():
            logger.error("request %s: KV load failed (%s); %s", request_id, reason, then)
            self.load_errors[request_id] = f"KV load failed: {reason}; {then}"
            loading = self._loading.pop(request_id, None)
            if loading is not None and self.num_groups > 1:
                loading.request.num_computed_tokens = loading.local_tokens

    def finished_loads(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            self._loading.pop(request_id, None)

    # -- prefill ---------------------------------------------------------------------------

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        error = self.load_errors.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        self._local_tokens.pop(request.request_id, None)
        self._to_store.pop(request.request_id, None)  # stored in its last prefill step
        if params.get("do_remote_prefill") and self.backend == "lmcache":
            params["do_remote_prefill"] = False  # LMCache holds no prefill blocks
            return False, None
        if params.get("do_remote_prefill"):
            # Aborted before blocks were allocated: prefill still holds blocks for it.
            try:
                parsed = remote_prefill_params(params)
                self._to_recv.append(
                    RecvRequest(
                        request.request_id, parsed, tuple([] for _ in range(self.num_groups))
                    )
                )
            except KVTransferParamsError:
                pass
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode"):
            return False, ({"kv_load_error": error} if error else None)
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            return False, None  # aborted prefill: free now, decode will not come
        if self.backend == "lmcache":
            # The KV went to LMCache in the step that computed it: nothing to hold.
            return False, self._params(request, tuple([] for _ in block_ids), lmcache=True)
        clipped = self.clip_to_windows(block_ids)
        hold = any(clipped)
        if hold:
            self._to_hold[request.request_id] = self.lease_s
        return hold, self._params(request, clipped, lmcache=False)

    def _params(self, request: Any, block_ids: BlockIds, lmcache: bool) -> dict[str, Any]:
        """What decode needs, in vLLM NixlConnector's names (so PD proxies pass it on)."""
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(ids) for ids in block_ids],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.tp_size,
            "remote_num_tokens": request.num_computed_tokens,
        }
        if lmcache:
            params["kvshare_backend"] = "lmcache"
        return params

    # -- every step ------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any = None) -> KVShareMetadata:
        meta = KVShareMetadata(
            to_recv=self._to_recv,
            to_hold=self._to_hold,
            to_store=self._stores_this_step(scheduler_output) if self._to_store else [],
            to_load=self._to_load,
        )
        self._to_recv, self._to_hold, self._to_load = [], {}, []
        return meta

    def _stores_this_step(self, scheduler_output: Any) -> list[StoreKV]:
        """LMCache prefill: follow each request's block tables through the steps and store
        it in the step that computes its last prompt token (the worker stores right after
        that forward, before the first token goes out)."""
        stores = []
        cached = scheduler_output.scheduled_cached_reqs
        steps = [
            (r.req_id, r.block_ids, False, r.num_computed_tokens, r.prompt_token_ids)
            for r in scheduler_output.scheduled_new_reqs
        ] + [
            (rid, new_ids, rid in cached.resumed_req_ids, computed, None)
            for rid, new_ids, computed in zip(
                cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
            )
        ]
        for request_id, new_ids, resumed, computed, prompt in steps:
            store = self._to_store.get(request_id)
            if store is None:
                continue
            if new_ids is not None:
                if store.tables is None or resumed or prompt is not None:
                    store.tables = [list(ids) for ids in new_ids]
                else:
                    for table, ids in zip(store.tables, new_ids, strict=True):
                        table.extend(ids)
            if prompt is not None:
                store.prompt = list(prompt)
            scheduled = scheduler_output.num_scheduled_tokens.get(request_id, 0)
            if (
                store.tables is not None
                and store.prompt
                and computed + scheduled >= len(store.prompt)
            ):
                stores.append(StoreKV(request_id, store.prompt, tuple(store.tables)))
                del self._to_store[request_id]
        return stores
