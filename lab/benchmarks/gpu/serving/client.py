"""``vllm bench serve`` for the serving benchmark: its arguments, and how it is run (a
long-lived bench_worker.py by default, a fresh command per run with ``--bench-cmd``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvshare_connector.toolkit.tokenizer import SPECIAL_TOKENS

WORKER = Path(__file__).resolve().parent / "bench_worker.py"
IMPORT_GRACE_S = 180.0  # the worker's first import of vLLM, on top of a run's own timeout


def bench_options(
    args: argparse.Namespace, endpoint: str, name: str, tokenizer: Path, run: dict[str, Any],
    raw: Path,
) -> list[str]:  # fmt: skip
    """One ``vllm bench serve``'s options: random dataset, fixed lengths, saved result JSON
    (``--save-detailed`` adds per-request start times, TTFTs and errors)."""
    argv = [
        "--backend", "openai", "--base-url", endpoint, "--endpoint", "/v1/completions",
        "--model", args.served_model_name, "--tokenizer", str(tokenizer),
        "--dataset-name", "random", "--random-input-len", str(run["input_len"]),
        "--random-output-len", str(run["output_len"]), "--random-range-ratio", "0",
        "--num-prompts", str(run["num_prompts"]), "--max-concurrency", str(run["concurrency"]),
        "--request-rate", str(run.get("request_rate", "inf")), "--seed", str(run["seed"]),
        "--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99", "--disable-tqdm", "--save-result",
        "--result-dir", str(raw / Path(run["file"]).parent),
        "--result-filename", Path(run["file"]).name, "--label", name,
        "--ready-check-timeout-sec", "0",
        "--metadata", f"kvshare_deployment={name}", f"kvshare_round={run['round']}",
    ]  # fmt: skip
    if run.get("detailed") or getattr(args, "save_detailed", False):
        argv.append("--save-detailed")
    if getattr(args, "random_prefix_len", 0):  # a prefix shared by the run's prompts
        argv += ["--random-prefix-len", str(args.random_prefix_len)]
    below = getattr(args, "sample_ids_below", 0)
    if below:
        allowed = list(range(len(SPECIAL_TOKENS), below))  # ids with text in the local BPE
        argv += ["--extra-body", json.dumps({"allowed_token_ids": allowed})]
    return argv


class BenchClient:
    """Runs benches one at a time; a run past its timeout is killed (rc 124) and, for the
    worker, the worker is restarted on the next run."""

    def __init__(self, raw: Path, bench_cmd: str | None, impl: str | None = None) -> None:
        self.raw, self.bench_cmd, self.impl = raw, bench_cmd, impl
        self.worker: subprocess.Popen[bytes] | None = None
        self.worker_log = raw / "logs" / "bench" / "worker.log"
        self.jobs = 0

    def start(self) -> None:
        """Start the worker now (its vLLM import overlaps the engines' startup)."""
        if self.bench_cmd or (self.worker and self.worker.poll() is None):
            return
        self.worker_log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(WORKER)] + (["--impl", self.impl] if self.impl else [])
        with open(self.worker_log, "ab") as log:
            self.worker = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env=dict(os.environ),
            )  # fmt: skip

    def _ready(self) -> bool:
        try:
            return b"bench worker ready" in self.worker_log.read_bytes()
        except OSError:
            return False

    def run(self, options: list[str], log: Path, timeout: float) -> int:
        log.parent.mkdir(parents=True, exist_ok=True)
        if self.bench_cmd:
            return self._run_command(options, log, timeout)
        self.start()
        assert self.worker is not None and self.worker.stdin is not None
        self.jobs += 1
        done = self.raw / "logs" / "bench" / f".done-{self.jobs}.json"
        job = {"argv": options, "log": str(log), "done": str(done)}
        try:
            self.worker.stdin.write((json.dumps(job) + "\n").encode())
            self.worker.stdin.flush()
        except OSError:
            self._kill_worker()
            return 1
        t0 = time.monotonic()
        while not done.exists():
            waited = time.monotonic() - t0
            if self.worker.poll() is not None:
                self.worker = None
                return 1
            if waited > timeout + (0 if self._ready() else IMPORT_GRACE_S):
                self._kill_worker()
                return 124
            time.sleep(0.1)
        rc = int(json.loads(done.read_text())["rc"])
        done.unlink()
        return rc

    def _run_command(self, options: list[str], log: Path, timeout: float) -> int:
        argv = shlex.split(self.bench_cmd.format(python=sys.executable)) + options
        with open(log, "ab") as out:
            out.write(f"$ {shlex.join(argv)}\n".encode())
            out.flush()
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return 124
        finally:
            _kill_group(proc)

    def _kill_worker(self) -> None:
        if self.worker is not None:
            _kill_group(self.worker)
            self.worker = None

    def close(self) -> None:
        if self.worker is not None and self.worker.stdin is not None:
            with contextlib.suppress(OSError):
                self.worker.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.worker.wait(timeout=5)
        self._kill_worker()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
