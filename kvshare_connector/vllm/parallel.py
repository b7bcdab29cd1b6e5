"""Which tensor-parallel rank this connector worker is, read off vLLM (issue 16).

vLLM runs one connector worker per TP rank, each in its own worker process, after the
process joined its TP group; the scheduler-side connector is single and rank-less.
"""

from __future__ import annotations

from typing import Any


def tensor_parallel(vllm_config: Any, worker: bool) -> tuple[int, int]:
    """``(tp_size, tp_rank)`` of this connector instance (rank 0 for the scheduler)."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise NotImplementedError("KVShareConnector: pipeline parallelism is not supported")
    size = int(parallel.tensor_parallel_size)
    if not worker or size == 1:
        return size, 0
    from vllm.distributed import parallel_state

    rank = int(parallel_state.get_tensor_model_parallel_rank())
    if not 0 <= rank < size:
        raise RuntimeError(f"KVShareConnector: TP rank {rank} outside TP size {size}")
    return size, rank


def model_kv_heads(vllm_config: Any) -> int:
    """The model's KV head count (before the TP split), 0 when unknown."""
    try:
        return int(vllm_config.model_config.get_total_num_kv_heads())
    except Exception:  # a model config without it: shards then assume split heads
        return 0
