#!/usr/bin/env python3
"""GPU proof that PD moves KV byte for byte under tensor parallelism (issue 16).

``kv_exact``'s check with TP engines: a prefill ``vllm.LLM`` with ``tensor_parallel_size``
P and a decode one with D, both KVShareConnector through
``lab.tools.kv_probe.KVProbeTPConnector`` (random-init real weights, four token-id
prompts longer than the sliding window). Every TP rank digests every (layer, KV head,
block) under the head's global index; decode's digest of each head it holds must equal the
one of the prefill rank that head was read from (replicated heads: decode rank d reads
prefill rank d % P, as ``layout.sharding`` picks); sharers through their target. A second
batch loaded with block ids rotated is the negative control: it must mismatch.

Cells (``--cells``; default the first four): ``e2b/tp2-tp2`` and ``kv4/tp2-tp2`` run both
engines TP2 on the same two GPUs (``--mem`` each, default 0.4); ``*/tp2-tp1`` run decode
on GPU 1 alone; ``*/tp1-tp2`` prefill on GPU 0 alone. ``e2b`` is the E2B shape (1 KV head:
every rank holds it), ``kv4`` the same with 4 KV heads (split: 2 per rank of TP2).

    python -m lab.gpu_checks.kv_exact_tp run --out OUT [--cells NAME ...]
    python -m lab.gpu_checks.kv_exact_tp report OUT

Writes OUT/<cell>/{prefill,decode}.r<rank>.jsonl and logs, OUT/results.json,
OUT/summary.md and OUT/logs.tar.gz (``kv_exact.finish``); exits 1 when a check
mismatches or a negative control does not. Reuses ``kv_exact``'s orchestration and
batches, and ``engines``' generation.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from lab.gpu_checks import kv_exact as kx
from lab.gpu_checks.cells import cell_dir, cell_env, read_json, read_jsonl, write_json
from lab.gpu_checks.processes import fresh_work_dir, start

E2B, KV4 = "gemma4_e2b_shape", "gemma4_e2b_kv4"
CELLS: dict[str, dict[str, Any]] = {
    "e2b/tp2-tp2": {"model": E2B, "prefill_tp": 2, "decode_tp": 2},
    "e2b/tp2-tp1": {"model": E2B, "prefill_tp": 2, "decode_tp": 1},
    "kv4/tp2-tp2": {"model": KV4, "prefill_tp": 2, "decode_tp": 2},
    "kv4/tp2-tp1": {"model": KV4, "prefill_tp": 2, "decode_tp": 1},
    "e2b/tp1-tp2": {"model": E2B, "prefill_tp": 1, "decode_tp": 2},
    "kv4/tp1-tp2": {"model": KV4, "prefill_tp": 1, "decode_tp": 2},
}
DEFAULT_CELLS = list(CELLS)[:4]


def devices(tp: int, role: str) -> str:
    """TP2: GPUs 0 and 1 (both engines share them); TP1: prefill GPU 0, decode GPU 1."""
    if tp == 2:
        return "0,1"
    return "0" if role == "prefill" else "1"


# ---- one engine per process (its TP workers are vLLM's own child processes) --------------


def engine_main(args: argparse.Namespace) -> None:
    from lab.gpu_checks.engines import start_engine

    weights, cell = Path(args.weights), CELLS[args.cell]
    vocab = read_json(weights / "config.json")["vocab_size"]
    tp = cell["prefill_tp"] if args.role == "prefill" else cell["decode_tp"]
    extra = {
        "kv_lease_duration": args.hold_s,
        "transfer_timeout_s": 120,
        "kv_probe": {"out": str(Path(args.work) / f"{args.role}.jsonl"), "scramble": False},
    }
    kv_config = kx.probe_config("KVProbeTPConnector", args.role, extra)
    llm, startup = start_engine(
        weights, args, kv_config, load_format="auto", max_model_len=4096, jit_monitor=False,
        tp=tp,
    )  # fmt: skip
    kx.run_batches(llm, args, vocab, kx.BATCHES, {"startup_s": startup, "tp": tp})


# ---- orchestration ------------------------------------------------------------------------


def run_cell(name: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    cell = CELLS[name]
    work = fresh_work_dir(cell_dir(Path(args.out), name), kx.STALE)
    weights = kx.ensure_weights(cell["model"], args)
    env = {**cell_env(cell), "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    procs = {}
    t0 = time.monotonic()
    for i, role in enumerate(("prefill", "decode")):
        tp = cell[f"{role}_tp"]
        cmd = kx.engine_cmd("lab.gpu_checks.kv_exact_tp", role, name, work, weights, args.timeout)
        cmd += ["--mem", str(args.mem), "--lock", str(Path(args.out) / "gpus.lock")]
        role_env = {**env, "CUDA_VISIBLE_DEVICES": devices(tp, role)}
        # prefill rank r serves on port + r; decode's (unused) ports stay clear of them
        role_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port + 10 * i)
        role_env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        procs[role] = start(cmd, work / f"{role}.log", role_env)
    result = {"cell": name, **cell, **kx.stop_engines(procs, work, args.timeout, (30, 90))}
    result["wall_s"] = round(time.monotonic() - t0, 1)
    result.update(check_cell(work, cell))
    write_json(work / "cell.json", result)
    return result


# ---- the checks ---------------------------------------------------------------------------


def _ranks(work: Path, side: str, tp: int) -> list[dict[str, list[dict[str, Any]]]]:
    """Per rank: request id -> that rank's records of it."""
    out = []
    for rank in range(tp):
        by_id: dict[str, list[dict[str, Any]]] = {}
        for record in read_jsonl(work / f"{side}.r{rank}.jsonl"):
            by_id.setdefault(record["request_id"], []).append(record)
        out.append(by_id)
    return out


def check_cell(work: Path, cell: dict[str, Any]) -> dict[str, Any]:
    """Each decode rank's record of each request against prefill's ranks, merged with the
    rank that decode rank reads replicated heads from first; summed per request."""
    from lab.tools.kv_digests import compare, merge_ranks

    p_tp, d_tp = cell["prefill_tp"], cell["decode_tp"]
    prefill, decode = _ranks(work, "prefill", p_tp), _ranks(work, "decode", d_tp)
    requests, problems, replica_mismatches = [], [], 0
    for request_id in sorted(set().union(*decode)):
        per_rank = [decode[d].get(request_id, [None])[-1] for d in range(d_tp)]
        kind = "control" if any(r and r.get("scrambled") for r in per_rank) else "main"
        if any(r is None or "failed" in r for r in per_rank):
            why = [r.get("failed") if r else "no record" for r in per_rank]
            problems.append(f"{kind} {request_id}: load failed on a rank: {why}")
            continue
        total: dict[str, Any] = {"batch": kind, "request_id": request_id, "locations": []}
        decode_keys: set[str] = set()
        for d, record in enumerate(per_rank):
            order = [(d + k) % p_tp for k in range(p_tp)]  # decode rank d reads d % P first
            sources = [prefill[p].get(record["remote_request_id"], [None])[-1] for p in order]
            if any(s is None for s in sources):
                problems.append(f"{kind} {request_id}: a prefill rank has no digests")
                break
            merged = merge_ranks(sources)
            replica_mismatches += merged["replica_mismatches"]
            result = compare(merged, record)
            decode_keys |= set(record["digests"])
            for key in ("blocks_compared", "bytes_compared", "mismatches", "sharers_checked",
                        "sharer_mismatches"):  # fmt: skip
                total[key] = total.get(key, 0) + result[key]
            total["locations"] += [f"rank {d}: {x}" for x in result["locations"]]
            total.setdefault("problems", []).extend(result["problems"])
            total.setdefault("groups_without_blocks", []).extend(result["groups_without_blocks"])
            missing = {k: v for k, v in result["sharers_missing"].items() if v}
            total.setdefault("sharers_missing", {}).update(missing)
            total["num_tokens"] = result["num_tokens"]
        else:
            every = set(merge_ranks([prefill[p][per_rank[0]["remote_request_id"]][-1]
                                     for p in range(p_tp)])["digests"])  # fmt: skip
            if decode_keys != every:
                total["problems"].append(
                    f"decode ranks hold {len(decode_keys)} (layer, head) digests, prefill "
                    f"{len(every)}: every head must be on some decode rank"
                )
            requests.append(total)
    decoded = read_json(work / "decode.result.json")
    problems += kx.batch_problems(requests, decoded, kx.BATCHES)
    problems += kx.request_problems(requests)
    return {
        "requests": requests,
        "problems": problems,
        "replica_mismatches": replica_mismatches,  # informational: replicas computed apart
        **kx.outputs_of(decoded),
    }


def cmd_run(args: argparse.Namespace) -> int:
    return kx.run_each(args.cells or DEFAULT_CELLS, run_cell, args, 22000, 40)


def cmd_report(out: Path) -> int:
    results = []
    for path in sorted(out.glob("*/cell.json")):
        result = read_json(path)
        if result["cell"] in CELLS and result.get("rc_prefill") is not None:
            result.update(check_cell(path.parent, CELLS[result["cell"]]))
        results.append(result)
    return kx.finish(out, results)


def main() -> None:
    parser, run, _ = kx.command_line(__doc__, CELLS)
    run.add_argument("--mem", type=float, default=0.4, help="gpu_memory_utilization per engine")
    kx.dispatch(parser.parse_args(), cmd_run, engine_main, cmd_report)


if __name__ == "__main__":
    main()
