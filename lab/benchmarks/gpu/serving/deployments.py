"""What each deployment of the serving benchmark runs: engines, ports, GPUs, connector
configuration, front (our proxy or vllm-router). Pure planning, tested on CPU; nothing here
starts a process except ``resolve_model`` (random_weights.py) and ``gpu_names``."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvshare_connector.toolkit.launcher import (
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
from kvshare_connector.toolkit.proxy import ProxyTimeouts
from kvshare_connector.transfer.device import lanes
from kvshare_connector.transfer.wire.side_channel import SECRET_ENV

ROOT = Path(__file__).resolve().parents[3]
KINDS = ("ours", "nixl", "colocated")
KVCACHED_MODES = ("none", "contiguous", "per_layer")
SERVER_CMD = "{python} -m vllm.entrypoints.cli.main serve {model} --host {host} --port {port}"
#: Ports of deployment i start at base + PORT_STRIDE * i: endpoint, prefills from +1,
#: decodes from +1 + MAX_ENGINES, vllm-router's Prometheus port at the last one.
MAX_ENGINES = 4
PORT_STRIDE = 2 + 2 * MAX_ENGINES


@dataclass
class Planned:
    """One deployment of the benchmark: its launcher Deployment and where its READs go."""

    name: str
    kind: str
    deployment: Deployment
    read_logs: list[str] = field(default_factory=list)  # one per decode, relative to raw/
    router: str = "none"  # kvshare | vllm-router | none (colocated)

    @property
    def endpoint(self) -> str:
        return self.deployment.endpoint


def kvcached_env(mode: str) -> dict[str, str]:
    """kvcached 0.1.6 supports vLLM 0.26's V1 model runner only (vLLM 0.34 has no V1 runner
    and refuses the variable: there kvcached's own error is left to say why it stops)."""
    if mode == "none":
        return {"ENABLE_KVCACHED": "false"}
    from kvshare_connector.vllm import compat

    return {
        "ENABLE_KVCACHED": "true",
        "KVCACHED_CONTIGUOUS_LAYOUT": "true" if mode == "contiguous" else "false",
        **({"VLLM_USE_V2_MODEL_RUNNER": "0"} if compat.HAS_V1_MODEL_RUNNER else {}),
    }


def kvcached_mode(args: argparse.Namespace, name: str, kind: str) -> str:
    """This deployment's kvcached mode: ``--kvcached-on`` names kinds or deployments, each
    optionally ``=MODE`` (``ours-kvc=contiguous``) to override ``--kvcached``, so that one run
    holds plain and kvcached variants side by side. A deployment's own name wins over its
    kind (``--kvcached contiguous --kvcached-on ours ours-kvl=per_layer``: every ours
    deployment contiguous, ours-kvl per-layer)."""
    items = [(item, *item.partition("=")[::2]) for item in args.kvcached_on]
    for target in (name, kind):
        for item, named, mode in items:
            if named == target:
                mode = mode or args.kvcached
                if mode not in KVCACHED_MODES:
                    raise SystemExit(
                        f"--kvcached-on {item!r}: mode must be one of {KVCACHED_MODES}"
                    )
                return mode
    return "none"


def engine_env_of(args: argparse.Namespace, name: str | None = None) -> dict[str, str]:
    """``--engine-env KEY=VALUE`` items (e.g. ``UCX_LOG_LEVEL=info``: which UCX lane the
    engines' READs take) for every engine, then deployment ``name``'s own
    ``--variant-env NAME:KEY=VALUE`` items over them."""
    env = {}
    for item in args.engine_env or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-env wants KEY=VALUE, got {item!r}")
        env[key] = value
    for item in getattr(args, "variant_env", None) or []:
        target, colon, pair = item.partition(":")
        key, sep, value = pair.partition("=")
        if not colon or not target or not sep or not key:
            raise SystemExit(f"--variant-env wants NAME:KEY=VALUE, got {item!r}")
        if target == name:
            env[key] = value
    return env


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
    which is not in this stack), as lab.gpu_checks.engines does."""
    from kvshare_connector.demo.cpu_stack import hf_overrides_for

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
    if args.kv_cache_gib:
        # A fixed KV size skips vLLM's startup memory profiling, which misreads memory that
        # another engine on the same GPU is allocating: engines can then start together.
        out += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30))]
    return out + shlex.split(args.serve_args or "")


def max_model_len(args: argparse.Namespace) -> int:
    """Room for the longest prompt, the output and what the random dataset's tokenizer round
    trip may add, rounded up to 1024 (32k prompts, 32 out: 33,792)."""
    need = max(args.input_len) + getattr(args, "random_prefix_len", 0) + args.output_len + 128
    return args.max_model_len or -(-need // 1024) * 1024


def named_deployments(args: argparse.Namespace) -> list[tuple[str, str, dict[str, Any]]]:
    extra = json.loads(args.extra_config or "{}")
    named: list[tuple[str, str, dict[str, Any]]] = []
    for kind in args.deployments:
        if kind == "ours":
            named += [(n, "ours", e) for n, e in parse_variants(args.ours_variants, extra).items()]
        else:
            named.append((kind, kind, {}))
    return named


def plan(args: argparse.Namespace, model_dir: Path, tokenizer: Path, raw: Path) -> list[Planned]:
    """Every deployment's engines: ports, GPUs, env, kv-transfer-config (nothing started)."""
    if not (1 <= args.num_prefill <= MAX_ENGINES and 1 <= args.num_decode <= MAX_ENGINES):
        raise SystemExit(f"--num-prefill/--num-decode: 1 to {MAX_ENGINES}")
    vllm_args = serve_args(model_dir, tokenizer, args)
    named = named_deployments(args)
    known = {n for n, _, _ in named} | {k for _, k, _ in named}
    unknown = [i for i in args.kvcached_on if i.partition("=")[0] not in known]
    if unknown and args.kvcached_on != ["ours"]:  # the default names a kind that may be absent
        raise SystemExit(f"--kvcached-on {unknown}: no such deployment (have {sorted(known)})")
    engine_env_of(args)  # every item well formed, whichever deployment it names
    unknown = [i for i in args.variant_env or [] if i.partition(":")[0] not in known]
    if unknown:
        raise SystemExit(f"--variant-env {unknown}: no such deployment (have {sorted(known)})")
    from_decode = getattr(args, "first_token_from_decode", None) or []
    unknown = [n for n in from_decode if n not in known]
    if unknown:
        raise SystemExit(
            f"--first-token-from-decode {unknown}: no such deployment (have {sorted(known)})"
        )
    server_cmd = args.server_cmd or os.environ.get("KVSHARE_SERVER_CMD") or SERVER_CMD
    planned = []
    for i, (name, kind, extra_cfg) in enumerate(named):
        base = args.base_port + PORT_STRIDE * i
        env = {**kvcached_env(kvcached_mode(args, name, kind)), **engine_env_of(args, name)}
        cfg = ServeConfig(
            model=str(model_dir), port=base, prefill_port=base + 1,
            decode_port=base + 1 + MAX_ENGINES,
            side_channel_port=args.side_channel_port + 2 * MAX_ENGINES * SIDE_CHANNEL_STRIDE * i,
            num_prefill=args.num_prefill, num_decode=args.num_decode,
            prefill_gpus=[args.colocated_gpu] if kind == "colocated" else args.prefill_gpu,
            decode_gpus=args.decode_gpu, gpu_memory_utilization=args.gpu_mem,
            max_model_len=max_model_len(args), kv_extra_config=extra_cfg,
            served_model_name=args.served_model_name, vllm_args=vllm_args, env=env,
            server_cmd=server_cmd, log_dir=raw / "logs" / name,
            ready_timeout=args.ready_timeout, grace=args.grace,
            parallel_start=True if args.kv_cache_gib else None,
            proxy_timeouts=ProxyTimeouts(read=args.bench_timeout),
            router=args.router if kind != "colocated" else "kvshare",
            router_policy=args.router_policy, router_metrics_port=base + PORT_STRIDE - 1,
            first_token="decode" if {name, kind} & set(from_decode) else "prefill",
            side_down=getattr(args, "side_down", "alone"),
        )  # fmt: skip
        read_logs = (
            [f"reads/{name}-decode{k}.jsonl" for k in range(args.num_decode)]
            if kind == "ours"
            else []
        )
        if kind == "colocated":
            engines = plan_colocated(cfg)
        else:
            engines = pd_engines(cfg, kind, [str(raw / r) for r in read_logs], args)
        for spec in engines:
            if spec.env.get("ENABLE_KVCACHED") == "true":  # one shared-memory segment each
                spec.env["KVCACHED_IPC_NAME"] = f"kvshare_{name}_{spec.name}_{os.getpid()}"
        router = "none" if kind == "colocated" else args.router
        dep = Deployment(cfg, engines, kind != "colocated")
        planned.append(Planned(name, kind, dep, read_logs, router))
    return planned


def pd_engines(
    cfg: ServeConfig, kind: str, read_logs: list[str], args: argparse.Namespace
) -> list[EngineSpec]:
    """N prefill and M decode engines as launcher.plan_pd makes them, with this kind's
    connector; each of our decodes writes its own read_log. GPUs cycle through the lists."""
    specs = []
    roles = [("prefill", i) for i in range(cfg.num_prefill)]
    roles += [("decode", i) for i in range(cfg.num_decode)]
    for k, (role, i) in enumerate(roles):
        if kind == "ours":
            kv = kv_transfer_config(cfg, role)
            if role == "decode" and read_logs:
                kv.setdefault("kv_connector_extra_config", {})["read_log"] = read_logs[i]
        else:
            kv = {"kv_connector": "NixlConnector", "kv_role": KV_ROLES[role]}
        port = (cfg.prefill_port if role == "prefill" else cfg.decode_port) + i
        gpus = cfg.prefill_gpus if role == "prefill" else cfg.decode_gpus
        share = args.decode_gpu_mem if role == "decode" and args.decode_gpu_mem else args.gpu_mem
        argv = engine_argv(cfg, role, port, share, kv)
        env = engine_env(cfg, gpus[i % len(gpus)], cfg.side_channel_port + k * SIDE_CHANNEL_STRIDE)
        if kind != "ours":  # lane against lane: the UCX settings ours chooses for itself
            env = {**baseline_lane(env), **env}
        specs.append(EngineSpec(f"{role}{i}", role, cfg.host, port, argv, env))
    return specs


def baseline_lane(env: dict[str, str]) -> dict[str, str]:
    """The UCX settings our connector would choose for GPU KV in this environment (the
    engine's own UCX_* values win), given to vLLM's NixlConnector so that a comparison is
    lane against lane, not cuda_ipc against UCX's tcp emulation."""
    vmm = env.get("ENABLE_KVCACHED") == "true"
    return dict(lanes.plan_lane({"VRAM"}, vmm=vmm, environ=env).chosen)


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


def describe(planned: list[Planned]) -> dict[str, Any]:
    return {
        p.name: {
            "kind": p.kind,
            "router": p.router,
            "endpoint": p.endpoint,
            "read_logs": p.read_logs,
            "engines": [
                {"name": e.name, "role": e.role, "url": e.url, "argv": e.argv,
                 "env": {k: "<redacted>" if k == SECRET_ENV else v for k, v in e.env.items()}}
                for e in p.deployment.engines
            ],
        }
        for p in planned
    }


def resolve_model(args: argparse.Namespace) -> Path:
    """``--model-dir``, or random-init weights made once by random_weights.py (in its own
    process, so its CUDA memory is gone before any engine starts)."""
    if not args.make_weights:
        return Path(args.model_dir).resolve()
    cmd = [sys.executable, "-m", "lab.gpu_checks.random_weights", "make",
           "--model", args.make_weights, "--dest", args.weights_root]  # fmt: skip
    done = subprocess.run(
        cmd, check=True, capture_output=True, text=True, timeout=1800, cwd=ROOT
    )
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
    text = config.get("text_config", config)
    max_len = int(text.get("max_position_embeddings", config.get("max_position_embeddings", 4096)))
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


def gpu_names() -> str:
    try:
        query = ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=30)
        return "; ".join(out.stdout.strip().splitlines()) or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
