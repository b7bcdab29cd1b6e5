#!/usr/bin/env python3
"""GPU end-to-end: prefill/decode with a KV connector vs a colocated baseline, real vLLM.

Each cell starts a prefill and a decode ``vllm.LLM`` in two processes on one GPU (tiny
Gemma-4 with dummy weights, token-id prompts of 40..900 tokens), decodes greedily with
the KV read from prefill, and compares generated tokens with a colocated engine.
Negative control per cell: the same prompts decoded with the remote block ids reversed
per group must come out different. Timings: decode-side wall time of the first batch
(handshake included) and of later batches.

    python -m lab.gpu_checks.gpu_pd_e2e run --out OUT [--cells NAME ...] [--parallel N]
    python -m lab.gpu_checks.gpu_pd_e2e report OUT [OUT ...]      # merge results into tables

Needs a CUDA GPU with vLLM 0.26 (+ NIXL, kvcached for the kvcached cells).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lab.gpu_checks.cells import (
    cell_dir,
    cell_env,
    prefill_output,
    read_json,
    serve_until_stopped,
    token_prompts,
    write_json,
)
from lab.gpu_checks.engines import generate_tokens, start_engine
from lab.gpu_checks.gpu_pd_e2e_report import report
from lab.gpu_checks.processes import (
    fresh_work_dir,
    module_cmd,
    start,
    start_lmcache_server,
    stop,
    stop_started_processes,
    stop_with_the_driver,
    triton_cache_entries,
    wait_for_decode,
)

PROMPT_LENS = (40, 257, 611, 900)
MAX_TOKENS = 24
STEADY_REPEATS = 8

# name: (model, connector, kvcached mode, runner, layout preference)
CELLS: dict[str, dict[str, Any]] = {
    "g4tiny/plain": {"model": "g4tiny"},
    "g4tiny/kvcached-per-layer": {"model": "g4tiny", "kvcached": "per_layer"},
    "g4tiny/kvcached-contiguous": {"model": "g4tiny", "kvcached": "contiguous"},
    "g4uniform/cross-layer": {"model": "g4uniform"},
    "g4uniform/kvcached-per-layer": {"model": "g4uniform", "kvcached": "per_layer"},
    "g4uniform/kvcached-contiguous": {"model": "g4uniform", "kvcached": "contiguous"},
    "g4tiny/v2-runner": {"model": "g4tiny", "runner": "v2"},
    "lmcache:g4tiny/plain": {"model": "g4tiny", "backend": "lmcache"},
    "lmcache:g4uniform/cross-layer": {"model": "g4uniform", "backend": "lmcache"},
    # LMCache's own connector on the same models, through the same lm:// server: does it
    # load at all with sharing layers / HMA / kvcached? (its log's "LMCache hit tokens")
    "lmcache-native:g4tiny/plain": {
        "model": "g4tiny",
        "connector": "LMCacheConnectorV1",
        "backend": "lmcache",
    },
    "lmcache-native:g4uniform/plain": {
        "model": "g4uniform",
        "connector": "LMCacheConnectorV1",
        "backend": "lmcache",
    },
    "lmcache-native:g4tiny/kvcached-per-layer": {
        "model": "g4tiny",
        "connector": "LMCacheConnectorV1",
        "backend": "lmcache",
        "kvcached": "per_layer",
    },
    "lmcache-native:g4uniform/kvcached-per-layer": {
        "model": "g4uniform",
        "connector": "LMCacheConnectorV1",
        "backend": "lmcache",
        "kvcached": "per_layer",
    },
    # The last partial chunk stored too, so decode loads the whole prompt (as ours does) and
    # recomputes no suffix: tells a load that is wrong from a suffix recompute that differs.
    "lmcache-native:g4uniform/unfull-chunks": {
        "model": "g4uniform",
        "connector": "LMCacheConnectorV1",
        "backend": "lmcache",
        "lmcache_env": {"LMCACHE_SAVE_UNFULL_CHUNK": "True"},
    },
    "nixl:g4tiny/plain": {"model": "g4tiny", "connector": "NixlConnector"},
    "nixl:g4tiny/kvcached-per-layer": {
        "model": "g4tiny",
        "connector": "NixlConnector",
        "kvcached": "per_layer",
    },
    "nixl:g4tiny/kvcached-contiguous": {
        "model": "g4tiny",
        "connector": "NixlConnector",
        "kvcached": "contiguous",
    },
}
MATRIX = [c for c in CELLS if ":" not in c]


def model_dir(model: str, root: Path) -> Path:
    from kvshare_connector.demo.cpu_stack import model_dir as write_model

    return write_model(model, root)


def prompts(batch: str) -> list[list[int]]:
    """Token-id prompts; each batch has its own tokens so no prefix cache hits across."""
    return token_prompts(f"kvshare-{batch}", PROMPT_LENS, 4000)


# ---- one engine per process -----------------------------------------------------------------


def kv_transfer_config(cell: dict[str, Any], role: str, work: Path) -> dict[str, Any] | None:
    """The connector settings of one engine of a cell (None: the colocated baseline)."""
    if role not in ("prefill", "decode"):
        return None
    kv_config: dict[str, Any] = {
        "kv_connector": cell.get("connector", "KVShareConnector"),
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_connector_extra_config": {"kv_lease_duration": 300},
    }
    ours = kv_config["kv_connector"] == "KVShareConnector"
    if role == "decode" and ours:
        # READ time per request; vLLM's offline engine drops connector stats of steps
        # with no request output, which is where finished reads land.
        kv_config["kv_connector_extra_config"]["read_log"] = str(work / "reads.jsonl")
    if ours:
        # The module-path form: works where the package is on PYTHONPATH, not installed.
        kv_config["kv_connector_module_path"] = "kvshare_connector"
    if cell.get("backend") == "lmcache" and ours:
        kv_config["kv_connector_extra_config"].update(
            backend="lmcache",
            lmcache={"remote_url": os.environ["KVSHARE_LMCACHE_URL"], "load_timeout_s": 30},
        )
        if role == "decode":
            # Loads go by the prompt's tokens (no block ids to point elsewhere): the
            # negative control skips them instead, through this pass-through subclass.
            kv_config["kv_connector"] = "LoadSkippingConnector"
            kv_config["kv_connector_module_path"] = "lab.tools.negative_control"
    return kv_config


def generate(llm: Any, batch: str, params: list[dict] | None, max_tokens: int) -> dict[str, Any]:
    """One batch of the cell's prompts, greedy; tokens, logprobs, timings, returned params."""
    window_start = time.time()  # wall clock, as in the connector's read_log
    out = generate_tokens(llm, prompts(batch), params, max_tokens)
    return {**out, "window": [window_start, time.time()]}


def corrupted(cell: dict[str, Any], produced: list[dict]) -> list[dict]:
    """Negative control: read the wrong blocks, or (LMCache) skip the load."""
    out = []
    for params in produced:
        params = dict(params)
        if cell.get("backend") == "lmcache":
            params["kvshare_test_skip_load"] = True
        else:
            params["remote_block_ids"] = [list(reversed(i)) for i in params["remote_block_ids"]]
        out.append(params)
    return out


def engine_main(args: argparse.Namespace) -> None:
    work = Path(args.work)
    cell = CELLS[args.cell] if args.cell else {"model": args.model}
    llm, startup = start_engine(
        model_dir(cell["model"], work), args, kv_transfer_config(cell, args.role, work)
    )
    batches = ["main", "corrupt"] + [f"steady{i}" for i in range(STEADY_REPEATS)]
    out: dict[str, Any] = {"startup_s": startup, "pid": os.getpid()}
    if args.role == "baseline":  # every batch: the steady ones time a colocated engine
        for batch in batches:
            out[batch] = generate(llm, batch, None, MAX_TOKENS)
    elif args.role == "prefill":
        remote_decode = [{"do_remote_decode": True}] * len(PROMPT_LENS)
        produced = {batch: generate(llm, batch, remote_decode, 1) for batch in batches}
        write_json(work / "prefill.json", {"batches": produced, "startup_s": startup})
        out["held_s"] = serve_until_stopped(work, args.hold_s)
    else:  # decode
        produced = prefill_output(work, args.hold_s)["batches"]
        for batch in ["main"] + [f"steady{i}" for i in range(STEADY_REPEATS)]:
            out[batch] = generate(llm, batch, produced[batch]["kv_transfer_params"], MAX_TOKENS)
        if cell.get("connector") != "LMCacheConnectorV1":  # theirs: nothing of ours to skip
            params = corrupted(cell, produced["corrupt"]["kv_transfer_params"])
            out["corrupt"] = generate(llm, "corrupt", params, MAX_TOKENS)
        (work / "stop").touch()
    write_json(work / f"{args.role}.result.json", out)


# ---- orchestration ------------------------------------------------------------------------


def spawn(
    role: str,
    work: Path,
    env: dict[str, str],
    cell: str | None,
    model: str | None,
    port: int,
    mem: float,
) -> subprocess.Popen:
    """One engine of a cell (``cell``) or a baseline (``model``), logging to work/<role>.log."""
    cmd = module_cmd("lab.gpu_checks.gpu_pd_e2e", "engine", "--role", role, "--work", str(work))
    cmd += ["--mem", str(mem), "--lock", str(work.parent / "startup.lock")]
    cmd += ["--cell", cell] if cell else ["--model", model or ""]
    side_channel = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}
    side_channel["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    return start(cmd, work / f"{role}.log", {**env, **side_channel})


def lmcache_env(port: int) -> dict[str, str]:
    """Both engines' settings for the lm:// server on ``port``."""
    return {
        "KVSHARE_LMCACHE_URL": f"lm://127.0.0.1:{port}",
        "PYTHONHASHSEED": "0",
        "LMCACHE_TRACK_USAGE": "false",
        # LMCacheConnectorV1 reads its configuration from these (ours ignores them).
        "LMCACHE_REMOTE_URL": f"lm://127.0.0.1:{port}",
        "LMCACHE_REMOTE_SERDE": "naive",
        "LMCACHE_CHUNK_SIZE": "256",
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "2",
    }


def run_cell(name: str, out: Path, port: int, mem: float, timeout_s: float) -> dict[str, Any]:
    cell = CELLS[name]
    work = fresh_work_dir(cell_dir(out, name))
    env = cell_env(cell)
    server = None
    if cell.get("backend") == "lmcache":  # an lm:// server between the two engines
        server = start_lmcache_server(port + 5, work / "lmcache_server.log")
        env.update(lmcache_env(port + 5), **cell.get("lmcache_env", {}))
    t0 = time.monotonic()
    kernels_before = triton_cache_entries()
    prefill = spawn("prefill", work, env, name, None, port, mem)
    decode = spawn("decode", work, env, name, None, port + 1, mem)
    wait_for_decode(prefill, decode, timeout_s)
    rc_d = stop(decode, 1)
    (work / "stop").touch()
    rc_p = stop(prefill, 60)
    if server is not None:
        stop(server)
    result: dict[str, Any] = {
        "cell": name,
        **cell,
        "rc_prefill": rc_p,
        "rc_decode": rc_d,
        "wall_s": time.monotonic() - t0,
        "triton_kernels_compiled": triton_cache_entries() - kernels_before,
    }
    for role in ("prefill", "decode"):
        if (work / f"{role}.result.json").exists():
            result[role] = read_json(work / f"{role}.result.json")
        result.update(log_findings(role, (work / f"{role}.log").read_text(errors="replace")))
    write_json(work / "cell.json", result)
    return result


def log_findings(role: str, log: str) -> dict[str, list[str]]:
    """What an engine's log says of registration, LMCache hits and errors (for the report)."""
    lines = log.splitlines()
    registration = [
        line.strip()[-400:]
        for line in lines
        if ("KVShareConnector" in line and ("registered" in line or "handed to" in line))
        or ("nixl" in line.lower() and "regist" in line.lower())
    ]
    hits = [line.strip()[-200:] for line in lines if "LMCache hit tokens" in line]
    errors = [line.strip()[-300:] for line in lines if "Error" in line or "error" in line]
    return {
        f"{role}_registration": registration[:3],
        f"{role}_lmcache_hits": hits[-12:],
        f"{role}_errors": errors[-5:],
    }


def run_alone(
    work: Path, env: dict[str, str], model_name: str, mem: float, timeout_s: float, **labels: Any
) -> dict:
    """One engine without a connector (colocated prefill and decode) in ``work``: its
    batches, rc and the Triton kernels it compiled, also written to work/baseline.json."""
    fresh_work_dir(work)
    kernels_before = triton_cache_entries()
    proc = spawn("baseline", work, env, None, model_name, 0, mem)
    rc = stop(proc, timeout_s)
    result = {
        **labels,
        "rc": rc,
        "triton_kernels_compiled": triton_cache_entries() - kernels_before,
    }
    result.update(read_json(work / "baseline.result.json"))
    write_json(work / "baseline.json", result)
    return result


def run_baseline(model: str, runner: str, out: Path, mem: float, timeout_s: float) -> dict:
    work = out / f"baseline__{model}__{runner}"
    env = cell_env({"runner": runner})
    return run_alone(work, env, model, mem, timeout_s, model=model, runner=runner)


def cmd_run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = args.cells or MATRIX
    needed = sorted({(CELLS[c]["model"], CELLS[c].get("runner", "v1")) for c in cells})
    jobs = [("baseline", m, r) for m, r in needed] if not args.no_baseline else []
    jobs += [("cell", c, None) for c in cells]
    port = 20000
    pool = ThreadPoolExecutor(max_workers=args.parallel)
    futures = []
    for i, (kind, a, b) in enumerate(jobs):
        if kind == "baseline":
            futures.append(pool.submit(run_baseline, a, b, out, args.mem, args.timeout))
        else:
            futures.append(pool.submit(run_cell, a, out, port + 10 * i, args.mem, args.timeout))
    try:
        for future in futures:
            result = future.result()
            print(
                "done:",
                result.get("cell") or f"baseline {result['model']} {result['runner']}",
                "rc",
                result.get("rc", (result.get("rc_prefill"), result.get("rc_decode"))),
                flush=True,
            )
    except BaseException:  # a job failed: the rest would run on, unreported
        pool.shutdown(wait=False, cancel_futures=True)
        stop_started_processes()
        raise
    pool.shutdown()
    print(report([out]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--out", required=True)
    run.add_argument("--cells", nargs="*", choices=list(CELLS))
    run.add_argument("--parallel", type=int, default=1)
    run.add_argument("--mem", type=float, default=0.08)
    run.add_argument("--timeout", type=float, default=420)
    run.add_argument("--no-baseline", action="store_true")
    engine = sub.add_parser("engine")
    engine.add_argument("--role", choices=["prefill", "decode", "baseline"], required=True)
    engine.add_argument("--work", required=True)
    engine.add_argument("--cell")
    engine.add_argument("--model")
    engine.add_argument("--mem", type=float, default=0.08)
    engine.add_argument("--hold-s", type=float, default=400)
    engine.add_argument("--lock", required=True)
    rep = sub.add_parser("report")
    rep.add_argument("dirs", nargs="+")
    args = parser.parse_args()
    if args.command == "run":
        stop_with_the_driver()
        cmd_run(args)
    elif args.command == "engine":
        engine_main(args)
    else:
        print(report([Path(d) for d in args.dirs]))


if __name__ == "__main__":
    main()
