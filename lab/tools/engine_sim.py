"""Drive KVShareConnector the way vLLM's engine core and model runner do, on CPU (0.26-0.34).

Real: vLLM's ``Scheduler`` (block pool, HMA groups, connector hooks, request states), the
connector created by vLLM's factory in both roles, vLLM-made KV tensors (``cpu_stack``)
and NIXL over UCX. Emulated: the model forward, which here writes a known pattern into
the KV blocks the scheduler allocated for the prompt and samples a fixed token.

Run one role per process (JSON lines):
``python -m lab.tools.engine_sim prefill|decode ...``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

from kvshare_connector.common.child_process import report
from kvshare_connector.demo import kvcheck
from kvshare_connector.demo.parts import blocks_per_group
from kvshare_connector.vllm import compat

READY = "ENGINE_READY "
RESULT = "ENGINE_RESULT "


def build_engine(
    model: str,
    layout: str,
    role: str,
    port: int,
    extra: dict[str, Any] | None = None,
    connector: str = "KVShareConnector",
    module_path: str | None = None,
    failure_policy: str = "fail",
    kv_bytes: int = 32 << 20,
):
    """vLLM scheduler + worker-side connector over a CPU KV stack, as an engine would own.

    ``failure_policy``: vLLM's ``kv_load_failure_policy`` (its default, ``fail``; from 0.30
    it decides what a failed load does, under any number of KV cache groups). ``kv_bytes``:
    the KV pool (small: the scheduler preempts)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from kvshare_connector.demo.cpu_stack import build_cpu_stack

    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    transfer_config = KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path=module_path,
        kv_role=role,
        kv_connector_extra_config=extra or {},
        kv_load_failure_policy=failure_policy,
    )
    stack = build_cpu_stack(
        model, layout, kv_bytes=kv_bytes, max_model_len=1024, kv_transfer_config=transfer_config
    )
    vllm_config = stack.vllm_config
    scheduler_block, hash_block = resolve_kv_cache_block_sizes(stack.kv_cache_config, vllm_config)
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=stack.kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=scheduler_block,
        hash_block_size=hash_block,
    )
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    scheduler.block_hasher = get_request_block_hasher(hash_block, hash_fn)  # as EngineCore
    worker = KVConnectorFactory.create_connector(
        vllm_config, KVConnectorRole.WORKER, stack.kv_cache_config
    )
    if stack.cross_layer_tensor is not None:
        worker.register_cross_layers_kv_cache(stack.cross_layer_tensor, stack.cross_layer_backend)
    else:
        worker.register_kv_caches(stack.kv_caches)
    return stack, scheduler, worker


def make_request(
    request_id: str,
    num_tokens: int,
    max_tokens: int,
    params: dict | None,
    seed: int,
    block_hasher: Any = None,
):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    tokens = [(seed * 7919 + i * 31) % 4000 + 3 for i in range(num_tokens)]
    sampling = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        extra_args={"kv_transfer_params": params} if params is not None else None,
    )
    return Request(request_id, tokens, sampling, None, block_hasher=block_hasher)


class Engine:
    """One engine: step() = schedule, connector hooks, emulated forward, update."""

    def __init__(
        self,
        model: str,
        layout: str,
        role: str,
        port: int,
        extra: dict | None = None,
        **connector: Any,
    ):
        self.stack, self.scheduler, self.worker = build_engine(
            model, layout, role, port, extra, **connector
        )
        self.topology = self.worker.worker.topology
        self.outputs: dict[str, Any] = {}
        self.written: dict[str, list[list[int]]] = {}  # request -> block ids with pattern
        self.stats: list[dict] = []
        self.loaded: dict[str, list[str]] = {}  # decode request -> pattern mismatches on load

    def close(self) -> None:
        """The connector's shutdown, as vLLM's worker calls it: NIXL agents and LMCache
        engines (whose event-loop threads would otherwise keep the process alive) go."""
        self.worker.shutdown()

    def add(self, request_id: str, tokens: int, max_tokens: int, params: dict | None, seed: int):
        self.scheduler.add_request(
            make_request(request_id, tokens, max_tokens, params, seed, self.scheduler.block_hasher)
        )

    def step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput

        out = self.scheduler.schedule()
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)
        sampled: dict[str, list[int]] = {}
        for req_id, num in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            if request.num_computed_tokens + num >= request.num_prompt_tokens:
                params = request.kv_transfer_params or {}
                if request.num_output_tokens == 0 and params.get("do_remote_decode"):
                    self._forward_prefill(req_id)
                elif request.num_output_tokens == 0 and num > 1 and req_id.startswith("d"):
                    # decode computed the prompt itself (its load failed): the same model
                    # writes the same KV its prefill twin "p<i>" wrote
                    self._forward_prefill(req_id, twin="p" + req_id[1:])
                sampled[req_id] = [11 + len(request.output_token_ids)]
            else:
                sampled[req_id] = []
        self.worker.wait_for_save()  # after the forward, as the model runner does
        failed: set[str] = set()
        if compat.HAS_FAILED_RECVING:  # vLLM >= 0.30's runner asks for one snapshot
            results = self.worker.get_transfer_results(out.finished_req_ids)
            sending = results.finished_sending or None
            recving = results.finished_recving or None
            failed = results.failed_recving
        else:
            sending, recving = self.worker.get_finished(out.finished_req_ids)
        stats = self.worker.get_kv_connector_stats()
        if stats is not None:
            self.stats.append(stats.reduce())
        kv_output = KVConnectorOutput(
            finished_sending=sending,
            finished_recving=recving,
            kv_connector_worker_meta=self.worker.build_connector_worker_meta(),
            invalid_block_ids=self.worker.get_block_ids_with_load_errors(),
            **({"failed_recving": failed} if compat.HAS_FAILED_RECVING else {}),
        )
        self.worker.clear_connector_metadata()
        req_ids = list(sampled)
        model_output = compat.model_runner_output(
            req_ids, [sampled[r] for r in req_ids], kv_output
        )
        for req_id in recving or ():
            if req_id in self.scheduler.requests:
                self.loaded[req_id] = self.check_loaded(req_id)
        for engine_outputs in self.scheduler.update_from_output(out, model_output).values():
            for output in engine_outputs.outputs:
                if output.finished:
                    self.outputs[output.request_id] = output

    def _forward_prefill(self, req_id: str, twin: str | None = None) -> None:
        """The model wrote the prompt's KV: a pattern keyed by the prompt (its request, or
        the ``twin`` that had the same prompt) and block position."""
        ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        blocks = [list(group) for group in ids]
        seed = _seed(twin) if twin else self.written_seed(req_id)
        kvcheck.fill(self.stack.kv_caches, self.topology, blocks, seed=seed)
        self.written[req_id] = blocks

    def check_loaded(self, req_id: str) -> list[str]:
        """Does every layer hold prefill's pattern in the prompt blocks just loaded? The
        tokens loaded are the request's computed tokens when its load is reported: its whole
        prompt, or prefill's prompt where decode's extends it (the first-token hand-off)."""
        request = self.scheduler.requests[req_id]
        ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        blocks, firsts = [], []
        loaded = request.num_computed_tokens
        kept = blocks_per_group(self.topology, loaded)  # window-clipped
        for group, group_ids, keep in zip(self.topology.groups, ids, kept, strict=True):
            n = math.ceil(loaded / group.spec.block_size)
            blocks.append([b for b in list(group_ids)[n - keep : n]])
            firsts.append(n - keep)
        seed = self.loaded_seed(req_id)
        return kvcheck.mismatches(
            self.stack.kv_caches,
            self.topology,
            blocks,
            seed=seed,
            first_positions=firsts,
            num_tokens=loaded,
        )

    def written_seed(self, req_id: str) -> int:
        """The pattern of the KV the emulated model writes for ``req_id``'s prompt."""
        return _seed(req_id)

    def loaded_seed(self, req_id: str) -> int:
        """The pattern a loaded ``req_id`` must hold: its prefill twin's, "d3" <- "p3"."""
        return _seed("p" + req_id[1:])

    def run_until(self, done, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError("engine did not reach the expected state")
            self.step()
            time.sleep(0.002)


def _seed(request_id: str) -> int:
    return sum(request_id.encode()) % 1000


def num_blocks_for(group_spec: Any, tokens: int) -> int:
    return math.ceil(tokens / group_spec.block_size)


# ---- processes ----------------------------------------------------------------------------


def start_prefill(port: int, tokens: int, requests: int, *options: str, cwd: str) -> Any:
    """A prefill engine in its own process (``run_prefill``); its READY line lists the
    requests' kv_transfer_params, its RESULT line what it still holds when done."""
    from kvshare_connector.common.child_process import Child

    args = ["-m", "lab.tools.engine_sim", "prefill", "--port", str(port)]
    args += ["--tokens", str(tokens), "--requests", str(requests), *options]
    return Child(args, cwd=cwd)


def run_prefill(args: argparse.Namespace) -> None:
    extra: dict[str, Any] = {"kv_lease_duration": args.lease_s}
    if args.lmcache_url:
        extra.update(lmcache_extra(args.lmcache_url))
    engine = Engine(args.model, args.layout, "kv_producer", args.port, extra)
    results: dict[str, Any] = {}
    for i in range(args.requests):
        rid = f"p{i}"
        engine.add(rid, args.tokens + 37 * i, 1, {"do_remote_decode": True}, i)
    engine.run_until(lambda: len(engine.outputs) == args.requests)
    for rid, out in engine.outputs.items():
        results[rid] = {"kv_transfer_params": out.kv_transfer_params, "tokens": out.new_token_ids}
    report(
        READY,
        {
            "requests": results,
            "owners": len(engine.topology.owners),
            "regions": len(engine.topology.regions),
        },
    )
    # Keep stepping: blocks are freed when decode has read them or the lease ends.
    pool = engine.scheduler.kv_cache_manager.block_pool
    source = getattr(engine.worker.worker.backend, "source", None)  # LMCache: none
    deadline = time.monotonic() + args.lease_s + 20
    while source is not None and time.monotonic() < deadline:
        engine.step()
        if not source.held:
            break
        time.sleep(0.01)
    report(
        RESULT,
        {
            "held": sorted(source.held) if source is not None else [],
            "free_blocks": pool.get_num_free_blocks(),
            "total_blocks": pool.num_gpu_blocks - 1,  # minus the null block
            "stats": engine.stats,
        },
    )
    time.sleep(args.linger_s)
    engine.close()


def lmcache_extra(url: str) -> dict[str, Any]:
    """kv_connector_extra_config of the LMCache backend through an ``lm://`` server."""
    return {
        "backend": "lmcache",
        "lmcache": {"remote_url": url, "max_local_cpu_size_gb": 0.05, "load_timeout_s": 10.0},
    }


def decode_requests(engine: Engine, prefill: dict[str, Any], tokens: int) -> dict[str, Any]:
    """Send each prefilled request to decode with its kv_transfer_params; run to the end."""
    for rid, info in sorted(prefill.items()):
        i = int(rid[1:])  # the prompt prefill computed for request p<i>: same length and seed
        engine.add("d" + rid[1:], tokens + 37 * i, 3, info["kv_transfer_params"], i)
    wanted = {"d" + rid[1:] for rid in prefill}
    engine.run_until(lambda: wanted <= set(engine.outputs))
    report = {}
    for rid in prefill:
        did = "d" + rid[1:]
        report[did] = {
            "tokens": engine.outputs[did].new_token_ids,
            "kv_transfer_params": engine.outputs[did].kv_transfer_params,
        }
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["prefill"])
    parser.add_argument("--model", default="g4tiny")
    parser.add_argument("--layout", default="per_layer")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--lease-s", type=float, default=30.0)
    parser.add_argument("--linger-s", type=float, default=1.0)
    parser.add_argument("--lmcache-url", help="use the LMCache backend through this server")
    args = parser.parse_args(argv)
    run_prefill(args)


if __name__ == "__main__":
    sys.exit(main())
