"""Config-sweep accuracy check: for each configuration, PD through KVShareConnector vs a
colocated baseline vs an expected score.

Per configuration: start the colocated baseline, run lm-eval and a few greedy probe prompts,
stop it; start the PD deployment (prefill + decode + proxy), run the same, stop it; compare.
Accuracy alone can hide a broken transfer (dummy weights score 0 both ways), so the sweep also
compares the generated text per document and the probe tokens/logprobs one by one.

Configuration file (YAML or JSON)::

    defaults: {eval: {task: kvshare_arith, include_path: local_task, offline: true}}
    configs:
      - name: g4tiny-per-layer
        tiny_model_config: models/g4tiny_config.json   # dummy weights + local tokenizer
        layout: per_layer
        kvcached: true
        kvcached_contiguous_layout: true
        block_size: 16
        max_model_len: 2048
        gpu_memory_utilization: 0.3
        expected_score: null     # or e.g. 0.485 with tolerance 0.03
        min_agreement: 1.0

Relative paths are relative to the configuration file.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from kvshare_connector.toolkit import checks
from kvshare_connector.toolkit.launcher import (
    SIDE_CHANNEL_STRIDE,
    ServeConfig,
    check_server,
    colocated_deployment,
    pd_deployment,
    plan_pd,
)
from kvshare_connector.toolkit.lmeval import EvalError, agreement, run_lm_eval
from kvshare_connector.toolkit.procs import LaunchError, free_port_run, pick_free_port
from kvshare_connector.toolkit.report import write_reports
from kvshare_connector.toolkit.sweep_config import SweepEntry, load_sweep

__all__ = ["SweepEntry", "compare_probes", "judge", "load_sweep", "run_sweep"]

logger = logging.getLogger(__name__)

PROBE_PROMPTS = (
    "Question: What is 12 + 30?\nAnswer:",
    "The quick brown fox jumps over the lazy dog. The dog",
    "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:",
    "1, 2, 3, 4, 5, 6,",
)


def prepare_model(entry: SweepEntry, models_dir: Path) -> tuple[str, str, list[str]]:
    """(model path/name, served name, extra vLLM args); builds tiny model dirs once."""
    if entry.model is not None:
        return entry.model, entry.served_model_name or entry.model, []
    from kvshare_connector.toolkit.tokenizer import make_model_dir

    config = Path(str(entry.tiny_model_config))
    stem = config.stem.removesuffix("_config")
    model_dir = models_dir / stem
    if not (model_dir / "tokenizer.json").exists():
        make_model_dir(config, model_dir)
    extra = [] if "--load-format" in entry.vllm_args else ["--load-format", "dummy"]
    return str(model_dir.resolve()), entry.served_model_name or stem, extra


def run_probe(
    endpoint: str, model: str, prompts: Sequence[str] = PROBE_PROMPTS, max_tokens: int = 16
) -> list[dict[str, Any]]:
    """Greedy completions one at a time (no batching effects), with tokens and logprobs."""
    out = []
    with httpx.Client(timeout=300) as client:
        for prompt in prompts:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "logprobs": 1,
                "ignore_eos": True,
                "return_tokens_as_token_ids": True,
            }
            resp = client.post(endpoint + "/v1/completions", json=body)
            if resp.status_code != 200:
                raise EvalError(
                    f"probe request to {endpoint} answered {resp.status_code}: {resp.text[:300]}"
                )
            choice = resp.json()["choices"][0]
            lp = choice.get("logprobs") or {}
            out.append(
                {
                    "prompt": prompt,
                    "text": choice.get("text"),
                    "tokens": lp.get("tokens"),
                    "logprobs": lp.get("token_logprobs"),
                }
            )
    return out


def compare_probes(base: list[dict[str, Any]], pd: list[dict[str, Any]]) -> dict[str, Any]:
    equal = sum(
        b["tokens"] == p["tokens"] and b["text"] == p["text"] for b, p in zip(base, pd, strict=True)
    )
    diffs = [
        abs(x - y)
        for b, p in zip(base, pd, strict=True)
        if b["tokens"] == p["tokens"]
        for x, y in zip(b["logprobs"] or [], p["logprobs"] or [], strict=False)
        if x is not None and y is not None
    ]
    return {
        "n": len(base),
        "tokens_equal": equal,
        "max_abs_logprob_diff": max(diffs) if diffs else None,
    }


def _measure(
    entry: SweepEntry, cfg: ServeConfig, pd: bool, work: Path, served: str
) -> dict[str, Any]:
    """Start one deployment, evaluate it, stop it."""
    deployment = pd_deployment(cfg) if pd else colocated_deployment(cfg)
    with deployment:
        result = run_lm_eval(entry.eval, deployment.endpoint, served, work)
        probes = run_probe(deployment.endpoint, served) if entry.probe else None
    (work / "probe.json").write_text(json.dumps(probes, indent=2))
    return {
        "score": result.score,
        "n": result.n_samples,
        "seconds": round(result.seconds, 1),
        "results_file": result.results_file,
        "samples_file": result.samples_file,
        "_responses": result.responses,
        "_probes": probes,
    }


def evaluate_entry(
    entry: SweepEntry,
    out_dir: Path,
    server_cmd: str | None,
    extra_vllm_args: Sequence[str],
    models_dir: Path,
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "name": entry.name,
        "config": entry.summary(str(entry.model or entry.tiny_model_config)),
        "status": "error",
        "error": None,
        "expected_score": entry.expected_score,
        "tolerance": entry.tolerance,
        "baseline_tolerance": entry.baseline_tolerance,
        "min_agreement": entry.min_agreement,
        "baseline": None,
        "pd": None,
        "agreement": None,
        "probe": None,
        "checks": {},
        "log_dir": str(out_dir / entry.name),
    }
    parts: dict[str, dict[str, Any]] = {}
    try:
        model, served, model_args = prepare_model(entry, models_dir)
        record["config"]["model"] = model
        engines = len(entry.prefill_gpus) + len(entry.decode_gpus)
        for side in (["baseline"] if entry.baseline else []) + ["pd"]:
            host = "127.0.0.1"
            cfg = ServeConfig(
                model=model,
                host=host,
                port=pick_free_port(host),
                # The launcher numbers each role's ports up from these.
                prefill_port=free_port_run(len(entry.prefill_gpus), host),
                decode_port=free_port_run(len(entry.decode_gpus), host),
                side_channel_port=free_port_run(SIDE_CHANNEL_STRIDE * engines, host),
                prefill_gpus=entry.prefill_gpus,
                decode_gpus=entry.decode_gpus,
                gpu_memory_utilization=entry.gpu_memory_utilization,
                block_size=entry.block_size,
                max_model_len=entry.max_model_len,
                layout=entry.layout,
                served_model_name=served,
                vllm_args=[*model_args, *entry.vllm_args, *extra_vllm_args],
                env=entry.server_env(),
                server_cmd=server_cmd,
                log_dir=out_dir / entry.name / side,
                ready_timeout=entry.ready_timeout,
            )
            logger.info("[%s] %s: starting", entry.name, side)
            parts[side] = _measure(entry, cfg, side == "pd", out_dir / entry.name / side, served)
            logger.info("[%s] %s: score %.4f", entry.name, side, parts[side]["score"])
    except (LaunchError, EvalError, OSError, httpx.HTTPError) as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        logger.error("[%s] %s", entry.name, record["error"])
    except Exception as exc:  # one broken configuration must not end the sweep
        record["error"] = f"{type(exc).__name__}: {exc}"
        logger.exception("[%s] unexpected error", entry.name)
    for side, part in parts.items():
        record[side] = {k: v for k, v in part.items() if not k.startswith("_")}
    if record["error"] is None:
        record.update(judge(entry, parts))
    return record


def judge(entry: SweepEntry, parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Checks that apply (None = not applicable) and the verdict."""
    pd, base = parts["pd"], parts.get("baseline")
    checks: dict[str, bool | None] = {
        "pd_vs_baseline": None,
        "pd_vs_expected": None,
        "agreement": None,
        "probe": None,
    }
    agree = probe = None
    if base is not None:
        checks["pd_vs_baseline"] = abs(pd["score"] - base["score"]) <= entry.baseline_tolerance
        agree = agreement(base["_responses"], pd["_responses"])
        if entry.min_agreement is not None:
            checks["agreement"] = agree is not None and agree >= entry.min_agreement
        if base["_probes"] is not None and pd["_probes"] is not None:
            probe = compare_probes(base["_probes"], pd["_probes"])
            checks["probe"] = probe["tokens_equal"] == probe["n"]
    if entry.expected_score is not None:
        checks["pd_vs_expected"] = abs(pd["score"] - entry.expected_score) <= entry.tolerance
    applied = [v for v in checks.values() if v is not None]
    status = "passed" if applied and all(applied) else "failed"
    return {"checks": checks, "agreement": agree, "probe": probe, "status": status}


def run_sweep(
    entries: Sequence[SweepEntry],
    out_dir: Path,
    *,
    config_file: str = "",
    server_cmd: str | None = None,
    extra_vllm_args: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Run every entry in order; reports are rewritten after each one."""
    out_dir = out_dir.resolve()
    meta = {
        "config_file": config_file,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "metric": entries[0].eval.metric if entries else "",
    }
    results: list[dict[str, Any]] = []
    for entry in entries:
        results.append(
            evaluate_entry(entry, out_dir, server_cmd, extra_vllm_args, out_dir / "models")
        )
        meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        write_reports(out_dir, results, meta)
    return results


def _check(args: argparse.Namespace) -> None:
    """Read the sweep file and check what its configurations need before any server
    starts; keeps the entries for ``_run``."""
    checks.require_file(args.config, "sweep file")
    try:
        entries = load_sweep(args.config)
    except ImportError as exc:
        raise checks.UsageError(
            f"reading {args.config} needs {exc.name}: pip install 'kvshare-connector[eval]'"
        ) from None
    except OSError as exc:
        raise checks.UsageError(f"cannot read {args.config}: {exc}") from None
    missing = set(args.only) - {e.name for e in entries}
    if missing:
        known = [e.name for e in entries]
        raise checks.UsageError(f"--only: no configuration named {sorted(missing)}; {known}")
    entries = [e for e in entries if not args.only or e.name in args.only]
    if not entries:
        raise checks.UsageError(f"{args.config}: the `configs` list is empty")
    if args.output_dir is not None:
        checks.check_writable_dir(args.output_dir, "--output-dir")
    checks.require_module(["lm_eval"], "pip install 'kvshare-connector[eval]'")
    cfgs = [ServeConfig(model=e.model or "tiny", prefill_gpus=e.prefill_gpus,
                        decode_gpus=e.decode_gpus, server_cmd=args.server_cmd)
            for e in entries]  # fmt: skip
    check_server(cfgs[0], [engine for cfg in cfgs for engine in plan_pd(cfg)])
    args.entries = entries


def _run(args: argparse.Namespace) -> int:
    entries = args.entries  # read and checked by _check (cli.main runs it first)
    for e in entries:
        if args.limit is not None:
            e.eval.limit = args.limit
        if args.skip_baseline:
            e.baseline = False
        if args.no_probe:
            e.probe = False
        if args.ready_timeout is not None:
            e.ready_timeout = args.ready_timeout
    out_dir = args.output_dir or Path("runs/sweep") / time.strftime("%Y%m%d-%H%M%S")
    results = run_sweep(
        entries,
        out_dir,
        config_file=str(args.config),
        server_cmd=args.server_cmd,
        extra_vllm_args=args.passthrough,
    )
    for r in results:
        print(
            f"{r['name']}: {r['status']}  PD={(r['pd'] or {}).get('score')} "
            f"baseline={(r['baseline'] or {}).get('score')} agreement={r['agreement']}"
            + (f"  error: {r['error'].splitlines()[0]}" if r["error"] else "")
        )
    print(f"results: {out_dir.resolve()}/results.{{json,md,png}}")
    return 0 if results and all(r["status"] == "passed" for r in results) else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sweep",
        help="PD vs colocated accuracy over a list of configurations (lm-eval)",
        description="For each configuration: colocated baseline and PD deployment, lm-eval "
        "on both, comparison with an expected score; writes results.json/.md/.png. "
        "Arguments after `--` are added to every `vllm serve`.",
    )
    p.add_argument("config", type=Path, help="sweep file (YAML/JSON), see scripts/sweep_configs")
    p.add_argument("--output-dir", type=Path, default=None, help="default runs/sweep/<timestamp>")
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this configuration (repeatable)",
    )
    p.add_argument(
        "--server-cmd", default=None, help="server command template (see `kvshare serve-pd --help`)"
    )
    p.add_argument("--limit", type=checks.positive_float, default=None,
                   help="lm-eval --limit for every config (< 1: a fraction)")  # fmt: skip
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--no-probe", action="store_true", help="skip the greedy probe prompts")
    p.add_argument("--ready-timeout", type=checks.positive_float, default=None)
    p.set_defaults(func=_run, check=_check)
