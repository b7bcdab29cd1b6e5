"""Warmup that checks generations: a handful of greedy requests per deployment, the same
token-id prompts for every deployment, each answer checked (HTTP 200, exactly the asked
number of tokens, no ``kv_load_error``), texts compared across deployments.

A warmup is what the first requests of an engine need anyway (kernels compile, NIXL
handshakes); doing it with a few direct requests instead of a ``vllm bench serve`` run keeps
it to seconds, and makes it the place where a broken deployment shows before any timing.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx


def prompt_ids(seed: int, count: int, length: int, vocab: int) -> list[list[int]]:
    """Deterministic random prompts of token ids in [16, vocab) (clear of special ids)."""
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(length)] for _ in range(count)]


async def _one(
    client: httpx.AsyncClient, sem: asyncio.Semaphore, body: dict[str, Any]
) -> dict[str, Any]:
    async with sem:
        t0 = time.perf_counter()
        rec: dict[str, Any] = {"start": time.time()}
        try:
            resp = await client.post("/v1/completions", json=body)
            rec["status"] = resp.status_code
            is_json = resp.headers.get("content-type", "").startswith("application/json")
            data = resp.json() if is_json else None
            if resp.status_code == 200 and isinstance(data, dict):
                rec["text"] = data["choices"][0].get("text")
                rec["token_ids"] = data["choices"][0].get("token_ids")
                rec["completion_tokens"] = (data.get("usage") or {}).get("completion_tokens")
                kv = data.get("kv_transfer_params") or {}
                rec["kv_load_error"] = kv.get("kv_load_error")
            else:
                rec["error"] = resp.text[:300]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            rec.update(status=None, error=f"{type(exc).__name__}: {exc}"[:300])
        rec["seconds"] = time.perf_counter() - t0
        return rec


async def _send(
    endpoint: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
    timeout: float,
) -> list[dict[str, Any]]:  # fmt: skip
    sem = asyncio.Semaphore(max(1, concurrency))
    async with httpx.AsyncClient(base_url=endpoint, timeout=timeout) as client:
        bodies = [
            # Token ids back: a model whose vocabulary outgrows the tokenizer (random-init
            # E2B shape with the local 4k tokenizer) generates ids that decode to no text.
            dict(
                model=model,
                prompt=ids,
                max_tokens=max_tokens,
                temperature=0,
                ignore_eos=True,
                return_token_ids=True,
            )
            for ids in prompts
        ]
        return list(await asyncio.gather(*(_one(client, sem, b) for b in bodies)))


def send_checks(
    endpoint: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
    timeout: float,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every prompt once, at most ``concurrency`` at a time, each bounded by ``timeout``."""
    return asyncio.run(_send(endpoint, model, prompts, max_tokens, concurrency, timeout))


def judge(records: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """How many answers are right, and why the others are not."""
    problems = []
    for i, r in enumerate(records):
        if r.get("status") != 200:
            problems.append(f"#{i}: HTTP {r.get('status')} {r.get('error', '')}".strip())
        elif r.get("completion_tokens") != max_tokens:
            problems.append(f"#{i}: {r.get('completion_tokens')} tokens, asked {max_tokens}")
        elif r.get("token_ids") is not None and len(r["token_ids"]) != max_tokens:
            problems.append(f"#{i}: {len(r['token_ids'])} token ids, asked {max_tokens}")
        elif r.get("token_ids") is None and not r.get("text"):
            problems.append(f"#{i}: empty text")
        elif r.get("kv_load_error"):
            problems.append(f"#{i}: kv_load_error {r['kv_load_error']}")
    return {"requests": len(records), "ok": len(records) - len(problems), "problems": problems}


def agreement(by_name: dict[str, list[dict[str, Any]]], base: str) -> dict[str, float | None]:
    """Per deployment, the fraction of prompts whose greedy output (token ids where the server
    returned them, else text) equals ``base``'s (random weights: PD and colocated may differ
    by a token where logits tie; this is evidence, not a pass/fail check)."""
    ref = by_name.get(base)
    out: dict[str, float | None] = {}
    for name, recs in by_name.items():
        if name == base or not ref:
            continue
        pairs = [(_output(a), _output(b)) for a, b in zip(recs, ref, strict=False)]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
        out[name] = sum(a == b for a, b in pairs) / len(pairs) if pairs else None
    return out


def _output(record: dict[str, Any]) -> Any:
    ids = record.get("token_ids")
    return tuple(ids) if ids is not None else record.get("text")
