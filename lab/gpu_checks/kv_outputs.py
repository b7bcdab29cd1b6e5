"""Decode's outputs next to the colocated engine's, and next to that engine's own noise.

Byte-equal KV does not make outputs equal: the same engine gives other logprobs for the same
prompt batched or alone (other kernels, other reduction orders), and greedy decoding turns a
near-tie into another token. So a PD output difference means something only against that
noise floor, and only if a load of wrong KV (the negative control) differs by much more.

    python -m lab.gpu_checks.kv_outputs OUT/<cell>   # after kv_exact run --outputs

Reads ``colocated.json`` (written by kv_exact's colocated engine: the main batch batched and
one prompt at a time, the control batch batched) and ``decode.result.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lab.gpu_checks.cells import read_json, write_json


def colocated_main(
    args: argparse.Namespace, weights: Path, prompts: Callable[[str], list[list[int]]]
) -> None:
    """The colocated engine (no connector): the main batch batched, then one prompt at a
    time (the noise floor), then the control batch; writes ``colocated.json``."""
    from lab.gpu_checks.engines import generate_tokens, start_engine

    llm, startup = start_engine(
        weights, args, None, load_format="auto", max_model_len=4096, jit_monitor=False
    )
    max_tokens = args.max_tokens
    out: dict[str, Any] = {"startup_s": startup}
    out["main"] = generate_tokens(llm, prompts("main"), None, max_tokens)
    alone = [generate_tokens(llm, [p], None, max_tokens) for p in prompts("main")]
    out["main_alone"] = {
        "tokens": [a["tokens"][0] for a in alone],
        "logprobs": [a["logprobs"][0] for a in alone],
    }
    out["control"] = generate_tokens(llm, prompts("control"), None, max_tokens)
    write_json(Path(args.work) / "colocated.json", out)


def divergence(
    a_tokens: list[list[int]],
    a_logprobs: list[list[float]],
    b_tokens: list[list[int]],
    b_logprobs: list[list[float]],
) -> list[dict[str, Any]]:
    """Per prompt: tokens equal before the first difference, and how far the logprobs of
    the chosen tokens are apart at the first token and over the common prefix."""
    out = []
    for ta, la, tb, lb in zip(a_tokens, a_logprobs, b_tokens, b_logprobs, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), None)
        prefix = min(len(ta), len(tb)) if same is None else same
        common = range(max(prefix, 1))
        out.append(
            {
                "tokens": len(ta),
                "same_prefix": prefix,
                "first_logprob_diff": abs(la[0] - lb[0]) if la and lb else None,
                "max_logprob_diff": max(abs(la[i] - lb[i]) for i in common) if la and lb else None,
            }
        )
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    firsts = [r["first_logprob_diff"] for r in rows if r["first_logprob_diff"] is not None]
    return {
        "prompts": len(rows),
        "identical": sum(r["same_prefix"] == r["tokens"] for r in rows),
        "same_prefix": [r["same_prefix"] for r in rows],
        "first_logprob_diff_max": max(firsts) if firsts else None,
        "first_logprob_diff_median": statistics.median(firsts) if firsts else None,
    }


def compare_outputs(decode: dict[str, Any], colocated: dict[str, Any]) -> dict[str, Any]:
    """``pd``: decode vs colocated (main); ``noise``: colocated batched vs alone (main);
    ``control``: decode on scrambled KV vs colocated (control); and whether the check can
    tell: the control must sit above the noise floor, and PD within it."""

    def rows(x: dict, y: dict) -> list[dict[str, Any]]:
        return divergence(x["tokens"], x["logprobs"], y["tokens"], y["logprobs"])

    pd = summarize(rows(decode["main"], colocated["main"]))
    noise = summarize(rows(colocated["main"], colocated["main_alone"]))
    control = summarize(rows(decode["control"], colocated["control"]))
    floor = noise["first_logprob_diff_max"] or 0.0
    return {
        "pd_vs_colocated": pd,
        "noise_floor": noise,
        "control_vs_colocated": control,
        "control_above_floor": (control["first_logprob_diff_max"] or 0.0) > floor,
        "pd_within_floor": (pd["first_logprob_diff_max"] or 0.0) <= floor,
    }


def table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown: one row per cell and comparison."""
    lines = [
        "| cell | comparison | prompts identical | tokens equal before first difference "
        "| first-token logprob diff, max / median |",
        "|---|---|---|---|---|",
    ]
    names = {
        "pd_vs_colocated": "PD decode vs colocated",
        "noise_floor": "colocated batched vs alone (noise floor)",
        "control_vs_colocated": "scrambled-KV control vs colocated",
    }
    for cell, result in results.items():
        for key, label in names.items():
            s = result[key]
            first = s["first_logprob_diff_max"]
            median = s["first_logprob_diff_median"]
            lines.append(
                f"| {cell} | {label} | {s['identical']}/{s['prompts']} | {s['same_prefix']} "
                f"| {first:.4f} / {median:.4f} |"
                if first is not None
                else f"| {cell} | {label} | {s['identical']}/{s['prompts']} | - | - |"
            )
    return "\n".join(lines)


def main() -> int:
    results = {}
    for arg in sys.argv[1:]:
        work = Path(arg)
        decode = read_json(work / "decode.result.json")
        results[work.name] = compare_outputs(decode, read_json(work / "colocated.json"))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
