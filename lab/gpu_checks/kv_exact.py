#!/usr/bin/env python3
"""GPU proof that PD moves KV byte for byte: decode's KV equals prefill's, for every owner
layer and KV cache group, and sharing layers read their target's bytes.

Each cell runs a prefill ``vllm.LLM`` on GPU 0 and a decode one on GPU 1 (``--gpus 1``: both
on GPU 0) with ``lab.tools.kv_probe.KVProbeConnector``: random-init real weights, four
token-id prompts longer than the sliding window. Prefill digests each request's blocks when
it holds them for decode (LMCache: when it stores them); decode digests its blocks when the
load finished, before any forward. A second batch, loaded with each group's block ids
rotated (``kvshare_probe_scramble``), is the negative control: it must mismatch.

``--verify`` turns the connector's ``verify_kv`` on (NIXL cells): every main and control
load must be verified (decode's read_log), a third batch whose first block is
overwritten after the READ (``kvshare_probe_tamper``) must fail its load with a
VerificationError, and a fourth whose ``remote_block_ids`` are rotated per group (what a
proxy that reorders lists sends; ``kvshare_probe_reorder``) must be refused by prefill's
claim check, computed by decode itself, and then hold prefill's KV (digested once finished).
``--outputs CELL`` also runs a colocated engine (no connector) on GPU 0
beside that cell, for ``kv_outputs``: decode's outputs against the engine's own noise.
``--prefix`` adds two batches whose prompts start as the main batch's (``prefix_batches``):
loads past decode's own prefix hit, byte for byte and with fewer bytes, and their control.
Every engine keeps vLLM's prefix caching (on by default); batches share no prefix otherwise.

    python -m lab.gpu_checks.kv_exact run --out OUT [--cells NAME ...] [--gpus 2] \
        [--verify] [--prefix] [--outputs e2b/plain]
    python -m lab.gpu_checks.kv_exact report OUT

Writes OUT/<cell>/{prefill,decode}.jsonl and logs, OUT/results.json, OUT/summary.md and
OUT/logs.tar.gz; exits 1 when a check mismatches or a negative control does not.
"""

from __future__ import annotations

import argparse
import os
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lab.gpu_checks import kv_outputs, prefix_batches
from lab.gpu_checks.cells import (
    cell_dir,
    cell_env,
    prefill_output,
    read_json,
    read_jsonl,
    serve_until_stopped,
    token_prompts,
    write_json,
)
from lab.gpu_checks.processes import (
    fresh_work_dir,
    module_cmd,
    start,
    start_lmcache_server,
    stop,
    stop_started_processes,
    stop_with_the_driver,
    wait_for_decode,
)
from lab.gpu_checks.random_weights import DONE, weights_dir
from lab.tools.kv_digests import scrambled

PROMPT_LENS = (700, 1300, 2100, 3100)
MAX_TOKENS = 8
BATCHES = ("main", "control")
VERIFY_BATCHES = (*BATCHES, "tamper", "reorder")
E2B = "gemma4_e2b_shape"
CELLS: dict[str, dict[str, Any]] = {
    "e2b/plain": {"model": E2B},
    "g4uniform/cross-layer": {"model": "g4uniform"},
    "e2b/kvcached-per-layer": {"model": E2B, "kvcached": "per_layer"},
    "e2b/kvcached-contiguous": {"model": E2B, "kvcached": "contiguous"},
    "e2b/lmcache": {"model": E2B, "backend": "lmcache"},
}


def batches_of(cell: dict[str, Any]) -> tuple[str, ...]:
    batches = VERIFY_BATCHES if cell.get("verify") else BATCHES
    return (*batches, *prefix_batches.BATCHES) if cell.get("prefix") else batches


def prompts(batch: str, vocab: int) -> list[list[int]]:
    """Random token ids, own per batch (no prefix-cache hit between batches), but for the
    shared-prefix batches, which start as the main batch's."""
    if batch in prefix_batches.BATCHES:
        return prefix_batches.prompts(batch, prompts("main", vocab), vocab)
    return token_prompts(f"kv-exact-{batch}", PROMPT_LENS, vocab)


# ---- one engine per process -----------------------------------------------------------------


def engine_main(args: argparse.Namespace) -> None:
    from lab.gpu_checks.engines import engine_facts, start_engine

    work, weights = Path(args.work), Path(args.weights)
    cell = {**CELLS[args.cell], "verify": args.verify, "prefix": args.prefix}
    vocab = read_json(weights / "config.json")["vocab_size"]
    if args.role == "colocated":
        args.max_tokens = MAX_TOKENS
        kv_outputs.colocated_main(args, weights, lambda batch: prompts(batch, vocab))
        return
    extra: dict[str, Any] = {
        "kv_lease_duration": args.hold_s,
        "transfer_timeout_s": 120,
        "kv_probe": {"out": str(work / f"{args.role}.jsonl"), "scramble": False},
        "verify_kv": args.verify,
        "read_log": str(work / f"{args.role}.read_log.jsonl"),
    }
    if cell.get("backend") == "lmcache":
        url = os.environ["KVSHARE_LMCACHE_URL"]
        extra.update(backend="lmcache", lmcache={"remote_url": url, "load_timeout_s": 60})
    kv_config = probe_config("KVProbeConnector", args.role, extra)
    # Random-init real weights from the safetensors (not dummy ones: their logits are flat).
    llm, startup = start_engine(
        weights, args, kv_config, load_format="auto", max_model_len=4096, jit_monitor=False
    )
    run_batches(llm, args, vocab, batches_of(cell), {"startup_s": startup, **engine_facts(llm)})


def probe_config(connector: str, role: str, extra: dict[str, Any]) -> dict[str, Any]:
    """An engine's kv_transfer_config through one of lab.tools.kv_probe's connectors."""
    return {
        "kv_connector": connector,
        "kv_connector_module_path": "lab.tools.kv_probe",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_connector_extra_config": extra,
    }


def run_batches(
    llm: Any, args: argparse.Namespace, vocab: int, batches: tuple[str, ...], out: dict
) -> None:
    """Prefill: every batch, held for decode until it is done. Decode: the main batch as
    prefill produced it, the control scrambled, the tamper batch (if any) tampered."""
    from lab.gpu_checks.engines import generate_tokens

    work = Path(args.work)

    def run(batch: str, params: list[dict], max_tokens: int) -> dict[str, Any]:
        return generate_tokens(llm, prompts(batch, vocab), params, max_tokens)

    if args.role == "prefill":
        for batch in batches:
            out[batch] = run(batch, [{"do_remote_decode": True}] * len(PROMPT_LENS), 1)
        write_json(work / "prefill.json", out)
        serve_until_stopped(work, args.hold_s)
        return
    produced = prefill_output(work, args.hold_s)
    flags = {"main": None, "control": "kvshare_probe_scramble", "tamper": "kvshare_probe_tamper",
             "reorder": "kvshare_probe_reorder", "prefix": None,
             "prefix-control": "kvshare_probe_scramble"}  # fmt: skip
    for batch in batches:
        params = produced[batch]["kv_transfer_params"]
        if flags[batch]:
            params = [{**p, flags[batch]: True} for p in params]
        if batch == "reorder":  # what a proxy that reorders lists sends
            params = [{**p, "remote_block_ids": scrambled(p["remote_block_ids"])} for p in params]
        out[batch] = run(batch, params, MAX_TOKENS)
    if "reorder" in batches:  # a step after the last batch: the probe digests its blocks then
        generate_tokens(llm, [[1, 2, 3]], [None], 1)
    write_json(work / "decode.result.json", out)
    (work / "stop").touch()


# ---- orchestration ------------------------------------------------------------------------


def ensure_weights(model: str, args: argparse.Namespace) -> Path:
    target = weights_dir(model, Path(args.weights))
    if not (target / DONE).exists():
        log = Path(args.out) / f"weights-{model}.log"
        cmd = module_cmd("lab.gpu_checks.random_weights", "make", "--model", model)
        cmd += ["--dest", args.weights]
        rc = stop(start(cmd, log, {"CUDA_VISIBLE_DEVICES": "0"}), 1800)
        if rc != 0 or not (target / DONE).exists():
            raise RuntimeError(f"making weights for {model} failed (rc {rc}): see {log}")
    return target


def run_cell(name: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    # verify_kv is the NIXL backend's: LMCache cells run without it
    cell = {**CELLS[name], "verify": args.verify and CELLS[name].get("backend") != "lmcache"}
    cell["prefix"] = args.prefix and cell.get("backend") != "lmcache"  # read logs: NIXL
    work = fresh_work_dir(cell_dir(Path(args.out), name), STALE)
    weights = ensure_weights(cell["model"], args)
    env = cell_env(cell)
    server = None
    if cell.get("backend") == "lmcache":
        server = start_lmcache_server(port + 5, work / "lmcache_server.log")
        env.update(KVSHARE_LMCACHE_URL=f"lm://127.0.0.1:{port + 5}", PYTHONHASHSEED="0")
        env.update(LMCACHE_TRACK_USAGE="false", LMCACHE_LOG_LEVEL="WARNING")
    two = args.gpus >= 2
    mem = args.mem or (0.5 if two else 0.4)
    procs = {}
    t0 = time.monotonic()
    roles = ["prefill", "decode"] + (["colocated"] if args.outputs == name else [])
    for i, role in enumerate(roles):
        gpu = {"colocated": 0}.get(role, i) if two else 0
        cmd = engine_cmd("lab.gpu_checks.kv_exact", role, name, work, weights, args.timeout)
        cmd += ["--verify"] if cell["verify"] else []
        cmd += ["--prefix"] if cell["prefix"] else []
        # colocated: beside prefill on GPU 0, a smaller share
        cmd += ["--mem", str(min(mem, 0.3) if role == "colocated" else mem)]
        cmd += ["--lock", str(work / (f"gpu{gpu}.lock" if two else "gpu.lock"))]
        role_env = {**env, "CUDA_VISIBLE_DEVICES": str(gpu)}
        role_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port + i)
        role_env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        procs[role] = start(cmd, work / f"{role}.log", role_env)
    result = {"cell": name, **cell, **stop_engines(procs, work, args.timeout, (1, 60))}
    if "colocated" in procs:
        result["rc_colocated"] = stop(procs["colocated"], 120)
    if server is not None:
        stop(server)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    result.update(check_cell(work, cell))
    write_json(work / "cell.json", result)
    return result


# What a cell's engines leave besides processes.RUN_OUTPUTS: a rerun must not read them.
STALE = ("*.jsonl", "colocated.json")
REFUSED = "in their order"  # prefill's refusal of a claim naming its blocks reordered


def engine_cmd(
    module: str, role: str, cell: str, work: Path, weights: Path, hold_s: float
) -> list[str]:
    """The command line of one engine of a KV-exact cell (``--mem``, ``--lock`` to add)."""
    return module_cmd(
        module, "engine", "--role", role, "--cell", cell, "--work", str(work),
        "--weights", str(weights), "--hold-s", str(hold_s),
    )  # fmt: skip


def stop_engines(
    procs: dict[str, Any], work: Path, timeout_s: float, grace_s: tuple[float, float]
) -> dict[str, int]:
    """Decode's and prefill's exit codes: decode is waited for (until prefill dies or
    ``timeout_s``), then prefill is told to stop; each is killed after its grace seconds."""
    wait_for_decode(procs["prefill"], procs["decode"], timeout_s)
    rc_decode = stop(procs["decode"], grace_s[0])
    (work / "stop").touch()
    return {"rc_prefill": stop(procs["prefill"], grace_s[1]), "rc_decode": rc_decode}


# ---- the checks ---------------------------------------------------------------------------


def check_cell(work: Path, cell: dict[str, Any]) -> dict[str, Any]:
    """Every decode record against prefill's record of the same request."""
    from lab.tools.kv_digests import compare

    prefill = {r["request_id"]: r for r in read_jsonl(work / "prefill.jsonl")}
    decoded = read_jsonl(work / "decode.jsonl")
    requests, problems = [], []
    batches = batches_of(cell)
    batch_of = batches_by_request(read_json(work / "prefill.json"))
    tampered, reordered = [], []
    for record in decoded:
        kind = "control" if record.get("scrambled") else "main"
        kind = batch_of.get(record.get("remote_request_id"), kind)
        if record.get("reordered"):
            reordered.append(record)
            if record.get("at") == "recomputed":
                source = prefill.get(record["remote_request_id"])
                if source is None:
                    problems.append(f"reorder {record['request_id']}: no prefill digests")
                    continue
                requests.append({"batch": "reorder", **compare(source, record)})
            elif REFUSED not in record.get("failed", ""):
                problems.append(f"reorder {record['request_id']}: load was not refused")
            continue
        if record.get("tampered"):
            tampered.append(record)
            if "VerificationError" not in record.get("failed", ""):
                problems.append(f"tamper {record['request_id']}: load was not refused")
            continue
        if "failed" in record:
            problems.append(f"{kind} {record['request_id']}: load failed: {record['failed']}")
            continue
        source = prefill.get(record["remote_request_id"])
        if source is None:
            problems.append(f"{kind} {record['request_id']}: no prefill digests")
            continue
        result = compare(source, record, needed_only=cell.get("backend") == "lmcache")
        requests.append({"batch": kind, **result})
    decode = read_json(work / "decode.result.json")
    problems += batch_problems(requests, decode, batches)
    read_log = read_jsonl(work / "decode.read_log.jsonl")
    verified = [r for r in read_log if r.get("verified")]
    if cell.get("prefix"):
        problems += prefix_batches.problems(requests, read_log)
    refused = sum(REFUSED in r.get("failed", "") for r in reordered)
    if "reorder" in batches:
        recomputed = sum(r["batch"] == "reorder" for r in requests)
        if refused != len(PROMPT_LENS) or recomputed != len(PROMPT_LENS):
            problems.append(
                f"reorder: {refused} of {len(PROMPT_LENS)} loads refused, {recomputed} "
                "recomputed requests compared"
            )
    if "tamper" in batches:
        if len(tampered) != len(PROMPT_LENS):
            problems.append(f"tamper: {len(tampered)} of {len(PROMPT_LENS)} loads refused")
        loads = (len(batches) - 2) * len(PROMPT_LENS)  # every batch's but tamper's and reorder's
        if len(verified) != loads:
            problems.append(f"verify_kv: {len(verified)} of {loads} loads verified")
    problems += request_problems(requests)
    return {
        "requests": requests,
        "problems": problems,
        **outputs_of(decode),
        "vllm": decode.get("vllm"),
        "model_runner": decode.get("model_runner"),
        "verified_loads": len(verified),
        "verified_layer_blocks": sum(r["verified"] for r in verified),
        "tamper_refused": sum("VerificationError" in r.get("failed", "") for r in tampered),
        "reorder_refused": refused,
        "prefill_digest_s": sum(r.get("seconds", 0) for r in prefill.values()),
        "decode_digest_s": sum(r.get("seconds", 0) for r in decoded),
    }


def batches_by_request(prefill: dict[str, Any]) -> dict[str, str]:
    """Prefill's request id -> its batch, from the kv_transfer_params prefill handed over."""
    return {
        params["remote_request_id"]: batch
        for batch, out in prefill.items()
        if isinstance(out, dict)
        for params in out.get("kv_transfer_params") or ()
        if params and "remote_request_id" in params
    }


def batch_problems(
    requests: list[dict[str, Any]], decode: dict[str, Any], batches: tuple[str, ...]
) -> list[str]:
    """Every prompt of the main and control batches compared; no load error but in the
    tamper batch, where each load must fail verification."""
    problems = []
    for kind in (k for k in batches if k in (*BATCHES, *prefix_batches.BATCHES)):
        got = sum(r["batch"] == kind for r in requests)
        if got != len(PROMPT_LENS):
            problems.append(f"{kind}: {got} of {len(PROMPT_LENS)} requests compared")
    for kind in batches:
        out = decode.get(kind, {})
        tokens = out.get("tokens", [])
        for i, params in enumerate(out.get("kv_transfer_params", [])):
            error = (params or {}).get("kv_load_error")
            if kind == "reorder":
                if REFUSED not in (error or "") and error:
                    problems.append(f"reorder: kv_load_error {error}")
                continue
            if kind != "tamper" and error:
                problems.append(f"{kind}: kv_load_error {error}")
            elif kind == "tamper" and "VerificationError" not in (error or ""):
                # vLLM 0.33 under kv_load_failure_policy "fail" ends the request with no
                # output and no kv_transfer_params: refused too, if nothing was generated
                # (decode.jsonl's records must still name the VerificationError)
                generated = len(tokens[i]) if i < len(tokens) else 0
                if generated or error:
                    problems.append(
                        f"tamper: {generated} token(s) generated, no VerificationError "
                        f"returned ({error})"
                    )
    return problems


def outputs_of(decode: dict[str, Any]) -> dict[str, Any]:
    """Decode's generated tokens and logprobs per batch, for the record."""
    return {
        "tokens": {k: decode.get(k, {}).get("tokens") for k in BATCHES},
        "logprobs": {k: decode.get(k, {}).get("logprobs") for k in BATCHES},
    }


def request_problems(requests: list[dict[str, Any]]) -> list[str]:
    """What is wrong with each compared request: the main batch must match everywhere
    (every group compared, sharers checked), the negative control must mismatch."""
    problems = []
    for r in requests:
        bad = r["problems"] + [f"group {g} compared no block" for g in r["groups_without_blocks"]]
        if r["batch"] in ("main", "reorder", "prefix"):  # reorder: decode's own, computed again
            if r["mismatches"] or r["sharer_mismatches"] or not r["blocks_compared"]:
                bad.append(f"{r['mismatches']} block / {r['sharer_mismatches']} sharer mismatch")
            missing = r["sharers_missing"]
            if any(missing.values()) if isinstance(missing, dict) else missing:
                bad.append(f"sharers without a tensor to check: {missing}")
        elif r["mismatches"] == 0:
            bad.append("negative control found no mismatch")
        where = f" ({r['num_tokens']} tokens)" if "num_tokens" in r else ""
        problems += [f"{r['batch']} {r['request_id']}{where}: {b}" for b in bad]
    return problems


def passed(result: dict[str, Any]) -> bool:
    rcs = (result["rc_prefill"], result["rc_decode"], result.get("rc_colocated", 0))
    return rcs == (0, 0, 0) and not result["problems"]


def verify_column(res: dict[str, Any]) -> str:
    if not res.get("verify"):
        return "off"
    blocks, refused = res.get("verified_layer_blocks", 0), res.get("tamper_refused", 0)
    return f"{res.get('verified_loads', 0)} ({blocks:,} layer-blocks) / {refused}"


def outputs_table(out: Path, results: list[dict[str, Any]]) -> str:
    """Decode's outputs vs the colocated engine and its noise floor, where one ran."""
    compared = {}
    for res in results:
        work = cell_dir(out, res["cell"])
        if (work / "colocated.json").exists() and (work / "decode.result.json").exists():
            compared[res["cell"]] = kv_outputs.compare_outputs(
                read_json(work / "decode.result.json"), read_json(work / "colocated.json")
            )
    return "\n\n" + kv_outputs.table(compared) if compared else ""


def summary(results: list[dict[str, Any]]) -> str:
    lines = [
        "| cell | rc p/d | requests | layer-blocks compared | MiB compared | mismatches "
        "| sharer checks (bad) | control mismatches | first control locations "
        "| verify_kv: loads verified / tampered refused | vLLM, runner | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        main = [r for r in res["requests"] if r["batch"] == "main"]
        ctl = [r for r in res["requests"] if r["batch"] == "control"]
        sharers = sum(r["sharers_checked"] for r in res["requests"])
        bad_sharers = sum(r["sharer_mismatches"] for r in res["requests"])
        where = next((r["locations"][:2] for r in ctl if r["locations"]), [])
        lines.append(
            f"| {res['cell']} | {res['rc_prefill']}/{res['rc_decode']} | {len(main)}+{len(ctl)} "
            f"| {sum(r['blocks_compared'] for r in main):,} "
            f"| {sum(r['bytes_compared'] for r in main) / 2**20:.1f} "
            f"| {sum(r['mismatches'] for r in main)} | {sharers} ({bad_sharers}) "
            f"| {sum(r['mismatches'] for r in ctl)} | {'; '.join(where) or '-'} "
            f"| {verify_column(res)} | {res.get('vllm', '?')}, {res.get('model_runner', '?')} "
            f"| {'PASS' if passed(res) else 'FAIL'} |"
        )
    for res in results:
        for problem in res["problems"][:10]:
            lines.append(f"\n- {res['cell']}: {problem}")
    return "\n".join(lines)


def finish(out: Path, results: list[dict[str, Any]]) -> int:
    """results.json, summary.md and one archive of every cell's logs and digests."""
    write_json(out / "results.json", results)
    text = summary(results) + outputs_table(out, results)
    (out / "summary.md").write_text(text + "\n")
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for path in sorted(out.iterdir()):
            if path.is_dir() or path.name.endswith(".log"):
                tar.add(path, arcname=path.name)
    print(text)
    return 0 if results and all(passed(r) for r in results) else 1


def cmd_run(args: argparse.Namespace) -> int:
    return run_each(args.cells or list(CELLS), run_cell, args, 21000, 20)


def run_each(
    names: list[str],
    run: Callable[[str, argparse.Namespace, int], dict[str, Any]],
    args: argparse.Namespace,
    port: int,
    port_step: int,
) -> int:
    """Each cell in turn (its ports ``port_step`` above the last), a failed cell reported
    and the rest still run; every engine stopped with the driver; then ``finish``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stop_with_the_driver()
    results = []
    try:
        for i, name in enumerate(names):
            try:
                results.append(run(name, args, port + port_step * i))
            except Exception as exc:  # one cell's failure is reported, the rest still run
                failed = {"cell": name, "rc_prefill": None, "rc_decode": None, "requests": []}
                failed["problems"] = [f"{type(exc).__name__}: {exc}"]
                results.append(failed)
                cell_dir(out, name).mkdir(parents=True, exist_ok=True)
                write_json(cell_dir(out, name) / "cell.json", failed)
            print(f"done: {name}: {'PASS' if passed(results[-1]) else 'FAIL'}", flush=True)
    finally:
        stop_started_processes()
    return finish(out, results)


def cmd_report(out: Path) -> int:
    """Check every cell under ``out`` again from its digests (e.g. after changing the checks)."""
    results = []
    for path in sorted(out.glob("*/cell.json")):
        result = read_json(path)
        if "model" in result:
            flags = {k: result[k] for k in ("verify", "prefix") if k in result}
            cell = {**CELLS.get(result["cell"], result), **flags}  # as the run had it
            result.update(check_cell(path.parent, cell))
        results.append(result)
    return finish(out, results)


def command_line(
    doc: str, cells: dict[str, Any]
) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, argparse.ArgumentParser]:
    """The run / engine / report commands both KV-exact drivers share: (parser, run, engine)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--out", required=True)
    run.add_argument("--cells", nargs="*", choices=list(cells))
    run.add_argument("--weights", default="/tmp/kvshare-weights")
    run.add_argument("--timeout", type=float, default=900, help="per cell, seconds")
    engine = sub.add_parser("engine")
    for flag in ("--role", "--cell", "--work", "--weights", "--lock"):
        engine.add_argument(flag, required=True)
    engine.add_argument("--mem", type=float, required=True)
    engine.add_argument("--hold-s", type=float, default=900)
    sub.add_parser("report").add_argument("out")
    return parser, run, engine


def dispatch(args: argparse.Namespace, run: Any, engine: Any, report: Any) -> None:
    if args.command == "run":
        sys.exit(run(args))
    if args.command == "engine":
        engine(args)
        return
    sys.exit(report(Path(args.out)))


def main() -> None:
    parser, run, engine = command_line(__doc__, CELLS)
    run.add_argument("--gpus", type=int, default=2, choices=[1, 2])
    run.add_argument("--mem", type=float, help="gpu_memory_utilization per engine")
    run.add_argument("--verify", action="store_true", help="verify_kv on, plus a tamper batch")
    run.add_argument("--prefix", action="store_true", help="the shared-prefix batches too")
    run.add_argument("--outputs", help="run a colocated engine beside this cell")
    engine.add_argument("--verify", action="store_true")
    engine.add_argument("--prefix", action="store_true")
    dispatch(parser.parse_args(), cmd_run, engine_main, cmd_report)


if __name__ == "__main__":
    main()
