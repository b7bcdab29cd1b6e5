"""Scheduler side of the connector: which requests load or hold KV, and what to tell workers.

Prefill (``do_remote_decode``): when a request finishes, the backend decides what to keep for
decode, and ``kv_transfer_params`` go back in vLLM's NixlConnector names. Decode
(``do_remote_prefill``): claim the prompt's tokens as external, then the backend turns the
blocks vLLM allocated into a load order for the workers. Malformed params or a failed load
never stop the engine: the request is computed locally instead, the reason is logged and
returned in the request's ``kv_transfer_params`` as ``kv_load_error``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvshare_connector.backends.base import (
    Backend,
    DecodeRequest,
    LoadOrder,
    ScheduledRequest,
    SchedulerContext,
)
from kvshare_connector.backends.options import ConnectorOptions
from kvshare_connector.common.log import get_logger
from kvshare_connector.layout.topology import BlockIds
from kvshare_connector.transfer.wire.kv_params import (
    KVTransferParamsError,
    kv_transfer_params,
    loaded_prompt_tokens,
    prompt_mismatch,
    remote_prefill_params,
)
from kvshare_connector.vllm import compat
from kvshare_connector.vllm.metadata import KVShareMetadata
from kvshare_connector.vllm.stats import KVShareStats

logger = get_logger(__name__)


@dataclass
class _Loading:
    request: Any
    local_tokens: int  # tokens computed locally before the external ones
    # its groups' hits differ (``prefix_hits``): frees its blocks, to start over if it fails
    release: Callable[[], None] | None = None


class KVShareScheduler:
    """Scheduler-side logic, one per engine; the backend's scheduler side makes the orders."""

    def __init__(self, context: SchedulerContext, backend: Backend):
        self.context = context
        self.num_groups = context.num_groups
        self.backend = backend.scheduler_side(context)
        self._to_load: list[LoadOrder] = []
        self._to_hold: dict[str, BlockIds] = {}
        self._loading: dict[str, _Loading] = {}
        self._local_tokens: dict[str, int] = {}  # tokens cached locally when matched
        self._group_hits: dict[str, Callable[[], None]] = {}  # see took_group_hits
        self.load_errors: dict[str, str] = {}
        self.stats = KVShareStats()  # loads refused here (the prompt is not prefill's)
        self._warned_no_digest = False

    # -- decode ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        try:
            parsed = remote_prefill_params(params)
        except KVTransferParamsError as exc:
            self._fail_params(request, str(exc))
            return 0, False
        mismatch = prompt_mismatch(parsed, request.prompt_token_ids)
        if mismatch:
            # Prefill's blocks are left to its lease: these params may be another request's,
            # whose own decode must still be able to read them.
            self._fail_params(request, mismatch)
            self.stats.count("failed_loads")
            return 0, False
        if parsed.remote_prompt_digest is None and not self._warned_no_digest:
            self._warned_no_digest = True
            logger.warning(
                "kv_transfer_params without remote_prompt_digest (a prefill or proxy from "
                "elsewhere): decode cannot check that prefill computed the same prompt"
            )
        prompt_len = len(request.prompt_token_ids or ())
        count = loaded_prompt_tokens(parsed, prompt_len) - num_computed_tokens
        self._local_tokens[request.request_id] = num_computed_tokens
        if count <= 0:
            return 0, False  # decode holds all prefill has: nothing to read
        return count, True

    def loads_to(self, request: Any) -> int:
        """The prompt tokens ``request``'s load would bring, 0 if it would load nothing
        (what ``vllm/prefix_hits.py`` asks before it gives the groups their own hits):
        ``get_num_new_matched_tokens``' checks, without their side effects."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0
        try:
            parsed = remote_prefill_params(params)
        except KVTransferParamsError:
            return 0
        if prompt_mismatch(parsed, request.prompt_token_ids):
            return 0
        return loaded_prompt_tokens(parsed, len(request.prompt_token_ids or ()))

    def took_group_hits(self, request_id: str, release: Callable[[], None]) -> None:
        """vLLM gave ``request_id``'s KV cache groups their own hits (``prefix_hits``)."""
        self._group_hits[request_id] = release

    def _fail_params(self, request: Any, reason: str) -> None:
        message = f"{reason}; computing the prompt locally instead"
        logger.error("request %s: %s", request.request_id, message)
        self.load_errors[request.request_id] = message
        request.kv_transfer_params["do_remote_prefill"] = False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            self.backend.prefill_admitted(request.request_id)
            return
        if not params or not params.get("do_remote_prefill"):
            return
        try:
            parsed = remote_prefill_params(params)
        except KVTransferParamsError as exc:
            self._fail_params(request, str(exc))
            return
        local_tokens = self._local_tokens.pop(request.request_id, 0)
        release = self._group_hits.pop(request.request_id, None)
        if num_external_tokens > 0:
            self._loading[request.request_id] = _Loading(request, local_tokens, release)
        # tokens decode's prefix cache held (not read) and tokens the load brings
        self.stats.count("prefix_hit_tokens", local_tokens)
        self.stats.count("loaded_tokens", max(num_external_tokens, 0))
        prompt = list(request.prompt_token_ids)
        order = self.backend.decode_allocated(
            DecodeRequest(
                request_id=request.request_id,
                params=parsed,
                # The prompt whose KV prefill holds (a prefix of decode's own, see
                # kv_params.loaded_prompt_tokens): what backends count blocks by.
                prompt_token_ids=prompt[: loaded_prompt_tokens(parsed, len(prompt))],
                block_ids=tuple(list(ids) for ids in blocks.get_block_ids()),
                new_block_ids=tuple(
                    list(ids) for ids in blocks.get_unhashed_block_ids_all_groups()
                ),
                num_external_tokens=num_external_tokens,
                num_local_tokens=local_tokens,
            )
        )
        if order is not None:
            self._to_load.append(order)
        params["do_remote_prefill"] = False  # one transfer per request

    def failed_loads(self, failures: dict[str, str]) -> None:
        """The worker could not load these requests: recompute their prompts locally.

        vLLM >= 0.30 learns of them through ``failed_recving`` and its
        ``kv_load_failure_policy`` decides (recompute, or fail the request) for any number
        of KV cache groups. vLLM 0.26's invalid-block path unpacks a single KV cache group,
        so under HMA the connector resets what was counted as computed itself, the same
        way that path does; a request whose groups had their own hits starts over from no
        tokens and no blocks (its sliding-window groups lack the window before the hit),
        as vLLM >= 0.30 does with a failed load.
        """
        own_reset = self.num_groups > 1 and not compat.HAS_FAILED_RECVING
        then = "recomputed locally" if own_reset else "kv_load_failure_policy applies"
        for request_id, reason in failures.items():
            logger.error("request %s: KV load failed (%s); %s", request_id, reason, then)
            loading = self._loading.pop(request_id, None)
            if loading is None and compat.HAS_FAILED_RECVING:
                continue  # vLLM's "fail" policy finished it already, in this same step
            self.load_errors[request_id] = f"KV load failed: {reason}; {then}"
            if loading is not None and own_reset:
                if loading.release is not None:
                    loading.release()
                    loading.request.num_computed_tokens = 0
                else:
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
        self._group_hits.pop(request.request_id, None)
        self.backend.forget(request.request_id)
        if params.get("do_remote_prefill"):
            # Decode dropped it before its blocks were allocated.
            try:
                parsed = remote_prefill_params(params)
            except KVTransferParamsError:
                parsed = None
            order = self.backend.decode_aborted(request.request_id, parsed) if parsed else None
            if order is not None:
                self._to_load.append(order)
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode"):
            return False, ({"kv_load_error": error} if error else None)
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            return False, None  # aborted prefill: free now, decode will not come
        result = self.backend.prefill_finished(
            request.request_id, tuple(list(ids) for ids in block_ids)
        )
        if result.hold:
            self._to_hold[request.request_id] = result.remote_block_ids
        params = self._params(request, result.remote_block_ids)
        return result.hold, {**params, **result.extra_params}

    def _params(self, request: Any, block_ids: BlockIds) -> dict[str, Any]:
        """What decode needs, in vLLM NixlConnector's names (so PD proxies pass it on)."""
        c = self.context
        return kv_transfer_params(
            remote_block_ids=block_ids,
            remote_engine_id=c.engine_id,
            remote_request_id=request.request_id,
            remote_host=c.host,
            remote_port=c.port,
            tp_size=c.tp_size,
            remote_num_tokens=request.num_computed_tokens,
            prompt_token_ids=request.prompt_token_ids,
        )

    def take_stats(self) -> KVShareStats | None:
        """Scheduler-side stats (vLLM's scheduler asks the connector for them too)."""
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, KVShareStats()
        return stats

    # -- every step ------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any = None) -> KVShareMetadata:
        stores = []
        if scheduler_output is not None and self.backend.needs_steps():
            stores = self.backend.stores(scheduled_requests(scheduler_output))
        meta = KVShareMetadata(to_load=self._to_load, to_hold=self._to_hold, to_store=stores)
        self._to_load, self._to_hold = [], {}
        return meta


def scheduler_context(
    vllm_config: Any,
    kv_cache_config: Any,
    engine_id: str,
    host: str,
    port: int,
    options: ConnectorOptions,
) -> SchedulerContext:
    """The scheduler side's view of its engine, from vLLM's configs."""
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    return SchedulerContext(
        engine_id=engine_id,
        host=host,
        port=port,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        block_sizes=[s.block_size for s in specs],
        sliding_windows=[getattr(s, "sliding_window", None) for s in specs],
        options=options,
    )


def scheduled_requests(scheduler_output: Any) -> list[ScheduledRequest]:
    """vLLM's ``SchedulerOutput`` as the plain per-request values a backend reads."""
    counts = scheduler_output.num_scheduled_tokens
    cached = scheduler_output.scheduled_cached_reqs
    steps = [
        ScheduledRequest(
            r.req_id,
            r.block_ids,
            True,
            r.num_computed_tokens,
            counts.get(r.req_id, 0),
            r.prompt_token_ids,
        )
        for r in scheduler_output.scheduled_new_reqs
    ]
    resumed = compat.resumed_request_ids(cached)
    for rid, new_ids, computed in zip(
        cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
    ):
        steps.append(
            ScheduledRequest(rid, new_ids, rid in resumed, computed, counts.get(rid, 0), None)
        )
    return steps
