#!/usr/bin/env python3
"""GPU proof that PD moves KV byte for byte: decode's KV equals prefill's, for every owner
layer and KV cache group, and sharing layers read their target's bytes.

Each cell runs a prefill ``vllm.LLM`` on GPU 0 and a decode one on GPU 1 (``--gpus 1``: both
on GPU 0) with ``devtools.kv_probe.KVProbeConnector``: random-init real weights, four
token-id prompts longer than the sliding window. Prefill digests each request's blocks when
it holds them for decode (LMCache: when it stores them); decode digests its blocks when the
load finished, before any forward. A second batch, loaded with each group's block ids
rotated (``kvshare_probe_scramble``), is the negative control: it must mismatch.

``--verify`` turns the connector's ``verify_kv`` on (NIXL cells): every main and control
load must be verified (decode's read_log), and a third batch whose first block is
overwritten after the READ (``kvshare_probe_tamper``) must fail its load with a
VerificationError. ``--outputs CELL`` also runs a colocated engine (no connector) on GPU 0
beside that cell, for ``kv_outputs.py``: decode's outputs against the engine's own noise.

    python benchmarks/gpu/kv_exact.py run --out OUT [--cells NAME ...] [--gpus 2] \
        [--verify] [--outputs e2b/plain]
    python benchmarks/gpu/kv_exact.py report OUT

Writes OUT/<cell>/{prefill,decode}.jsonl and logs, OUT/results.json, OUT/summary.md and
OUT/logs.tar.gz; exits 1 when a check mismatches or a negative control does not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]  # package; random_weights
PROMPT_LENS = (700, 1300, 2100, 3100)
MAX_TOKENS = 8
BATCHES = ("main", "control")
VERIFY_BATCHES = (*BATCHES, "tamper")
E2B = "gemma4_e2b_shape"
CELLS: dict[str, dict[str, Any]] = {
    "e2b/plain": {"model": E2B},
    "g4uniform/cross-layer": {"model": "g4uniform"},
    "e2b/kvcached-per-layer": {"model": E2B, "kvcached": "per_layer"},
    "e2b/kvcached-contiguous": {"model": E2B, "kvcached": "contiguous"},
    "e2b/lmcache": {"model": E2B, "backend": "lmcache"},
}


def cell_dir(out: Path, name: str) -> Path:
    return out / name.replace("/", "__")


def batches_of(cell: dict[str, Any]) -> tuple[str, ...]:
    return VERIFY_BATCHES if cell.get("verify") else BATCHES


def cell_env(cell: dict[str, Any]) -> dict[str, str]:
    env = {"VLLM_USE_V2_MODEL_RUNNER": "0", "ENABLE_KVCACHED": "false"}
    if cell.get("kvcached"):
        env["ENABLE_KVCACHED"] = "true"
        env["KVCACHED_CONTIGUOUS_LAYOUT"] = str(cell["kvcached"] == "contiguous").lower()
    return env


def prompts(batch: str, vocab: int) -> list[list[int]]:
    """Random token ids, own per batch (no prefix-cache hit between batches)."""
    rng = random.Random(f"kv-exact-{batch}")
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


# ---- one engine per process -----------------------------------------------------------------


def engine_main(args: argparse.Namespace) -> None:
    # The same engine settings, start-up lock and greedy sampling as the e2e driver.
    from gpu_pd_e2e import generate_tokens, start_engine

    work, weights = Path(args.work), Path(args.weights)
    cell = {**CELLS[args.cell], "verify": args.verify}
    config = json.loads((weights / "config.json").read_text())
    if args.role == "colocated":
        from kv_outputs import colocated_main

        args.max_tokens = MAX_TOKENS
        colocated_main(args, weights, lambda batch: prompts(batch, config["vocab_size"]))
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
    kv_config = {
        "kv_connector": "KVProbeConnector",
        "kv_connector_module_path": "kvshare_connector.devtools.kv_probe",
        "kv_role": "kv_producer" if args.role == "prefill" else "kv_consumer",
        "kv_connector_extra_config": extra,
    }
    # Random-init real weights from the safetensors (not dummy ones: their logits are flat).
    llm, startup = start_engine(
        weights, args, kv_config, load_format="auto", max_model_len=4096, jit_monitor=False
    )
    out: dict[str, Any] = {"startup_s": startup}

    def run(batch: str, params: list[dict], max_tokens: int) -> dict[str, Any]:
        return generate_tokens(llm, prompts(batch, config["vocab_size"]), params, max_tokens)

    if args.role == "prefill":
        for batch in batches_of(cell):
            out[batch] = run(batch, [{"do_remote_decode": True}] * len(PROMPT_LENS), 1)
        _write(work / "prefill.json", out)
        serve_until_stopped(work, args.hold_s)
        return
    produced = prefill_params(work, args.hold_s)
    out["main"] = run("main", produced["main"]["kv_transfer_params"], MAX_TOKENS)
    scrambled = [
        {**p, "kvshare_probe_scramble": True} for p in produced["control"]["kv_transfer_params"]
    ]
    out["control"] = run("control", scrambled, MAX_TOKENS)
    if "tamper" in produced:
        params = produced["tamper"]["kv_transfer_params"]
        tampered = [{**p, "kvshare_probe_tamper": True} for p in params]
        out["tamper"] = run("tamper", tampered, MAX_TOKENS)
    _write(work / "decode.result.json", out)
    (work / "stop").touch()


def serve_until_stopped(work: Path, hold_s: float) -> None:
    """Prefill: keep the engine (and its held KV) up until decode is done or ``hold_s``."""
    deadline = time.monotonic() + hold_s
    while time.monotonic() < deadline and not (work / "stop").exists():
        time.sleep(0.2)  # the engine keeps serving reads


def prefill_params(work: Path, hold_s: float) -> dict[str, Any]:
    """Decode: what prefill wrote (its batches' kv_transfer_params), once it is there."""
    deadline = time.monotonic() + hold_s
    while not (work / "prefill.json").exists():
        if time.monotonic() > deadline:
            raise TimeoutError("prefill never wrote its kv_transfer_params")
        time.sleep(0.2)
    return json.loads((work / "prefill.json").read_text())


def _write(path: Path, data: Any) -> None:
    """JSON another process polls for: it appears whole."""
    from kvshare_connector.common.files import write_atomic

    write_atomic(path, json.dumps(data))


# ---- orchestration ------------------------------------------------------------------------

_STARTED: list[subprocess.Popen] = []


def start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """A child in its own session (kvcached names IPC segments after it; killpg ends it)."""
    full = {
        **os.environ,
        **env,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    proc = subprocess.Popen(
        cmd,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=full,
        cwd=ROOT,
        start_new_session=True,
    )
    _STARTED.append(proc)
    return proc


def stop(proc: subprocess.Popen, timeout_s: float = 0) -> int:
    """Its exit code, waiting up to ``timeout_s``; killed (-9) past that."""
    try:
        return proc.wait(timeout=timeout_s) if timeout_s else proc.wait(timeout=0.01)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return -9


def stop_all() -> None:
    """Kill every child still running: no engine outlives the driver on the GPUs."""
    for proc in _STARTED:
        if proc.poll() is None:
            stop(proc, 0.01)


def _on_sigterm(signum: int, _frame: Any) -> None:  # what `timeout` sends
    stop_all()
    os._exit(128 + signum)


def ensure_weights(model: str, args: argparse.Namespace) -> Path:
    from random_weights import DONE, weights_dir

    target = weights_dir(model, Path(args.weights))
    if not (target / DONE).exists():
        log = Path(args.out) / f"weights-{model}.log"
        cmd = [sys.executable, str(ROOT / "benchmarks/gpu/random_weights.py"), "make"]
        cmd += ["--model", model, "--dest", args.weights]
        rc = stop(start(cmd, log, {"CUDA_VISIBLE_DEVICES": "0"}), 1800)
        if rc != 0 or not (target / DONE).exists():
            raise RuntimeError(f"making weights for {model} failed (rc {rc}): see {log}")
    return target


def run_cell(name: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    # verify_kv is the NIXL backend's: LMCache cells run without it
    cell = {**CELLS[name], "verify": args.verify and CELLS[name].get("backend") != "lmcache"}
    work = cell_dir(Path(args.out), name)
    work.mkdir(parents=True, exist_ok=True)
    for stale in ("stop", "prefill.json", "decode.result.json", "prefill.jsonl", "decode.jsonl"):
        (work / stale).unlink(missing_ok=True)
    for stale in ("decode.read_log.jsonl", "prefill.read_log.jsonl", "colocated.json"):
        (work / stale).unlink(missing_ok=True)
    weights = ensure_weights(cell["model"], args)
    env = cell_env(cell)
    server = None
    if cell.get("backend") == "lmcache":
        lm_port = port + 5
        server = start(
            [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(lm_port), "cpu"],
            work / "lmcache_server.log",
            {},
        )
        env.update(KVSHARE_LMCACHE_URL=f"lm://127.0.0.1:{lm_port}", PYTHONHASHSEED="0")
        env.update(LMCACHE_TRACK_USAGE="false", LMCACHE_LOG_LEVEL="WARNING")
        from kvshare_connector.common.child_process import wait_for_port

        wait_for_port("127.0.0.1", lm_port, 60, alive=lambda: server.poll() is None)
    two = args.gpus >= 2
    mem = args.mem or (0.5 if two else 0.4)
    procs = {}
    t0 = time.monotonic()
    roles = ["prefill", "decode"] + (["colocated"] if args.outputs == name else [])
    for i, role in enumerate(roles):
        gpu = {"colocated": 0}.get(role, i) if two else 0
        cmd = [sys.executable, __file__, "engine", "--role", role, "--cell", name]
        cmd += ["--verify"] if cell["verify"] else []
        cmd += ["--work", str(work), "--weights", str(weights), "--mem", str(mem)]
        cmd += [
            "--hold-s",
            str(args.timeout),
            "--lock",
            str(work / (f"gpu{gpu}.lock" if two else "gpu.lock")),
        ]
        if role == "colocated":  # beside prefill on GPU 0: a smaller share
            cmd[cmd.index("--mem") + 1] = str(min(mem, 0.3))
        role_env = {**env, "CUDA_VISIBLE_DEVICES": str(gpu)}
        role_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port + i)
        role_env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        procs[role] = start(cmd, work / f"{role}.log", role_env)
    deadline = time.monotonic() + args.timeout
    while procs["decode"].poll() is None and time.monotonic() < deadline:
        if procs["prefill"].poll() not in (None, 0):
            break  # prefill died: decode would wait in vain
        time.sleep(0.5)
    rc_decode = stop(procs["decode"], 1)
    (work / "stop").touch()
    rc_prefill = stop(procs["prefill"], 60)
    rc_colocated = stop(procs["colocated"], 120) if "colocated" in procs else None
    if server is not None:
        stop(server, 0.01)
    result = {"cell": name, **cell, "rc_prefill": rc_prefill, "rc_decode": rc_decode}
    if rc_colocated is not None:
        result["rc_colocated"] = rc_colocated
    result["wall_s"] = round(time.monotonic() - t0, 1)
    result.update(check_cell(work, cell))
    _write(work / "cell.json", result)
    return result


# ---- the checks ---------------------------------------------------------------------------


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def check_cell(work: Path, cell: dict[str, Any]) -> dict[str, Any]:
    """Every decode record against prefill's record of the same request."""
    from kvshare_connector.devtools.kv_digests import compare

    prefill = {r["request_id"]: r for r in _jsonl(work / "prefill.jsonl")}
    decoded = _jsonl(work / "decode.jsonl")
    requests, problems = [], []
    batches = batches_of(cell)
    tampered = []
    for record in decoded:
        kind = "control" if record.get("scrambled") else "main"
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
    for kind in BATCHES:
        got = sum(r["batch"] == kind for r in requests)
        if got != len(PROMPT_LENS):
            problems.append(f"{kind}: {got} of {len(PROMPT_LENS)} requests compared")
    decode = json.loads(p.read_text()) if (p := work / "decode.result.json").exists() else {}
    for kind in batches:
        for params in decode.get(kind, {}).get("kv_transfer_params", []):
            error = (params or {}).get("kv_load_error")
            if kind != "tamper" and error:
                problems.append(f"{kind}: kv_load_error {error}")
            elif kind == "tamper" and "VerificationError" not in (error or ""):
                problems.append(f"tamper: no VerificationError returned ({error})")
    verified = [r for r in _jsonl(work / "decode.read_log.jsonl") if r.get("verified")]
    if "tamper" in batches:
        if len(tampered) != len(PROMPT_LENS):
            problems.append(f"tamper: {len(tampered)} of {len(PROMPT_LENS)} loads refused")
        if len(verified) != 2 * len(PROMPT_LENS):
            problems.append(f"verify_kv: {len(verified)} of {2 * len(PROMPT_LENS)} loads verified")
    problems += request_problems(requests)
    return {
        "requests": requests,
        "problems": problems,
        "tokens": {k: decode.get(k, {}).get("tokens") for k in BATCHES},
        "logprobs": {k: decode.get(k, {}).get("logprobs") for k in BATCHES},
        "verified_loads": len(verified),
        "verified_layer_blocks": sum(r["verified"] for r in verified),
        "tamper_refused": sum("VerificationError" in r.get("failed", "") for r in tampered),
        "prefill_digest_s": sum(r.get("seconds", 0) for r in prefill.values()),
        "decode_digest_s": sum(r.get("seconds", 0) for r in decoded),
    }


def request_problems(requests: list[dict[str, Any]]) -> list[str]:
    """What is wrong with each compared request: the main batch must match everywhere
    (every group compared, sharers checked), the negative control must mismatch."""
    problems = []
    for r in requests:
        bad = r["problems"] + [f"group {g} compared no block" for g in r["groups_without_blocks"]]
        if r["batch"] == "main":
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
    from kv_outputs import compare_outputs, table

    compared = {}
    for res in results:
        work = cell_dir(out, res["cell"])
        if (work / "colocated.json").exists() and (work / "decode.result.json").exists():
            compared[res["cell"]] = compare_outputs(
                json.loads((work / "decode.result.json").read_text()),
                json.loads((work / "colocated.json").read_text()),
            )
    return "\n\n" + table(compared) if compared else ""


def summary(results: list[dict[str, Any]]) -> str:
    lines = [
        "| cell | rc p/d | requests | layer-blocks compared | MiB compared | mismatches "
        "| sharer checks (bad) | control mismatches | first control locations "
        "| verify_kv: loads verified / tampered refused | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
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
            f"| {verify_column(res)} | {'PASS' if passed(res) else 'FAIL'} |"
        )
    for res in results:
        for problem in res["problems"][:10]:
            lines.append(f"\n- {res['cell']}: {problem}")
    return "\n".join(lines)


def finish(out: Path, results: list[dict[str, Any]]) -> int:
    """results.json, summary.md and one archive of every cell's logs and digests."""
    _write(out / "results.json", results)
    text = summary(results) + outputs_table(out, results)
    (out / "summary.md").write_text(text + "\n")
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for path in sorted(out.iterdir()):
            if path.is_dir() or path.name.endswith(".log"):
                tar.add(path, arcname=path.name)
    print(text)
    return 0 if results and all(passed(r) for r in results) else 1


def cmd_run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_sigterm)
    results = []
    try:
        for i, name in enumerate(args.cells or list(CELLS)):
            try:
                results.append(run_cell(name, args, 21000 + 20 * i))
            except Exception as exc:  # one cell's failure is reported, the rest still run
                failed = {"cell": name, "rc_prefill": None, "rc_decode": None, "requests": []}
                failed["problems"] = [f"{type(exc).__name__}: {exc}"]
                results.append(failed)
                cell_dir(out, name).mkdir(parents=True, exist_ok=True)
                _write(cell_dir(out, name) / "cell.json", failed)
            print(f"done: {name}: {'PASS' if passed(results[-1]) else 'FAIL'}", flush=True)
    finally:
        stop_all()
    return finish(out, results)


def cmd_report(out: Path) -> int:
    """Check every cell under ``out`` again from its digests (e.g. after changing the checks)."""
    results = []
    for path in sorted(out.glob("*/cell.json")):
        result = json.loads(path.read_text())
        if "model" in result:
            result.update(check_cell(path.parent, CELLS.get(result["cell"], result)))
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
    run.add_argument("--outputs", help="run a colocated engine beside this cell")
    engine.add_argument("--verify", action="store_true")
    dispatch(parser.parse_args(), cmd_run, engine_main, cmd_report)


if __name__ == "__main__":
    main()
