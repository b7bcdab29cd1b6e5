"""Bytes a decode load reads for a prompt that shares a prefix with one decode loaded before
(issue 50), with each KV cache group's own prefix hit (``vllm/prefix_hits.py``) and with
vLLM's single hit for every group (what decode had before), against a prompt with no hit.

CPU only: vLLM's real Scheduler on both engines (``lab/tools/prefix_sim.py``), prefill in a
process of its own, real NIXL between them; the bytes are the read log's, every load checked
byte for byte. Deterministic (no timing): one run is the measurement.

    .venv/bin/python -m lab.benchmarks.bench_prefix_bytes [--model gemma4_e2b_shape]
        [--tokens 1000] [--shared 768] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("per-group hits", "one hit (before)")
PROMPTS = ("first", "shared", "none")


def prompts_of(tokens: int, shared: int) -> dict[str, list[int]]:
    """first; shared: first's start and a tail of its own; none: nothing in common."""
    from lab.tools.prefix_sim import tokens as ids

    first = ids(0, tokens)
    return {
        "first": first,
        "shared": first[:shared] + ids(5, tokens)[shared:],
        "none": ids(9, tokens),
    }


def decode_engines(model: str, work: Path, kv_mib: int) -> list[Any]:
    """One decode per variant, both made before any request (engine_sim's first-block hash);
    the second without per-group hits (vLLM's single hit)."""
    from kvshare_connector.toolkit.procs import pick_free_port
    from kvshare_connector.vllm import prefix_hits
    from lab.tools.prefix_sim import PrefixEngine

    install, engines = prefix_hits.install, []
    try:
        for v in range(len(VARIANTS)):
            prefix_hits.install = install if v == 0 else (lambda *_: False)
            extra = {"read_log": str(work / f"reads{v}.jsonl")}
            port = pick_free_port()
            engines.append(
                PrefixEngine(model, "per_layer", "kv_consumer", port, extra, kv_bytes=kv_mib << 20)
            )
    finally:
        prefix_hits.install = install
    return engines


def measure(model: str, tokens: int, shared: int, kv_mib: int) -> list[dict[str, Any]]:
    from kvshare_connector.toolkit.procs import pick_free_port
    from lab.tools.engine_sim import READY
    from lab.tools.prefix_sim import start_prefill

    prompts = prompts_of(tokens, shared)
    work = Path(tempfile.mkdtemp())
    served = {f"{v}/{name}": prompts[name] for v in range(len(VARIANTS)) for name in PROMPTS}
    (work / "prompts.json").write_text(json.dumps(served))
    options = ("--model", model, "--kv-mib", str(kv_mib))
    child = start_prefill(pick_free_port(), str(work / "prompts.json"), *options, cwd=str(ROOT))
    engines: list[Any] = []
    try:
        ready = child.wait_json(READY, 300)["requests"]
        engines = decode_engines(model, work, kv_mib)
        rows = []
        for v, engine in enumerate(engines):
            for name in PROMPTS:
                rid = f"{v}/{name}"
                engine.add_prompt(rid, prompts[name], 2, dict(ready[rid]["kv_transfer_params"]))
                engine.run_until(lambda rid=rid, e=engine: rid in e.outputs, 120)
                assert engine.loaded.get(rid) == [], (rid, engine.loaded.get(rid))  # byte-exact
            rows += rows_of(v, work / f"reads{v}.jsonl")
        return rows
    finally:
        for engine in engines:
            engine.close()
        child.kill()


def rows_of(variant: int, log: Path) -> list[dict[str, Any]]:
    reads = {r["request_id"]: r for r in map(json.loads, log.read_text().splitlines())}
    none = reads[f"{variant}/none"]["bytes"]
    keys = ("tokens_hit", "tokens_loaded", "blocks", "bytes")
    return [
        {"variant": VARIANTS[variant], "prompt": name,
         **{k: reads[f"{variant}/{name}"][k] for k in keys},
         "of_no_hit": round(reads[f"{variant}/{name}"]["bytes"] / none, 3)}
        for name in PROMPTS
    ]  # fmt: skip


def table(rows: list[dict[str, Any]], model: str, tokens: int, shared: int) -> str:
    lines = [
        f"{model}, {tokens}-token prompts; 'shared' starts with 'first''s {shared} tokens "
        "(decode loaded 'first' before it); 'none' shares nothing",
        "",
        "| decode's hit | prompt | tokens hit | tokens loaded | blocks | bytes | of no hit |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['prompt']} | {r['tokens_hit']} | {r['tokens_loaded']} "
            f"| {r['blocks']} | {r['bytes']:,} | {r['of_no_hit']:.3f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default="gemma4_e2b_shape")
    parser.add_argument("--tokens", type=int, default=1000, help="engine_sim's limit: 1024")
    parser.add_argument("--shared", type=int, default=768)
    parser.add_argument("--kv-mib", type=int, default=256)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = measure(args.model, args.tokens, args.shared, args.kv_mib)
    print(table(rows, args.model, args.tokens, args.shared))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
