#!/usr/bin/env python3
"""GPU proof that PD moves KV byte for byte under tensor parallelism (issue 16).

``kv_exact.py``'s check with TP engines: a prefill ``vllm.LLM`` with ``tensor_parallel_size``
P and a decode one with D, both KVShareConnector through
``kvshare_connector.devtools.kv_probe.KVProbeTPConnector`` (random-init real weights, four token-id
prompts longer than the sliding window). Every TP rank digests every (layer, KV head,
block) under the head's global index; decode's digest of each head it holds must equal the
one of the prefill rank that head was read from (replicated heads: decode rank d reads
prefill rank d % P, as ``layout.sharding`` picks); sharers through their target. A second
batch loaded with block ids rotated is the negative control: it must mismatch.

Cells (``--cells``; default the first four): ``e2b/tp2-tp2`` and ``kv4/tp2-tp2`` run both
engines TP2 on the same two GPUs (``--mem`` each, default 0.4); ``*/tp2-tp1`` run decode
on GPU 1 alone; ``*/tp1-tp2`` prefill on GPU 0 alone. ``e2b`` is the E2B shape (1 KV head:
every rank holds it), ``kv4`` the same with 4 KV heads (split: 2 per rank of TP2).

    python benchmarks/gpu/kv_exact_tp.py run --out OUT [--cells NAME ...]
    python benchmarks/gpu/kv_exact_tp.py report OUT

Writes OUT/<cell>/{prefill,decode}.r<rank>.jsonl and logs, OUT/results.json,
OUT/summary.md and OUT/logs.tar.gz (``kv_exact.finish``); exits 1 when a check
mismatches or a negative control does not. Reuses ``kv_exact``'s orchestration and
``gpu_pd_e2e``'s generation (imported, unchanged).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import kv_exact as kx  # noqa: E402

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


def start_tp_engine(path: Path, args: argparse.Namespace, kv_config: dict, tp: int) -> Any:
    """``gpu_pd_e2e.start_engine``'s settings plus ``tensor_parallel_size``; one engine
    starts at a time (``args.lock``): vLLM sizes its KV from the GPUs' free memory."""
    from vllm import LLM

    from kvshare_connector.devtools.cpu_stack import hf_overrides_for

    config = json.loads((path / "config.json").read_text())
    overrides = hf_overrides_for(path / "config.json")
    if overrides.get("global_head_dim") == config["head_dim"]:
        overrides = {}
    with open(Path(args.lock), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        started = time.perf_counter()
        llm = LLM(
            model=str(path),
            load_format="auto",
            skip_tokenizer_init=True,
            enforce_eager=True,
            gpu_memory_utilization=args.mem,
            max_model_len=4096,
            max_num_seqs=8,
            seed=0,
            hf_overrides=overrides,
            kv_transfer_config=kv_config,
            attention_backend="TRITON_ATTN" if overrides else None,
            tensor_parallel_size=tp,
            distributed_executor_backend="mp" if tp > 1 else None,
        )
        fcntl.flock(lock, fcntl.LOCK_UN)
    return llm, time.perf_counter() - started


def engine_main(args: argparse.Namespace) -> None:
    from gpu_pd_e2e import generate_tokens

    work, weights = Path(args.work), Path(args.weights)
    cell = CELLS[args.cell]
    vocab = json.loads((weights / "config.json").read_text())["vocab_size"]
    tp = cell["prefill_tp"] if args.role == "prefill" else cell["decode_tp"]
    kv_config = {
        "kv_connector": "KVProbeTPConnector",
        "kv_connector_module_path": "kvshare_connector.devtools.kv_probe",
        "kv_role": "kv_producer" if args.role == "prefill" else "kv_consumer",
        "kv_connector_extra_config": {
            "kv_lease_duration": args.hold_s,
            "transfer_timeout_s": 120,
            "kv_probe": {"out": str(work / f"{args.role}.jsonl"), "scramble": False},
        },
    }
    llm, startup = start_tp_engine(weights, args, kv_config, tp)
    out: dict[str, Any] = {"startup_s": startup, "tp": tp}

    def run(batch: str, params: list[dict], max_tokens: int) -> dict[str, Any]:
        return generate_tokens(llm, kx.prompts(batch, vocab), params, max_tokens)

    if args.role == "prefill":
        for batch in kx.BATCHES:
            out[batch] = run(batch, [{"do_remote_decode": True}] * len(kx.PROMPT_LENS), 1)
        kx._write(work / "prefill.json", out)
        kx.serve_until_stopped(work, args.hold_s)
        return
    produced = kx.prefill_params(work, args.hold_s)
    out["main"] = run("main", produced["main"]["kv_transfer_params"], kx.MAX_TOKENS)
    scrambled = [
        {**p, "kvshare_probe_scramble": True} for p in produced["control"]["kv_transfer_params"]
    ]
    out["control"] = run("control", scrambled, kx.MAX_TOKENS)
    kx._write(work / "decode.result.json", out)
    (work / "stop").touch()


# ---- orchestration ------------------------------------------------------------------------


def run_cell(name: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    cell = CELLS[name]
    work = kx.cell_dir(Path(args.out), name)
    work.mkdir(parents=True, exist_ok=True)
    for stale in [*work.glob("*.jsonl"), *(work / n for n in ("stop", "prefill.json"))]:
        stale.unlink(missing_ok=True)
    (work / "decode.result.json").unlink(missing_ok=True)
    weights = kx.ensure_weights(cell["model"], args)
    env = {**kx.cell_env(cell), "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    procs = {}
    t0 = time.monotonic()
    for i, role in enumerate(("prefill", "decode")):
        tp = cell[f"{role}_tp"]
        cmd = [sys.executable, __file__, "engine", "--role", role, "--cell", name]
        cmd += ["--work", str(work), "--weights", str(weights), "--mem", str(args.mem)]
        cmd += ["--hold-s", str(args.timeout), "--lock", str(Path(args.out) / "gpus.lock")]
        role_env = {**env, "CUDA_VISIBLE_DEVICES": devices(tp, role)}
        # prefill rank r serves on port + r; decode's (unused) ports stay clear of them
        role_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port + 10 * i)
        role_env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        procs[role] = kx.start(cmd, work / f"{role}.log", role_env)
    deadline = time.monotonic() + args.timeout
    while procs["decode"].poll() is None and time.monotonic() < deadline:
        if procs["prefill"].poll() not in (None, 0):
            break  # prefill died: decode would wait in vain
        time.sleep(0.5)
    rc_decode = kx.stop(procs["decode"], 30)
    (work / "stop").touch()
    rc_prefill = kx.stop(procs["prefill"], 90)
    result = {"cell": name, **cell, "rc_prefill": rc_prefill, "rc_decode": rc_decode}
    result["wall_s"] = round(time.monotonic() - t0, 1)
    result.update(check_cell(work, cell))
    kx._write(work / "cell.json", result)
    return result


# ---- the checks ---------------------------------------------------------------------------


def _ranks(work: Path, side: str, tp: int) -> list[dict[str, list[dict[str, Any]]]]:
    """Per rank: request id -> that rank's records of it."""
    out = []
    for rank in range(tp):
        by_id: dict[str, list[dict[str, Any]]] = {}
        for record in kx._jsonl(work / f"{side}.r{rank}.jsonl"):
            by_id.setdefault(record["request_id"], []).append(record)
        out.append(by_id)
    return out


def check_cell(work: Path, cell: dict[str, Any]) -> dict[str, Any]:
    """Each decode rank's record of each request against prefill's ranks, merged with the
    rank that decode rank reads replicated heads from first; summed per request."""
    from kvshare_connector.devtools.kv_digests import compare, merge_ranks

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
    for kind in kx.BATCHES:
        got = sum(r["batch"] == kind for r in requests)
        if got != len(kx.PROMPT_LENS):
            problems.append(f"{kind}: {got} of {len(kx.PROMPT_LENS)} requests compared")
    result_path = work / "decode.result.json"
    decoded = json.loads(result_path.read_text()) if result_path.exists() else {}
    for kind in kx.BATCHES:
        for params in decoded.get(kind, {}).get("kv_transfer_params", []):
            if params and params.get("kv_load_error"):
                problems.append(f"{kind}: kv_load_error {params['kv_load_error']}")
    problems += kx.request_problems(requests)
    return {
        "requests": requests,
        "problems": problems,
        "replica_mismatches": replica_mismatches,  # informational: replicas computed apart
        "tokens": {k: decoded.get(k, {}).get("tokens") for k in kx.BATCHES},
        "logprobs": {k: decoded.get(k, {}).get("logprobs") for k in kx.BATCHES},
    }


def cmd_run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, kx._on_sigterm)
    results = []
    try:
        for i, name in enumerate(args.cells or DEFAULT_CELLS):
            try:
                results.append(run_cell(name, args, 22000 + 40 * i))
            except Exception as exc:  # one cell's failure is reported, the rest still run
                failed = {"cell": name, "rc_prefill": None, "rc_decode": None, "requests": []}
                failed["problems"] = [f"{type(exc).__name__}: {exc}"]
                results.append(failed)
                kx.cell_dir(out, name).mkdir(parents=True, exist_ok=True)
                kx._write(kx.cell_dir(out, name) / "cell.json", failed)
            print(f"done: {name}: {'PASS' if kx.passed(results[-1]) else 'FAIL'}", flush=True)
    finally:
        kx.stop_all()
    return kx.finish(out, results)


def cmd_report(out: Path) -> int:
    results = []
    for path in sorted(out.glob("*/cell.json")):
        result = json.loads(path.read_text())
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
