#!/usr/bin/env python3
"""Real serving, measured: ``vllm serve`` deployments side by side under ``vllm bench serve``.

Deployments: ``ours`` (prefill ``kv_producer`` on one GPU, decode ``kv_consumer`` on the
other, KVShareConnector, behind the toolkit's proxy; ``--ours-variants`` runs several
connector configurations as separate deployments), ``nixl`` (the same with vLLM's
NixlConnector: the proxy's kv_transfer_params use its field names) and ``colocated`` (one
plain ``vllm serve``). All are started one after another (vLLM's startup memory profiling
misreads memory another engine is allocating; the lone colocated engine first, to fill the
compile cache), warmed up untimed, then every (input length, concurrency) point is run once
per deployment per round, the deployment order rotated each round. Prompts are the same for
every deployment of a round and new each round, and prefix caching is off by default: no
run reuses another's KV. ``--one-at-a-time`` starts and stops each deployment per round.

Everything raw (vLLM's result JSONs, our decode's read_log, server logs, the manifest of
runs with their time windows) ends in OUT/raw.tar.gz; serving_report.py turns it into
OUT/summary.md, OUT/results.json and OUT/scaling.png (also ``--report OUT`` later).

    . .gpu/bin/env.sh
    python benchmarks/gpu/bench_serving.py --model-dir DIR --out OUT [--rounds 3]
    python benchmarks/gpu/bench_serving.py --report OUT
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving_report  # noqa: E402

from kvshare_connector.toolkit.launcher import (  # noqa: E402
    KV_ROLES,
    SIDE_CHANNEL_STRIDE,
    Deployment,
    EngineSpec,
    ServeConfig,
    engine_argv,
    engine_env,
    kv_transfer_config,
    plan_colocated,
)
from kvshare_connector.toolkit.procs import LaunchError, ManagedProcess, stop_processes  # noqa: E402

KINDS = ("ours", "nixl", "colocated")
KVCACHED_MODES = ("none", "contiguous", "per_layer")
BENCH_CMD = "{python} -m vllm.entrypoints.cli.main bench serve"
SERVER_CMD = "{python} -m vllm.entrypoints.cli.main serve {model} --host {host} --port {port}"
PORT_STRIDE = 10  # per deployment: endpoint, +1 prefill, +2 decode


@dataclass
class Planned:
    """One deployment of the benchmark: its launcher Deployment and where its READs go."""

    name: str
    kind: str
    deployment: Deployment
    read_log: str | None  # relative to the raw dir

    @property
    def endpoint(self) -> str:
        return self.deployment.endpoint


# ---- what each deployment runs (pure, tested on CPU) --------------------------------------


def kvcached_env(mode: str) -> dict[str, str]:
    """kvcached 0.1.6 supports vLLM 0.26's V1 model runner only."""
    if mode == "none":
        return {"ENABLE_KVCACHED": "false"}
    return {
        "ENABLE_KVCACHED": "true",
        "KVCACHED_CONTIGUOUS_LAYOUT": "true" if mode == "contiguous" else "false",
        "VLLM_USE_V2_MODEL_RUNNER": "0",
    }


def parse_variants(items: list[str] | None, extra: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``NAME=JSON`` items -> deployment name -> kv_connector_extra_config (``--extra-config``
    first, the variant's keys over it). No items: one deployment called ``ours``."""
    if not items:
        return {"ours": dict(extra)}
    out = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"--ours-variants wants NAME=JSON, got {item!r}")
        out[f"ours-{name}"] = {**extra, **json.loads(text or "{}")}
    return out


def model_vocab(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])


def serve_args(model_dir: Path, tokenizer: Path, args: argparse.Namespace) -> list[str]:
    """vLLM options every engine gets. Gemma-4 with mixed head sizes needs ``global_head_dim``
    handed back (transformers 5.17 folds it away) and Triton attention (vLLM would pick FA4,
    which is not in this stack), as gpu_pd_e2e.py does."""
    from kvshare_connector.devtools.cpu_stack import hf_overrides_for

    config = json.loads((model_dir / "config.json").read_text())
    overrides = hf_overrides_for(model_dir / "config.json")
    if overrides.get("global_head_dim") == config.get("head_dim"):
        overrides = {}
    out = ["--seed", "0"]
    if tokenizer != model_dir:
        out += ["--tokenizer", str(tokenizer)]
    if overrides:
        out += ["--hf-overrides", json.dumps(overrides, separators=(",", ":"))]
    backend = args.attention_backend
    if backend == "auto":
        backend = "TRITON_ATTN" if overrides else None
    if backend and backend != "none":
        out += ["--attention-backend", backend]
    if not args.prefix_caching:
        out.append("--no-enable-prefix-caching")
    if args.enforce_eager:
        out.append("--enforce-eager")
    return out + shlex.split(args.serve_args or "")


def plan(args: argparse.Namespace, model_dir: Path, tokenizer: Path, raw: Path) -> list[Planned]:
    """Every deployment's engines: ports, GPUs, env, kv-transfer-config (nothing started)."""
    extra = json.loads(args.extra_config or "{}")
    named: list[tuple[str, str, dict[str, Any]]] = []
    for kind in args.deployments:
        if kind == "ours":
            named += [(n, "ours", e) for n, e in parse_variants(args.ours_variants, extra).items()]
        else:
            named.append((kind, kind, {}))
    vllm_args = serve_args(model_dir, tokenizer, args)
    max_len = args.max_model_len or (max(args.input_len) + args.output_len + 64)
    server_cmd = args.server_cmd or os.environ.get("KVSHARE_SERVER_CMD") or SERVER_CMD
    planned = []
    for i, (name, kind, extra_cfg) in enumerate(named):
        base = args.base_port + PORT_STRIDE * i
        env = kvcached_env(args.kvcached if kind in args.kvcached_on else "none")
        cfg = ServeConfig(
            model=str(model_dir), port=base, prefill_port=base + 1, decode_port=base + 2,
            side_channel_port=args.side_channel_port + 2 * SIDE_CHANNEL_STRIDE * i,
            prefill_gpus=[args.prefill_gpu if kind != "colocated" else args.colocated_gpu],
            decode_gpus=[args.decode_gpu], gpu_memory_utilization=args.gpu_mem,
            max_model_len=max_len, kv_extra_config=extra_cfg,
            served_model_name=args.served_model_name, vllm_args=vllm_args, env=env,
            server_cmd=server_cmd, log_dir=raw / "logs" / name,
            ready_timeout=args.ready_timeout, grace=args.grace,
        )  # fmt: skip
        read_log = f"reads/{name}.jsonl" if kind == "ours" else None
        if kind == "colocated":
            engines = plan_colocated(cfg)
        else:
            engines = pd_engines(cfg, kind, str(raw / read_log) if read_log else None)
        for spec in engines:
            if spec.env.get("ENABLE_KVCACHED") == "true":  # one shared-memory segment each
                spec.env["KVCACHED_IPC_NAME"] = f"kvshare_{name}_{spec.name}_{os.getpid()}"
        planned.append(Planned(name, kind, Deployment(cfg, engines, kind != "colocated"), read_log))
    return planned


def pd_engines(cfg: ServeConfig, kind: str, read_log: str | None) -> list[EngineSpec]:
    """Prefill and decode engines as launcher.plan_pd makes them, with this kind's
    connector; only our decode writes a read_log."""
    specs = []
    for k, role in enumerate(("prefill", "decode")):
        if kind == "ours":
            kv = kv_transfer_config(cfg, role)
            if role == "decode" and read_log:
                kv.setdefault("kv_connector_extra_config", {})["read_log"] = read_log
        else:
            kv = {"kv_connector": "NixlConnector", "kv_role": KV_ROLES[role]}
        port = cfg.prefill_port if role == "prefill" else cfg.decode_port
        gpu = (cfg.prefill_gpus if role == "prefill" else cfg.decode_gpus)[0]
        argv = engine_argv(cfg, role, port, cfg.gpu_memory_utilization or 0.3, kv)
        env = engine_env(cfg, gpu, cfg.side_channel_port + k * SIDE_CHANNEL_STRIDE)
        specs.append(EngineSpec(f"{role}0", role, cfg.host, port, argv, env))
    return specs


def check_memory(planned: list[Planned], one_at_a_time: bool) -> None:
    """All deployments up at once must fit: the shares of the engines on each GPU add up."""
    per_gpu: dict[str, float] = {}
    for p in planned:
        for e in p.deployment.engines:
            share = float(e.argv[e.argv.index("--gpu-memory-utilization") + 1])
            gpu = e.env["CUDA_VISIBLE_DEVICES"]
            per_gpu[gpu] = per_gpu.get(gpu, 0.0) + share
    over = {g: round(s, 2) for g, s in per_gpu.items() if s > 0.95}
    if over and not one_at_a_time:
        raise SystemExit(f"GPU memory shares {over} > 0.95: lower --gpu-mem or --one-at-a-time")


def bench_argv(
    args: argparse.Namespace, p: Planned, tokenizer: Path, run: dict[str, Any], raw: Path
) -> list[str]:
    """One ``vllm bench serve``: random dataset, fixed lengths, saved result JSON."""
    argv = shlex.split(args.bench_cmd.format(python=sys.executable))
    argv += [
        "--backend", "openai", "--base-url", p.endpoint, "--endpoint", "/v1/completions",
        "--model", args.served_model_name, "--tokenizer", str(tokenizer),
        "--dataset-name", "random", "--random-input-len", str(run["input_len"]),
        "--random-output-len", str(run["output_len"]), "--random-range-ratio", "0",
        "--num-prompts", str(run["num_prompts"]), "--max-concurrency", str(run["concurrency"]),
        "--request-rate", "inf", "--seed", str(run["seed"]), "--ignore-eos",
        "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99", "--disable-tqdm", "--save-result",
        "--result-dir", str(raw / Path(run["file"]).parent),
        "--result-filename", Path(run["file"]).name, "--label", p.name,
        "--metadata", f"kvshare_deployment={p.name}", f"kvshare_round={run['round']}",
    ]  # fmt: skip
    if run["warmup"]:
        argv += ["--ready-check-timeout-sec", "120"]
    if args.save_detailed and not run["warmup"]:
        argv.append("--save-detailed")
    return argv


# ---- setup: weights, tokenizer ------------------------------------------------------------


def resolve_model(args: argparse.Namespace) -> Path:
    """``--model-dir``, or random-init weights made once by random_weights.py (in its own
    process, so its CUDA memory is gone before any engine starts)."""
    if not args.make_weights:
        return Path(args.model_dir).resolve()
    cmd = [sys.executable, str(ROOT / "benchmarks/gpu/random_weights.py"), "make",
           "--model", args.make_weights, "--dest", args.weights_root]  # fmt: skip
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    return Path(done.stdout.strip().splitlines()[-1]).resolve()


def resolve_tokenizer(model_dir: Path, args: argparse.Namespace) -> Path:
    """The model's own tokenizer, else the toolkit's local BPE tokenizer (cached per size).
    Its ids must stay below the model's vocab_size: the random dataset samples from them."""
    vocab = model_vocab(model_dir)
    if args.tokenizer:
        return Path(args.tokenizer).resolve()
    if (model_dir / "tokenizer.json").exists() or (model_dir / "tokenizer.model").exists():
        return model_dir
    from kvshare_connector.toolkit.tokenizer import write_tokenizer

    size = min(vocab, args.tokenizer_vocab or vocab)
    config = json.loads((model_dir / "config.json").read_text())
    max_len = int(config.get("max_position_embeddings", 4096))
    root = Path(tempfile.gettempdir()) / f"kvshare-tokenizers-{os.getuid()}"
    cache = root / f"v{size}-l{max_len}"
    if not (cache / "tokenizer_config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=cache.name, dir=root))  # renamed when complete
        write_tokenizer(tmp, size, max_len)
        shutil.rmtree(cache, ignore_errors=True)
        tmp.rename(cache)
    return cache


def sampled_vocab(path: Path) -> int | None:
    """How many ids the random dataset samples from (the base vocab, no added tokens)."""
    if not (path / "tokenizer.json").exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size(with_added_tokens=False)


# ---- running ------------------------------------------------------------------------------


class Runner:
    """Starts deployments, runs benches, always stops what it started (also on SIGTERM)."""

    def __init__(
        self, args: argparse.Namespace, planned: list[Planned], tokenizer: Path, raw: Path
    ) -> None:
        self.args, self.planned, self.tokenizer, self.raw = args, planned, tokenizer, raw
        self.up: list[Planned] = []
        self.broken: dict[str, str] = {}
        self.failures = 0

    def start(self, p: Planned) -> bool:
        if p.name in self.broken:
            return False
        t0 = time.monotonic()
        try:
            p.deployment.start()
        except LaunchError as exc:
            self.broken[p.name] = str(exc).splitlines()[0]
            print(f"[bench] {p.name} failed to start: {exc}", flush=True)
            return False
        self.up.append(p)
        print(f"[bench] {p.name} up at {p.endpoint} in {time.monotonic() - t0:.0f}s", flush=True)
        return True

    def stop(self, p: Planned) -> None:
        p.deployment.stop()
        if p in self.up:
            self.up.remove(p)

    def stop_all(self) -> None:
        for p in reversed(list(self.up)):
            self.stop(p)

    def bench(self, p: Planned, run: dict[str, Any]) -> None:
        """One ``vllm bench serve``, bounded by --bench-timeout; appends to the manifest."""
        if p.name in self.broken:
            return
        dead = p.deployment.dead()
        if dead:
            self.broken[p.name] = f"{dead[0].name} exited (log {dead[0].log_path})"
            print(f"[bench] {p.name}: {self.broken[p.name]}; skipping its runs", flush=True)
            return
        stem = Path(run["file"]).stem
        proc = ManagedProcess(
            f"bench-{stem}",
            bench_argv(self.args, p, self.tokenizer, run, self.raw),
            dict(os.environ),
            self.raw / "logs" / "bench" / f"{stem}.log",
        )
        run = {**run, "deployment": p.name, "kind": p.kind, "start": time.time()}
        (self.raw / run["file"]).parent.mkdir(parents=True, exist_ok=True)
        proc.start()
        try:
            rc = proc.proc.wait(timeout=self.args.bench_timeout) if proc.proc else -1
        except subprocess.TimeoutExpired:
            rc = 124
        finally:
            stop_processes([proc], 5.0)
        run.update(end=time.time(), rc=rc)
        if rc != 0 and not run["warmup"]:
            self.failures += 1
        with open(self.raw / "runs.jsonl", "a") as f:
            f.write(json.dumps(run) + "\n")
        print(f"[bench] {stem}: rc {rc} in {run['end'] - run['start']:.0f}s", flush=True)

    def runs_for(self, p: Planned, rnd: int) -> list[dict[str, Any]]:
        a = self.args
        out = []
        for i, length in enumerate(a.input_len):
            for j, conc in enumerate(a.concurrency):
                seed = a.seed + 1000 * rnd + 10 * i + j
                file = f"bench/{p.name}_r{rnd}_in{length}_c{conc}.json"
                out.append(dict(round=rnd, input_len=length, output_len=a.output_len,
                                concurrency=conc, num_prompts=a.num_prompts, seed=seed,
                                file=file, warmup=False))  # fmt: skip
        return out

    def warmup(self, p: Planned) -> None:
        """Untimed: the first requests compile kernels and size CUDA graphs per shape."""
        n = self.args.warmup_prompts
        if n <= 0:
            return
        conc = max(self.args.concurrency)
        for length in self.args.input_len:
            self.bench(p, dict(round=-1, input_len=length, output_len=self.args.output_len,
                               concurrency=conc, num_prompts=n, seed=self.args.seed + 999_999,
                               file=f"warmup/{p.name}_in{length}.json", warmup=True))  # fmt: skip

    def run(self) -> None:
        order = list(self.planned)
        if not self.args.one_at_a_time:
            # A lone engine first: it fills vLLM's compile cache, so the two engines of a PD
            # deployment (started together) find it instead of compiling into it at once.
            for p in sorted(order, key=lambda p: p.kind != "colocated"):
                self.start(p)
            for p in order:
                self.warmup(p)
        for rnd in range(self.args.rounds):
            k = rnd % len(order)
            rotated = order[k:] + order[:k]
            print(f"[bench] round {rnd}: {[p.name for p in rotated]}", flush=True)
            if self.args.one_at_a_time:
                for p in rotated:
                    if self.start(p):
                        self.warmup(p)
                        for run in self.runs_for(p, rnd):
                            self.bench(p, run)
                    self.stop(p)
                continue
            points = list(zip(*(self.runs_for(p, rnd) for p in rotated), strict=True))
            for at_point in points:
                for p, run in zip(rotated, at_point, strict=True):
                    self.bench(p, run)


def describe(planned: list[Planned]) -> dict[str, Any]:
    return {
        p.name: {
            "kind": p.kind,
            "endpoint": p.endpoint,
            "read_log": p.read_log,
            "engines": [
                {"name": e.name, "argv": e.argv, "env": e.env} for e in p.deployment.engines
            ],
        }
        for p in planned
    }


def gpu_names() -> str:
    try:
        query = ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=30)
        return "; ".join(out.stdout.strip().splitlines()) or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_benchmark(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    raw = out / serving_report.RAW
    if (out / serving_report.TARBALL).exists() or raw.exists():
        raise SystemExit(f"{out} already holds a run; pick another --out")
    (raw / "reads").mkdir(parents=True)
    model_dir = resolve_model(args)
    tokenizer = resolve_tokenizer(model_dir, args)
    sampled = sampled_vocab(tokenizer)
    if sampled is not None and sampled > model_vocab(model_dir):
        raise SystemExit(
            f"{tokenizer}: {sampled} ids > the model's vocab_size; random prompts "
            "would hold ids the model has no embedding for"
        )
    planned = plan(args, model_dir, tokenizer, raw)
    check_memory(planned, args.one_at_a_time)
    meta = {k: v for k, v in vars(args).items() if k != "func"}
    meta.update(model_dir=str(model_dir), tokenizer=str(tokenizer), gpus=gpu_names(),
                started=time.strftime("%Y-%m-%d %H:%M:%S"), argv=sys.argv)  # fmt: skip
    (raw / "meta.json").write_text(json.dumps(meta, indent=1))
    (raw / "deployments.json").write_text(json.dumps(describe(planned), indent=1))

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    runner = Runner(args, planned, tokenizer, raw)
    interrupted = False
    try:
        runner.run()
    except KeyboardInterrupt:
        interrupted = True
        print("[bench] interrupted: stopping everything", flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup below must finish
        runner.stop_all()
        (raw / "broken.json").write_text(json.dumps(runner.broken, indent=1))
        if (raw / "runs.jsonl").exists():
            serving_report.write_report(out)
        serving_report.pack(out, args.keep_raw)
    print((out / "summary.md").read_text() if (out / "summary.md").exists() else "no runs")
    if interrupted:
        return 130
    return 1 if runner.failures or runner.broken else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--report", metavar="OUT", help="only recompute the tables from OUT's raw files")
    add("--out", help="output directory (must not hold a run yet)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model-dir", help="config.json + safetensors weights")
    src.add_argument("--make-weights", metavar="MODEL", help="g4tiny|gemma4_e2b_shape|...: "
                     "random-init weights made by random_weights.py")  # fmt: skip
    add("--weights-root", default="/tmp/kvshare-weights", help="where --make-weights writes")
    add("--tokenizer", help="tokenizer dir (default: the model's, else a local BPE one)")
    add("--tokenizer-vocab", type=int, default=4096, help="local tokenizer size (0: model's)")
    add("--served-model-name", default="kvshare-bench")
    add("--deployments", nargs="+", choices=KINDS, default=list(KINDS))
    add("--ours-variants", nargs="+", metavar="NAME=JSON", help='e.g. direct={"staging_mib":0}')
    add("--extra-config", help="JSON merged into our kv_connector_extra_config")
    add("--kvcached", choices=KVCACHED_MODES, default="none")
    add("--kvcached-on", nargs="+", choices=KINDS, default=["ours"], help="under --kvcached")
    add("--input-len", type=int, nargs="+", default=[2048])
    add("--output-len", type=int, default=128)
    add("--num-prompts", type=int, default=200)
    add("--concurrency", type=int, nargs="+", default=[16])
    add("--rounds", type=int, default=3)
    add("--seed", type=int, default=0)
    add("--warmup-prompts", type=int, default=32, help="untimed, per deployment and length")
    add("--gpu-mem", type=float, default=0.3, help="gpu-memory-utilization per engine")
    add("--max-model-len", type=int, default=None, help="default: longest input + output + 64")
    add("--prefill-gpu", default="0")
    add("--decode-gpu", default="1")
    add("--colocated-gpu", default="0")
    add("--attention-backend", default="auto", help="auto: TRITON_ATTN if hf_overrides needed")
    add("--prefix-caching", action="store_true", help="leave vLLM's prefix caching on")
    add("--enforce-eager", action="store_true")
    add("--serve-args", help="more vllm serve arguments, in one string")
    add("--one-at-a-time", action="store_true", help="start/stop each deployment per round")
    add("--base-port", type=int, default=18000, help=f"+{PORT_STRIDE} per deployment")
    add("--side-channel-port", type=int, default=15600)
    add("--ready-timeout", type=float, default=1200.0, help="s, per deployment start")
    add("--bench-timeout", type=float, default=1800.0, help="s, per vllm bench serve")
    add("--grace", type=float, default=20.0, help="s between SIGTERM and SIGKILL")
    add("--save-detailed", action="store_true", help="per-request data in the result JSONs")
    add("--keep-raw", action="store_true", help="keep OUT/raw next to raw.tar.gz")
    add("--server-cmd", help="replaces vllm serve (tests: the fake server)")
    add("--bench-cmd", default=BENCH_CMD, help="replaces vllm bench serve (tests)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        serving_report.write_report(Path(args.report))
        print((Path(args.report) / "summary.md").read_text())
        return 0
    if not args.out or not (args.model_dir or args.make_weights):
        build_parser().error("--out and --model-dir (or --make-weights) are required")
    return run_benchmark(args)


if __name__ == "__main__":
    sys.exit(main())
