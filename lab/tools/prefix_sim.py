"""``engine_sim`` with prefix caching as a causal model makes it: prompts that share a prefix
share the KV of its blocks, and a prefix-cache hit keeps the blocks that hold it.

``PrefixEngine``'s emulated forward writes, for the tokens a step computes, a pattern keyed
by each block's position and the prompt's tokens up to that block's end (``block_seeds``), so
two prompts with a common prefix have the same KV there on any engine, as a real model's
causal attention gives. It writes only the blocks of the tokens computed in the step, never
a prefix-cache hit's. An engine's ``salt`` stands for whose computation a block holds:
decode's own blocks (computed there, or loaded and then kept in its prefix cache) carry its
salt, prefill's copy carries the source salt (0), so a load that writes into a block decode
already had shows as decode's blocks holding prefill's pattern (``check_loaded``).

Prefill in a process of its own, prompts from a JSON file (``{request id: token ids}``,
computed one after another so later ones hit earlier ones' blocks):
``python -m lab.tools.prefix_sim --port P --prompts FILE``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvshare_connector.common.child_process import report
from kvshare_connector.demo import kvcheck
from lab.tools.engine_sim import READY, RESULT, Engine

SOURCE_SALT = 0  # prefill's computation


def tokens(seed: int, n: int) -> list[int]:
    """``n`` token ids of prompt ``seed`` (engine_sim's prompts: other seeds, other ids)."""
    return [(seed * 7919 + i * 31) % 4000 + 3 for i in range(n)]


def block_seeds(prompt: Sequence[int], block_size: int, positions: range, salt: int) -> list[int]:
    """The pattern seed of each block position: the prompt's tokens up to the block's end
    (the last block: the prompt's end), and whose computation it is (``salt``)."""
    out = []
    for position in positions:
        end = min((position + 1) * block_size, len(prompt))
        crc = zlib.crc32(json.dumps(list(prompt[:end])).encode())
        out.append((crc ^ (salt * 0x9E3779B1)) % 1_000_003)
    return out


class PrefixEngine(Engine):
    """``Engine`` whose forward writes causal KV for the tokens each step computes."""

    def __init__(self, *args: Any, salt: int = SOURCE_SALT, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.salt = salt
        self.computed_from: dict[str, int] = {}  # request -> first token its forward computed
        self.hit_blocks: dict[str, list[int]] = {}  # loaded request -> hit blocks per group
        self.read_blocks: dict[str, list[int]] = {}  # loaded request -> loaded blocks per group
        self._scheduled: dict[str, int] = {}  # this step's tokens per request
        schedule = self.scheduler.schedule

        def scheduled() -> Any:
            out = schedule()
            self._scheduled = dict(out.num_scheduled_tokens)
            return out

        self.scheduler.schedule = scheduled  # type: ignore[method-assign]
        # the scheduler side's stats (decode's prefix hits), which vLLM drains each step
        self.scheduler_stats: list[dict] = []
        connector = self.scheduler.connector
        take = connector.get_kv_connector_stats

        def taken() -> Any:
            stats = take()
            if stats is not None:
                self.scheduler_stats.append(stats.reduce())
            return stats

        connector.get_kv_connector_stats = taken  # type: ignore[method-assign]

    def add_prompt(
        self, request_id: str, prompt: Sequence[int], max_tokens: int, params: dict | None
    ) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sampling = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args={"kv_transfer_params": params} if params is not None else None,
        )
        request = Request(
            request_id, list(prompt), sampling, None, block_hasher=self.scheduler.block_hasher
        )
        self.scheduler.add_request(request)

    def _forward_prefill(self, req_id: str, twin: str | None = None) -> None:
        """The blocks of the tokens from the request's computed ones (its hit, or where a
        failed load left it) to its prompt's end; a hit's blocks are left alone."""
        request = self.scheduler.requests[req_id]
        # vLLM counts a step's tokens as computed when it schedules them
        start = request.num_computed_tokens - self._scheduled[req_id]
        self.computed_from[req_id] = start
        prompt = list(request.prompt_token_ids)
        table = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        blocks, firsts = [], []
        for group, ids in zip(self.topology.groups, table, strict=True):
            first = start // group.spec.block_size
            listed = list(ids)[first : math.ceil(len(prompt) / group.spec.block_size)]
            while listed and not listed[0]:  # null: a position the window has left
                listed, first = listed[1:], first + 1
            blocks.append(listed)
            firsts.append(first)
        self._fill(prompt, blocks, firsts, [[self.salt] * len(b) for b in blocks])
        self.written[req_id] = blocks

    def check_loaded(self, req_id: str) -> list[str]:
        """Every kept block of the loaded prompt: a prefix-cache hit's blocks (in decode's
        cache before the load: hashed) must hold decode's own KV, the blocks allocated for
        the load prefill's. The loaded blocks then become decode's own (its salt)."""
        request = self.scheduler.requests[req_id]
        loaded = request.num_computed_tokens
        prompt = list(request.prompt_token_ids)[:loaded]
        table = self.scheduler.kv_cache_manager.get_blocks(req_id).blocks
        blocks, firsts, salts, hits, reads = [], [], [], [], []
        for group, group_blocks in zip(self.topology.groups, table, strict=True):
            kept = list(group_blocks)[: math.ceil(loaded / group.spec.block_size)]
            first = next((i for i, b in enumerate(kept) if not b.is_null), len(kept))
            kept = kept[first:]
            own = [b.block_hash is not None for b in kept]
            blocks.append([b.block_id for b in kept])
            firsts.append(first)
            salts.append([self.salt if o else SOURCE_SALT for o in own])
            hits.append(sum(own))
            reads.append(len(own) - sum(own))
        self.hit_blocks[req_id], self.read_blocks[req_id] = hits, reads
        problems = self._mismatches(prompt, blocks, firsts, salts, loaded)
        # what was loaded is decode's own now: a later load writing into it shows
        self._fill(prompt, blocks, firsts, [[self.salt] * len(b) for b in blocks])
        return problems

    def _seeds(
        self, prompt: Sequence[int], firsts: list[int], salts: list[list[int]]
    ) -> list[list[int]]:
        return [
            [
                block_seeds(prompt, group.spec.block_size, range(first + i, first + i + 1), s)[0]
                for i, s in enumerate(group_salts)
            ]
            for group, first, group_salts in zip(self.topology.groups, firsts, salts, strict=True)
        ]

    def _fill(
        self,
        prompt: Sequence[int],
        blocks: list[list[int]],
        firsts: list[int],
        salts: list[list[int]],
    ) -> None:
        seeds = self._seeds(prompt, firsts, salts)
        kvcheck.fill(
            self.stack.kv_caches, self.topology, blocks, seeds=seeds, first_positions=firsts
        )

    def _mismatches(
        self,
        prompt: Sequence[int],
        blocks: list[list[int]],
        firsts: list[int],
        salts: list[list[int]],
        num_tokens: int,
    ) -> list[str]:
        seeds = self._seeds(prompt, firsts, salts)
        found = kvcheck.mismatches(
            self.stack.kv_caches, self.topology, blocks, seeds=seeds, first_positions=firsts,
            num_tokens=num_tokens,
        )  # fmt: skip
        return found


# ---- prefill in its own process ---------------------------------------------------------


def start_prefill(port: int, prompts_file: str, *options: str, cwd: str) -> Any:
    """A prefill engine serving the prompts of ``prompts_file`` in its own process."""
    from kvshare_connector.common.child_process import Child

    args = ["-m", "lab.tools.prefix_sim", "--port", str(port)]
    return Child([*args, "--prompts", prompts_file, *options], cwd=cwd)


def serve_prompts(args: argparse.Namespace) -> None:
    """Compute each prompt in turn (a later one hits an earlier one's blocks), report their
    kv_transfer_params and prefix hits (READY), step until decode has read them all or their
    lease ended, report what is still held (RESULT)."""
    extra: dict[str, Any] = {"kv_lease_duration": args.lease_s}
    kv = {"kv_bytes": int(args.kv_mib) << 20}
    engine = PrefixEngine(args.model, args.layout, "kv_producer", args.port, extra, **kv)
    prompts: dict[str, list[int]] = json.loads(Path(args.prompts).read_text())
    results: dict[str, Any] = {}
    for rid, prompt in prompts.items():
        engine.add_prompt(rid, prompt, 1, {"do_remote_decode": True})
        engine.run_until(lambda rid=rid: rid in engine.outputs)
        results[rid] = {
            "kv_transfer_params": engine.outputs[rid].kv_transfer_params,
            "hit_tokens": engine.computed_from[rid],  # prefill's own prefix-cache hit
        }
    report(READY, {"requests": results, "owners": len(engine.topology.owners)})
    pool = engine.scheduler.kv_cache_manager.block_pool
    source = engine.worker.worker.backend.source
    deadline = time.monotonic() + args.lease_s + 20
    while time.monotonic() < deadline:
        engine.step()
        if not source.held:
            break
        time.sleep(0.01)
    report(
        RESULT,
        {
            "held": sorted(source.held),
            # freed at their lease's end, not by decode (a read's done, or a release)
            "expired_leases": sum(s["expired_leases"] for s in engine.stats),
            "free_blocks": pool.get_num_free_blocks(),
            "total_blocks": pool.num_gpu_blocks - 1,
        },
    )
    time.sleep(args.linger_s)
    engine.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="g4tiny")
    parser.add_argument("--layout", default="per_layer")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prompts", required=True, help="JSON: {request id: token ids}")
    parser.add_argument("--lease-s", type=float, default=60.0)
    parser.add_argument("--kv-mib", type=float, default=32, help="the KV pool")
    parser.add_argument("--linger-s", type=float, default=1.0)
    serve_prompts(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
