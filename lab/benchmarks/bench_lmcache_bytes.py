"""Bytes LMCache stores per token: kvshare's LMCache backend vs LMCache's LMCacheConnectorV1.

For each Gemma-4 shaped model, on vLLM's real KV objects (``cpu_stack``, CPU only):

* theirs: ``LMCacheConnectorV1``'s memory objects ``[2, L, T, H*D]`` with L, H, D from
  vLLM's model config (every layer, sharers included, one head size for all layers);
* ours, per token: the width of the stored rows (owner layers only, each at its own
  head size);
* ours, measured: the bytes of the memory objects a real ``LMCacheEngine`` allocated for
  one prompt of ``--tokens`` tokens, divided by the tokens (sliding-window groups are
  stored only from their window, so long prompts cost less than the row width).

    .venv/bin/python -m lab.benchmarks.bench_lmcache_bytes [--tokens 1000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

MODELS = ("gemma4_e2b_shape", "g4tiny", "g4uniform")


def measure(model: str, tokens: int) -> dict:
    from kvshare_connector.backends.lmcache.config import LMCacheBackendConfig
    from kvshare_connector.backends.lmcache.rows import (
        lmcache_v1_bytes_per_token,
        owner_bytes_per_token,
        streams_of,
    )
    from kvshare_connector.backends.lmcache.store import LMCacheStore
    from kvshare_connector.demo import kvcheck
    from kvshare_connector.demo.cpu_stack import build_cpu_stack
    from kvshare_connector.vllm import adapter as vllm_adapter

    stack = build_cpu_stack(model, "per_layer", kv_bytes=48 << 20, max_model_len=tokens + 64)
    topology = vllm_adapter.topology_from_kv_caches(
        stack.kv_cache_config, stack.kv_caches, stack.backends, stack.sharing
    )
    model_config, parallel = stack.vllm_config.model_config, stack.vllm_config.parallel_config
    layers = model_config.get_num_layers(parallel)
    theirs = lmcache_v1_bytes_per_token(model_config, parallel)
    config = LMCacheBackendConfig.from_extra_config(
        {"backend": "lmcache", "lmcache": {"max_local_cpu_size_gb": 0.25}}
    )
    backend = LMCacheStore(config, topology, stack.kv_caches, model, engine_id="bench")
    try:
        tables, start = [], 1
        for group in topology.groups:
            count = -(-tokens // group.spec.block_size)
            tables.append(list(range(start, start + count)))
            start += count
        kvcheck.fill(stack.kv_caches, topology, tables)
        receipt = backend.store("bench", list(range(1, tokens + 1)), tables)
    finally:
        backend.close()
    # Each alias at its target's real width: what a per-layer-correct copy of the whole
    # register_kv_caches dict would take (LMCache's connector stores every entry).
    all_entries = sum(
        2 * g.spec.num_kv_heads * g.spec.head_size * g.spec.itemsize
        for name in stack.kv_caches
        for g in topology.groups
        if topology.resolve(name) in g.layer_names
    )
    return {
        "model": model,
        "layers": layers,
        "owners": len(topology.owners),
        "sharers": len(topology.sharers),
        "groups": len(topology.groups),
        "lmcache_v1_kv_shape": [
            layers,
            2,
            config.chunk_size,
            model_config.get_num_kv_heads(parallel),
            model_config.get_head_size(),
        ],
        "lmcache_v1_bytes_per_token": theirs,
        "all_entries_bytes_per_token": all_entries,
        "ours_bytes_per_token": owner_bytes_per_token(topology),
        "ours_streams": {s.name: s.width for s in streams_of(topology)},
        "tokens": tokens,
        "ours_measured_bytes": receipt.nbytes,
        "ours_measured_bytes_per_token": receipt.nbytes / tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

    rows = []
    for model in args.models:
        started = time.perf_counter()
        rows.append(measure(model, args.tokens))
        rows[-1]["seconds"] = round(time.perf_counter() - started, 1)

    print(
        f"\n| model | layers (owners + sharers) | LMCacheConnectorV1 kv_shape | theirs B/token "
        f"| ours B/token (rows) | ratio | ours measured B/token @ {args.tokens} tokens |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['layers']} ({r['owners']} + {r['sharers']}) "
            f"| {tuple(r['lmcache_v1_kv_shape'])} | {r['lmcache_v1_bytes_per_token']:,} "
            f"| {r['ours_bytes_per_token']:,} {r['ours_streams']} "
            f"| {r['lmcache_v1_bytes_per_token'] / r['ours_bytes_per_token']:.2f}x "
            f"| {r['ours_measured_bytes_per_token']:,.0f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
