"""A prefill process for the LMCache backend tests: fill a request's blocks, store it.

``python -m tests.support.lmcache_peer --url lm://127.0.0.1:PORT --model g4tiny --layout per_layer
--tokens 600 --first 5 --seed 11`` builds vLLM's KV memory on CPU, writes the kvcheck
pattern into the request's blocks, stores it through ``LMCacheStore`` (vLLM's tables:
sliding-window blocks before the window already dropped), waits until the server holds
every key and prints one ``LMC_STORED {json}`` line.
"""

from __future__ import annotations

import argparse

from .lmcache_util import quiet_lmcache

STORED = "LMC_STORED "


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", default="g4tiny")
    parser.add_argument("--layout", default="per_layer")
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--first", type=int, default=5)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    quiet_lmcache()

    from kvshare_connector.backends.lmcache.store import LMCacheStore
    from kvshare_connector.common.child_process import report
    from kvshare_connector.demo import kvcheck

    from .lmcache_util import build, config, drop_outside_windows, full_tables, prompt

    stack, topology, tensors = build(args.model, args.layout)
    tables = full_tables(topology, args.tokens, args.seed)
    kvcheck.fill(stack.kv_caches, topology, tables)
    backend = LMCacheStore(config(args.url), topology, tensors, args.model, engine_id="peer")
    try:
        receipt = backend.store(
            "peer-0",
            prompt(args.tokens, args.first),
            drop_outside_windows(topology, tables, args.tokens),
        )
        backend.wait_stored(receipt)
    finally:
        backend.close()
    info = {"tokens": receipt.num_tokens, "bytes": receipt.nbytes, "keys": len(receipt.keys)}
    report(STORED, info)


if __name__ == "__main__":
    main()
