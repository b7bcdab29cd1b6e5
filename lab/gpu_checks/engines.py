"""One ``vllm.LLM`` per driver process, and greedy generation of token-id prompts: the
engine settings every GPU check shares (eager, seed 0, Triton attention for mixed head
sizes, one engine starting at a time)."""

from __future__ import annotations

import argparse
import fcntl
import json
import time
from pathlib import Path
from typing import Any


def start_engine(
    path: Path,
    args: argparse.Namespace,
    kv_config: dict | None,
    load_format: str = "dummy",
    max_model_len: int = 2048,
    jit_monitor: bool = True,
    tp: int = 1,
) -> tuple[Any, float]:
    """One engine (dummy weights unless told otherwise; ``tp`` ranks) started while holding
    ``args.lock``; returns it and its startup seconds (lock wait excluded)."""
    from vllm import LLM

    from kvshare_connector.demo.cpu_stack import hf_overrides_for

    overrides = hf_overrides_for(path / "config.json")
    if (
        overrides.get("global_head_dim")
        == json.loads((path / "config.json").read_text())["head_dim"]
    ):
        overrides = {}
    start = time.perf_counter()
    # One engine starts at a time: vLLM's memory profiling reads the GPU's free memory,
    # which another engine allocating at the same moment would distort.
    with open(Path(args.lock), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waited = time.perf_counter() - start
        llm = LLM(
            model=str(path),
            load_format=load_format,
            skip_tokenizer_init=True,
            enforce_eager=True,
            gpu_memory_utilization=args.mem,
            max_model_len=max_model_len,
            max_num_seqs=8,
            seed=0,
            hf_overrides=overrides,
            kv_transfer_config=kv_config,
            # Mixed head sizes make vLLM pick FA4 (CuTe DSL, not in this stack): use Triton.
            attention_backend="TRITON_ATTN" if overrides else None,
            jit_monitor_verbose=jit_monitor,  # every kernel (re)compiled, with its time
            tensor_parallel_size=tp,
            distributed_executor_backend="mp" if tp > 1 else None,
        )
        fcntl.flock(lock, fcntl.LOCK_UN)
    return llm, time.perf_counter() - start - waited


def generate_tokens(
    llm: Any, token_prompts: list[list[int]], params: list[dict] | None, max_tokens: int
) -> dict[str, Any]:
    """Greedy generation of token-id prompts, each with its kv_transfer_params (or none)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    greedy = {"temperature": 0.0, "logprobs": 1, "detokenize": False, "ignore_eos": True}
    sampling = []
    for i in range(len(token_prompts)):
        extra = {"kv_transfer_params": params[i]} if params and params[i] else None
        sampling.append(SamplingParams(max_tokens=max_tokens, extra_args=extra, **greedy))
    t0 = time.perf_counter()
    results = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in token_prompts], sampling, use_tqdm=False
    )
    return {
        "seconds": time.perf_counter() - t0,
        "tokens": [list(r.outputs[0].token_ids) for r in results],
        "logprobs": [
            [
                lp[t].logprob
                for lp, t in zip(r.outputs[0].logprobs, r.outputs[0].token_ids, strict=True)
            ]
            for r in results
        ],
        "kv_transfer_params": [r.kv_transfer_params for r in results],
    }


def engine_facts(llm: Any) -> dict[str, str]:
    """Which vLLM and which model runner an engine runs (0.33 picks V2 by default)."""
    import vllm

    config = llm.llm_engine.vllm_config
    v2 = bool(getattr(config, "use_v2_model_runner", False))
    return {"vllm": vllm.__version__, "model_runner": "v2" if v2 else "v1"}
