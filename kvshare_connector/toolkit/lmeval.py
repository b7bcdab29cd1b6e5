"""Running lm-eval against an OpenAI endpoint (the PD proxy or a colocated server).

lm-eval runs as a subprocess (``python -m lm_eval run``): it is heavy to import, keeps global
state, and its log belongs in a file next to the servers' logs. Requests are sent as text
(``tokenized_requests=False``, no tokenizer backend), so no tokenizer is downloaded; the
server applies its own chat template when ``--apply_chat_template`` sends messages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvshare_connector.toolkit.checks import Range, check_fields

_EVAL_RANGES: dict[str, Range] = {
    "num_fewshot": (0, None, False, True),
    "limit": (0, None, True, False),
    "num_concurrent": (1, None, False, True),
    "max_gen_toks": (1, None, False, True),
    "request_timeout": (1, None, False, False),
    "run_timeout": (0, None, True, False),
}


@dataclass
class EvalSpec:
    """What to evaluate and how. Defaults follow vLLM's own PD accuracy test (gsm8k 5-shot)."""

    task: str = "gsm8k"
    num_fewshot: int | None = 5
    api: str = "auto"  # chat | completions | auto (chat for Gemma-4 models)
    apply_chat_template: bool | None = None  # default: with the chat API
    include_path: str | None = None  # directory with custom task YAMLs (offline tasks)
    limit: float | None = None
    num_concurrent: int = 8
    max_gen_toks: int | None = None
    metric: str = "exact_match,strict-match"
    request_timeout: int = 600
    run_timeout: float = 7200.0
    offline: bool = False  # set HF_*_OFFLINE so lm-eval never reaches the hub
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.api not in ("auto", "chat", "completions"):
            raise ValueError(f"eval api must be auto, chat or completions, not {self.api!r}")
        check_fields(self, "eval ", _EVAL_RANGES)


@dataclass
class EvalResult:
    score: float
    metric: str
    n_samples: int | None
    responses: dict[int, str]  # doc_id -> generated text
    seconds: float
    results_file: str
    samples_file: str | None


class EvalError(RuntimeError):
    """lm-eval failed or wrote no usable results; the message has its log tail."""


def uses_chat(spec: EvalSpec, model: str) -> bool:
    if spec.api != "auto":
        return spec.api == "chat"
    name = model.lower()
    return "gemma-4" in name or "gemma4" in name


def lm_eval_argv(spec: EvalSpec, endpoint: str, model: str, output_dir: Path) -> list[str]:
    """The lm-eval command line for one evaluation of ``endpoint`` (``http://host:port``)."""
    chat = uses_chat(spec, model)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    model_args = [
        f"model={model}",
        f"base_url={endpoint.rstrip('/')}{path}",
        f"num_concurrent={spec.num_concurrent}",
        "max_retries=3",
        "tokenized_requests=False",
        f"timeout={spec.request_timeout}",
    ]
    if not chat:
        model_args.append("tokenizer_backend=None")
    if spec.max_gen_toks is not None:
        model_args.append(f"max_gen_toks={spec.max_gen_toks}")
    argv = [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        "--model",
        "local-chat-completions" if chat else "local-completions",
        "--model_args",
        ",".join(model_args),
        "--tasks",
        spec.task,
        "--output_path",
        str(output_dir),
        "--log_samples",
    ]
    if spec.num_fewshot is not None:
        argv += ["--num_fewshot", str(spec.num_fewshot)]
    apply_template = chat if spec.apply_chat_template is None else spec.apply_chat_template
    if apply_template:
        argv.append("--apply_chat_template")
    if spec.include_path:
        argv += ["--include_path", spec.include_path]
    if spec.limit is not None:  # lm-eval reads < 1 as a fraction, else as a count
        limit = spec.limit
        argv += ["--limit", str(int(limit) if limit >= 1 else limit)]
    return argv + list(spec.extra_args)


def _newest(paths: list[Path]) -> Path | None:
    return max(paths, key=lambda p: p.stat().st_mtime) if paths else None


def parse_output(
    output_dir: Path, task: str, metric: str
) -> tuple[float, int | None, Path, dict[int, str], Path | None]:
    """Score, sample count, results file, responses by doc id, samples file."""
    results_file = _newest(list(output_dir.rglob("results_*.json")))
    if results_file is None:
        raise EvalError(f"lm-eval wrote no results_*.json under {output_dir}")
    data = json.loads(results_file.read_text())
    task_results: dict[str, Any] = data.get("results", {}).get(task, {})
    if metric not in task_results:
        known = sorted(k for k in task_results if "stderr" not in k)
        raise EvalError(f"metric {metric!r} not in lm-eval results for {task}: {known}")
    n = data.get("n-samples", {}).get(task, {}).get("effective")
    samples_file = _newest(list(output_dir.rglob(f"samples_{task}_*.jsonl")))
    responses: dict[int, str] = {}
    if samples_file is not None:
        for line in samples_file.read_text().splitlines():
            if line.strip():
                sample = json.loads(line)
                resps = sample.get("resps") or [[""]]
                responses.setdefault(int(sample["doc_id"]), str(resps[0][0]))
    return float(task_results[metric]), n, results_file, responses, samples_file


def run_lm_eval(spec: EvalSpec, endpoint: str, model: str, work_dir: Path) -> EvalResult:
    """Run lm-eval once; log to ``work_dir/lm_eval.log``, results under ``work_dir/lm_eval``."""
    out = (work_dir / "lm_eval").resolve()
    out.mkdir(parents=True, exist_ok=True)
    log_path = work_dir / "lm_eval.log"
    argv = lm_eval_argv(spec, endpoint, model, out)
    env = dict(os.environ)
    if spec.offline:
        env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        log.write(f"$ {' '.join(argv)}\n".encode())
        log.flush()
        try:
            proc = subprocess.run(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=spec.run_timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise EvalError(f"lm-eval ran longer than {spec.run_timeout}s; log {log_path}") from exc
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise EvalError(f"lm-eval exited with {proc.returncode}; log {log_path}:\n{tail}")
    score, n, results_file, responses, samples_file = parse_output(out, spec.task, spec.metric)
    return EvalResult(
        score=score,
        metric=spec.metric,
        n_samples=n,
        responses=responses,
        seconds=seconds,
        results_file=str(results_file),
        samples_file=str(samples_file) if samples_file else None,
    )


def agreement(a: dict[int, str], b: dict[int, str]) -> float | None:
    """Fraction of documents with identical generations (None when nothing to compare)."""
    common = set(a) & set(b)
    if not common:
        return None
    return sum(a[d] == b[d] for d in common) / len(common)
