"""What the GPU checks share about a cell: its directory, its engines' environment, its
token-id prompts, and the JSON files its two engines hand each other."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def cell_dir(out: Path, name: str) -> Path:
    """``out/<name>`` with the name's ``/`` and ``:`` made safe for a directory name."""
    return out / name.replace("/", "__").replace(":", "_")


def cell_env(cell: dict[str, Any]) -> dict[str, str]:
    """The engines' environment: the model runner the cell names (``v1``/``v2``), v1 under
    kvcached (0.1.6 refuses the V2 runner), else vLLM's own choice (0.33: V2 for these
    models, 0.26: V1); and kvcached. Which runner ran is in each engine's record."""
    env = {"ENABLE_KVCACHED": "true" if cell.get("kvcached") else "false"}
    runner = cell.get("runner") or ("v1" if cell.get("kvcached") else None)
    if runner is not None:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    if cell.get("kvcached"):
        env["KVCACHED_CONTIGUOUS_LAYOUT"] = str(cell["kvcached"] == "contiguous").lower()
    return env


def token_prompts(seed: str, lengths: Sequence[int], vocab: int) -> list[list[int]]:
    """Random token ids (3 and up: no special token), one prompt per length; a batch seeds
    its own, so batches share no prefix (no prefix-cache hit between them)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def write_json(path: Path, data: Any) -> None:
    """JSON another process polls for: it appears whole."""
    from kvshare_connector.common.files import write_atomic

    write_atomic(path, json.dumps(data))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines file's records; none when it is not there."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file's object; empty when it is not there (an engine that died first)."""
    return json.loads(path.read_text()) if path.exists() else {}


def serve_until_stopped(work: Path, hold_s: float) -> float:
    """Prefill: keep the engine (and its held KV) up until decode is done (``work/stop``)
    or ``hold_s``; the seconds it held."""
    started = time.monotonic()
    while time.monotonic() < started + hold_s and not (work / "stop").exists():
        time.sleep(0.2)  # the engine keeps serving reads
    return time.monotonic() - started


def prefill_output(work: Path, hold_s: float) -> dict[str, Any]:
    """Decode: what prefill wrote (its batches' kv_transfer_params), once it is there."""
    deadline = time.monotonic() + hold_s
    while not (work / "prefill.json").exists():
        if time.monotonic() > deadline:
            raise TimeoutError("prefill never wrote its kv_transfer_params")
        time.sleep(0.2)
    return json.loads((work / "prefill.json").read_text())
