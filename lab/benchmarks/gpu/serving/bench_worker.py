#!/usr/bin/env python3
"""``vllm bench serve`` runs, one after another, in one long-lived process.

A fresh ``vllm bench serve`` imports vLLM and torch each time (10-40 s before the first
request, the larger part of a short timed run); this process pays that once. It reads one
JSON object per line on stdin, ``{"argv": [...], "log": PATH, "done": PATH}``, runs
vLLM's own benchmark entry point (``vllm.benchmarks.serve.main``, the code behind the CLI,
same arguments, same result JSON) with its prints going to ``log``, then writes
``{"rc": 0|1, "error": ...}`` to ``done``. ``--impl module:function`` swaps the benchmark
for a function taking the argv list (tests).

    python -m lab.benchmarks.gpu.serving.bench_worker [--impl MOD:FUNC] < requests.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path


def vllm_bench(argv: list[str]) -> None:
    """vLLM's ``bench serve``: its own parser and main, as the CLI calls them."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    main(parser.parse_args(argv))


def load_impl(spec: str | None) -> Callable[[list[str]], object]:
    if not spec:
        return vllm_bench
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def serve(impl: Callable[[list[str]], object]) -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        rc, error = 0, None
        with (
            open(job["log"], "a") as log,
            contextlib.redirect_stdout(log),
            contextlib.redirect_stderr(log),
        ):
            try:
                impl(list(job["argv"]))
            except BaseException as exc:  # a failed run must not end the worker
                if isinstance(exc, KeyboardInterrupt):
                    raise
                rc, error = 1, f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
        tmp = Path(job["done"] + ".tmp")
        tmp.write_text(json.dumps({"rc": rc, "error": error, "pid": os.getpid()}))
        tmp.rename(job["done"])  # the parent polls for it: it must appear whole


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", default=None)
    args = parser.parse_args()
    impl = load_impl(args.impl)
    if impl is vllm_bench:  # import now, before the first job's clock starts
        import vllm.benchmarks.serve  # noqa: F401
    print(f"bench worker ready (pid {os.getpid()})", flush=True)
    serve(impl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
