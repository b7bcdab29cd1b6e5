"""KVShareConnector for negative controls: it skips the loads it is asked to skip.

A request whose kv_transfer_params carry ``"kvshare_test_skip_load": true`` is reported
loaded without a byte moved (LMCache load or NIXL read alike), so its blocks keep whatever
they held. End-to-end checks send their negative-control batch through it: the outputs
must then differ from the baseline, which shows the check can fail. Every other request
goes through KVShareConnector unchanged.

    --kv-transfer-config '{"kv_connector": "LoadSkippingConnector",
        "kv_connector_module_path": "lab.tools.negative_control", ...}'
"""

from __future__ import annotations

from typing import Any

from kvshare_connector.connector import KVShareConnector
from kvshare_connector.vllm import compat
from kvshare_connector.vllm.metadata import KVShareMetadata

SKIP_LOAD = "kvshare_test_skip_load"


class LoadSkippingConnector(KVShareConnector):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._skip: set[str] = set()  # scheduler side: requests asked to skip
        self._skipped: set[str] = set()  # worker side: reported loaded, nothing moved

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        if (request.kv_transfer_params or {}).get(SKIP_LOAD):
            self._skip.add(request.request_id)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVShareMetadata:
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, KVShareMetadata)
        loads = {item.request_id for item in meta.to_load if any(item.local_block_ids)}
        meta.skip_loads = loads & self._skip  # travels to the worker with the metadata
        self._skip -= meta.skip_loads
        return meta

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        skip = getattr(meta, "skip_loads", set())
        if skip and self.worker is not None:
            meta.to_load = [item for item in meta.to_load if item.request_id not in skip]
            self._skipped |= skip  # finished next get_finished; nothing moved
        super().start_load_kv(forward_context, **kwargs)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = super().get_finished(finished_req_ids)
        if self._skipped:
            recving, self._skipped = (recving or set()) | self._skipped, set()
        return sending, recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM >= 0.30 asks this instead of ``get_finished``: the skipped loads must be
        reported here too, or decode waits for them forever."""
        results = super().get_transfer_results(finished_req_ids)
        if not self._skipped:
            return results
        recving = set(results.finished_recving or ()) | self._skipped
        self._skipped = set()
        failed = set(results.failed_recving or ())
        return compat.transfer_results(results.finished_sending, recving - failed, failed)


OVERWRITE_HITS = "kvshare_test_overwrite_hits"


class HitOverwritingConnector(KVShareConnector):
    """A request whose kv_transfer_params carry ``"kvshare_test_overwrite_hits": true``
    reads prefill's whole prompt into every block of its table, its prefix-cache hit's
    blocks included (what a load that ignored decode's hit would write): a check that
    decode's hit blocks keep decode's own KV must then fail. Other requests load as with
    KVShareConnector."""

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        if (request.kv_transfer_params or {}).get(OVERWRITE_HITS) and self.scheduler:
            self.scheduler._local_tokens[request.request_id] = 0
            blocks = _EveryBlock(blocks)
        super().update_state_after_alloc(request, blocks, num_external_tokens)


class _EveryBlock:
    """vLLM's ``KVCacheBlocks`` whose hit blocks pass for blocks allocated for the load."""

    def __init__(self, blocks: Any):
        self._blocks = blocks

    def get_block_ids(self) -> Any:
        return self._blocks.get_block_ids()

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [[b.block_id for b in group if not b.is_null] for group in self._blocks.blocks]
