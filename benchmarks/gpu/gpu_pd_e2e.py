#!/usr/bin/env python3
"""GPU end-to-end: prefill/decode with a KV connector vs a colocated baseline, real vLLM.

Each cell starts a prefill and a decode ``vllm.LLM`` in two processes on one GPU (tiny
Gemma-4 with dummy weights, token-id prompts of 40..900 tokens), decodes greedily with
the KV read from prefill, and compares generated tokens with a colocated engine.
Negative control per cell: the same prompts decoded with the remote block ids reversed
per group must come out different. Timings: decode-side wall time of the first batch
(handshake included) and of later batches.

    python benchmarks/gpu/gpu_pd_e2e.py run --out OUT [--cells NAME ...] [--parallel N]
    python benchmarks/gpu/gpu_pd_e2e.py report OUT [OUT ...]      # merge results into tables

Needs a CUDA GPU with vLLM 0.26 (+ NIXL, kvcached for the kvcached cells).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from driver_processes import (
    fresh_work_dir,
    started,
    stop_started_processes,
    stop_with_the_driver,
    triton_cache_entries,
    wait,
)
from gpu_pd_e2e_report import report

ROOT = Path(__file__).resolve().parents[2]
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


def cell_env(cell: dict[str, Any]) -> dict[str, str]:
    env = {
        "VLLM_USE_V2_MODEL_RUNNER": "1" if cell.get("runner") == "v2" else "0",
        "ENABLE_KVCACHED": "true" if cell.get("kvcached") else "false",
    }
    if cell.get("kvcached"):
        env["KVCACHED_CONTIGUOUS_LAYOUT"] = "true" if cell["kvcached"] == "contiguous" else "false"
    return env


def model_dir(model: str, root: Path) -> Path:
    from kvshare_connector.devtools.cpu_stack import model_dir as write_model

    return write_model(model, root)


def prompts(batch: str) -> list[list[int]]:
    """Token-id prompts; each batch has its own tokens so no prefix cache hits across."""
    import random

    rng = random.Random(f"kvshare-{batch}")
    return [[rng.randrange(3, 4000) for _ in range(n)] for n in PROMPT_LENS]


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
            kv_config["kv_connector_module_path"] = "kvshare_connector.devtools.negative_control"
    return kv_config


def start_engine(
    path: Path,
    args: argparse.Namespace,
    kv_config: dict | None,
    load_format: str = "dummy",
    max_model_len: int = 2048,
    jit_monitor: bool = True,
) -> tuple[Any, float]:
    """One engine (dummy weights unless told otherwise) started while holding ``args.lock``;
    returns it and its startup seconds (lock wait excluded)."""
    from vllm import LLM

    from kvshare_connector.devtools.cpu_stack import hf_overrides_for

    overrides = hf_overrides_for(path / "config.json")
    if (
        overrides.get("global_head_dim")
        == json.loads((path / "config.json").read_text())["head_dim"]
    ):
        overrides = {}
    start = time.perf_counter()
    # One engine starts at a time: vLLM's memory profiling reads the GPU's free memory,
    # which another engine allocating at the same moment would distort.
    with open(Path(args.lock), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waited = time.perf_counter() - start
        llm = LLM(
            model=str(path),
            load_format=load_format,
            skip_tokenizer_init=True,
            enforce_eager=True,
            gpu_memory_utilization=args.mem,
            max_model_len=max_model_len,
            max_num_seqs=8,
            seed=0,
            hf_overrides=overrides,
            kv_transfer_config=kv_config,
            # Mixed head sizes make vLLM pick FA4 (CuTe DSL, not in this stack): use Triton.
            attention_backend="TRITON_ATTN" if overrides else None,
            jit_monitor_verbose=jit_monitor,  # every kernel (re)compiled, with its time
        )
        fcntl.flock(lock, fcntl.LOCK_UN)
    return llm, time.perf_counter() - start - waited


def generate(llm: Any, batch: str, params: list[dict] | None, max_tokens: int) -> dict[str, Any]:
    """One batch of the cell's prompts, greedy; tokens, logprobs, timings, returned params."""
    window_start = time.time()  # wall clock, as in the connector's read_log
    out = generate_tokens(llm, prompts(batch), params, max_tokens)
    return {**out, "window": [window_start, time.time()]}


def generate_tokens(
    llm: Any, token_prompts: list[list[int]], params: list[dict] | None, max_tokens: int
) -> dict[str, Any]:
    """Greedy generation of token-id prompts, each with its kv_transfer_params (or none)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    greedy = {"temperature": 0.0, "logprobs": 1, "detokenize": False, "ignore_eos": True}
    sampling = []
    for i in range(len(token_prompts)):
        extra = {"kv_transfer_params": params[i]} if params and params[i] else None
        sampling.append(SamplingParams(max_tokens=max_tokens, extra_args=extra, **greedy))
    t0 = time.perf_counter()
    results = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in token_prompts], sampling, use_tqdm=False
    )
    return {
        "seconds": time.perf_counter() - t0,
        "tokens": [list(r.outputs[0].token_ids) for r in results],
        "logprobs": [
            [
                lp[t].logprob
                for lp, t in zip(r.outputs[0].logprobs, r.outputs[0].token_ids, strict=True)
            ]
            for r in results
        ],
        "kv_transfer_params": [r.kv_transfer_params for r in results],
    }


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
        _write(work / "prefill.json", {"batches": produced, "startup_s": startup})
        deadline = time.monotonic() + args.hold_s
        while time.monotonic() < deadline and not (work / "stop").exists():
            time.sleep(0.2)
        out["held_s"] = time.monotonic() - (deadline - args.hold_s)
    else:  # decode
        deadline = time.monotonic() + args.hold_s
        while not (work / "prefill.json").exists():
            if time.monotonic() > deadline:
                raise TimeoutError("prefill never produced its kv_transfer_params")
            time.sleep(0.2)
        produced = json.loads((work / "prefill.json").read_text())["batches"]
        for batch in ["main"] + [f"steady{i}" for i in range(STEADY_REPEATS)]:
            out[batch] = generate(llm, batch, produced[batch]["kv_transfer_params"], MAX_TOKENS)
        if cell.get("connector") != "LMCacheConnectorV1":  # theirs: nothing of ours to skip
            params = corrupted(cell, produced["corrupt"]["kv_transfer_params"])
            out["corrupt"] = generate(llm, "corrupt", params, MAX_TOKENS)
        (work / "stop").touch()
    _write(work / f"{args.role}.result.json", out)


def _write(path: Path, data: Any) -> None:
    """JSON the other engine or the driver polls for: it appears whole."""
    from kvshare_connector.common.files import write_atomic

    write_atomic(path, json.dumps(data))


# ---- orchestration ------------------------------------------------------------------------


def spawn(
    role: str,
    work: Path,
    log: Path,
    env: dict[str, str],
    cell: str | None,
    model: str | None,
    port: int,
    mem: float,
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        __file__,
        "engine",
        "--role",
        role,
        "--work",
        str(work),
        "--mem",
        str(mem),
        "--lock",
        str(work.parent / "startup.lock"),
    ]
    cmd += ["--cell", cell] if cell else ["--model", model or ""]
    full_env = {
        **os.environ,
        **env,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "PYTHONUNBUFFERED": "1",
        # The repo root: the package, and devtools.negative_control for LMCache cells.
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    # Own process group per engine: kvcached names its IPC segments after it.
    return started(
        subprocess.Popen(
            cmd,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=ROOT,
            start_new_session=True,
        )
    )


def run_cell(name: str, out: Path, port: int, mem: float, timeout_s: float) -> dict[str, Any]:
    cell = CELLS[name]
    work = fresh_work_dir(out / name.replace("/", "__").replace(":", "_"))
    env = cell_env(cell)
    server = None
    if cell.get("backend") == "lmcache":  # an lm:// server between the two engines
        lm_port = port + 5
        server = started(
            subprocess.Popen(
                [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(lm_port), "cpu"],
                stdout=(work / "lmcache_server.log").open("w"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        env.update(
            KVSHARE_LMCACHE_URL=f"lm://127.0.0.1:{lm_port}",
            PYTHONHASHSEED="0",
            LMCACHE_TRACK_USAGE="false",
            # LMCacheConnectorV1 reads its configuration from these (ours ignores them).
            LMCACHE_REMOTE_URL=f"lm://127.0.0.1:{lm_port}",
            LMCACHE_REMOTE_SERDE="naive",
            LMCACHE_CHUNK_SIZE="256",
            LMCACHE_LOCAL_CPU="True",
            LMCACHE_MAX_LOCAL_CPU_SIZE="2",
        )
        env.update(cell.get("lmcache_env", {}))
        from kvshare_connector.common.child_process import wait_for_port

        try:  # engines that start before it would miss it: wait until it listens
            wait_for_port("127.0.0.1", lm_port, 60, alive=lambda: server.poll() is None)
        except (RuntimeError, TimeoutError):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, 9)
            raise
    t0 = time.monotonic()
    kernels_before = triton_cache_entries()
    prefill = spawn("prefill", work, work / "prefill.log", env, name, None, port, mem)
    decode = spawn("decode", work, work / "decode.log", env, name, None, port + 1, mem)
    deadline = time.monotonic() + timeout_s
    while decode.poll() is None and time.monotonic() < deadline:
        if prefill.poll() not in (None, 0):  # prefill died: decode would wait in vain
            break
        time.sleep(0.5)
    rc_d = wait(decode, 1)
    (work / "stop").touch()
    rc_p = wait(prefill, 60)
    if server is not None:
        os.killpg(server.pid, 9)
    result: dict[str, Any] = {
        "cell": name,
        **cell,
        "rc_prefill": rc_p,
        "rc_decode": rc_d,
        "wall_s": time.monotonic() - t0,
        "triton_kernels_compiled": triton_cache_entries() - kernels_before,
    }
    for role in ("prefill", "decode"):
        path = work / f"{role}.result.json"
        if path.exists():
            result[role] = json.loads(path.read_text())
        log = (work / f"{role}.log").read_text(errors="replace")
        result[f"{role}_registration"] = [
            line.strip()[-400:]
            for line in log.splitlines()
            if ("KVShareConnector" in line and ("registered" in line or "handed to" in line))
            or ("nixl" in line.lower() and "regist" in line.lower())
        ][:3]
        result[f"{role}_lmcache_hits"] = [
            line.strip()[-200:] for line in log.splitlines() if "LMCache hit tokens" in line
        ][-12:]
        result[f"{role}_errors"] = [
            line.strip()[-300:] for line in log.splitlines() if "Error" in line or "error" in line
        ][-5:]
    _write(work / "cell.json", result)
    return result


def run_alone(
    work: Path, env: dict[str, str], model_name: str, mem: float, timeout_s: float, **labels: Any
) -> dict:
    """One engine without a connector (colocated prefill and decode) in ``work``: its
    batches, rc and the Triton kernels it compiled, also written to work/baseline.json."""
    fresh_work_dir(work)
    kernels_before = triton_cache_entries()
    proc = spawn("baseline", work, work / "baseline.log", env, None, model_name, 0, mem)
    rc = wait(proc, timeout_s)
    result = {
        **labels,
        "rc": rc,
        "triton_kernels_compiled": triton_cache_entries() - kernels_before,
    }
    path = work / "baseline.result.json"
    if path.exists():
        result.update(json.loads(path.read_text()))
    _write(work / "baseline.json", result)
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
