"""kv_exact's shared-prefix batches (issue 50, ``--prefix``): prompts whose start decode holds.

``prefix``: prompt i is the main batch's prompt i up to ``shared`` of its tokens, then tokens
of its own, as long. Decode runs it after the main batch, so its prefix cache holds the shared
part (in the full-attention groups; a sliding-window group holds a window, which a prompt of
its own tail never hits): each load must read only what its hit leaves (the read log's
``tokens_hit`` and ``tokens_loaded``), fewer bytes than the main load of the same length (the
no-hit control), and land byte for byte. Prefill, with prefix caching on as well, serves its
own hit's blocks. ``prefix-control``: the same shared starts with other tails, loaded with
each group's block ids rotated: the byte check must find it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lab.gpu_checks.cells import token_prompts

BATCHES = ("prefix", "prefix-control")
SHARED = 0.75  # of each prompt, rounded down to ALIGN tokens
ALIGN = 64


def shared(length: int) -> int:
    return int(length * SHARED) // ALIGN * ALIGN


def prompts(batch: str, main: Sequence[Sequence[int]], vocab: int) -> list[list[int]]:
    """``batch``'s prompts: main's shared starts, each with a tail of the batch's own."""
    tails = token_prompts(f"kv-exact-{batch}", [len(p) - shared(len(p)) for p in main], vocab)
    return [list(p[: shared(len(p))]) + t for p, t in zip(main, tails, strict=True)]


def problems(requests: list[dict[str, Any]], read_log: list[dict[str, Any]]) -> list[str]:
    """Each prefix load: a hit on the shared start (and no further), the rest loaded, fewer
    bytes than the main batch's load of the same length. (The byte checks of the prefix and
    prefix-control loads are kv_exact's, as for main and control.)"""
    batch_of = {r["request_id"]: r["batch"] for r in requests}
    tokens_of = {r["request_id"]: r.get("num_tokens") for r in requests}
    main_bytes = {
        tokens_of[r["request_id"]]: r["bytes"]
        for r in read_log
        if batch_of.get(r["request_id"]) == "main"
    }
    out, seen = [], 0
    for r in read_log:
        if batch_of.get(r["request_id"]) != "prefix":
            continue
        seen += 1
        n, hit, loaded = tokens_of[r["request_id"]], r.get("tokens_hit"), r.get("tokens_loaded")
        where = f"prefix {r['request_id']} ({n} tokens)"
        if hit is None or loaded is None or n is None:
            out.append(f"{where}: the read log has no token counts")
        elif not 0 < hit <= shared(n):
            out.append(f"{where}: {hit} tokens hit, of {shared(n)} shared")
        elif hit + loaded != n:
            out.append(f"{where}: {hit} hit + {loaded} loaded is not the prompt")
        elif not r["bytes"] < main_bytes.get(n, 0):
            out.append(f"{where}: {r['bytes']} bytes read, main's load {main_bytes.get(n)}")
    expected = sum(b == "prefix" for b in batch_of.values())
    if seen != expected or not expected:
        out.append(f"prefix: {seen} loads in the read log, {expected} compared")
    return out
