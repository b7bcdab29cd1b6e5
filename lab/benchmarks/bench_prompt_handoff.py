#!/usr/bin/env python3
"""What decode's server spends on a completion's prompt before decode's engine sees it, with
and without the proxy's token-id hand-off (toolkit/pd_legs.py; issue 21: "prefill answered ->
decode order" grew with the prompt, 9 ms at 1k and 19 ms at 4k at concurrency 1).

Given text, vLLM's server tokenizes it (a Hugging Face fast tokenizer); given prefill's ids,
it only parses them from JSON. Per prompt length, in rotated order over ``--rounds`` rounds:
``encode`` (tokenizing the text), ``json ids`` (dumping and loading a body with the ids) and
``json text`` (the same with the text). The tokenizer is the serving benchmark's own small BPE
vocabulary (toolkit/tokenizer.py, what bench_serving uses for random-init weights); a model's
real vocabulary (Gemma's 262k) tokenizes at its own speed: pass ``--tokenizer DIR``.

    .venv/bin/python -m lab.benchmarks.bench_prompt_handoff --rounds 5 --out results/cpu/DATE
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

LENGTHS = (1024, 4096, 16384, 32768)


def tokenizer(path: str | None, vocab: int) -> Any:
    from transformers import AutoTokenizer

    if path is None:
        from kvshare_connector.toolkit.tokenizer import write_tokenizer

        path = str(Path(tempfile.mkdtemp(prefix="kvshare-bench-tok-")) / "tok")
        write_tokenizer(Path(path), vocab, 1 << 17)
    return AutoTokenizer.from_pretrained(path)


def timed(work: Any, repeat: int) -> float:
    """Seconds per call, the fastest of ``repeat`` (other work on the host only adds time)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(tok: Any, length: int, seed: int, repeat: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    text = tok.decode(rng.integers(10, len(tok) - 10, length).tolist())
    ids = tok(text).input_ids
    return {
        "tokens": len(ids),
        "encode": timed(lambda: tok(text).input_ids, repeat),
        "json ids": timed(lambda: json.loads(json.dumps({"prompt": ids})), repeat),
        "json text": timed(lambda: json.loads(json.dumps({"prompt": text})), repeat),
    }


def cell(rows: list[dict[str, Any]], key: str) -> str:
    v = [r[key] * 1e3 for r in rows]
    return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| prompt (random ids) | tokens after re-encoding | encode ms | json ids ms | "
        "json text ms | hand-off saves ms |",
        "|---|---|---|---|---|---|",
    ]
    for length in sorted({r["length"] for r in rows}):
        got = [r for r in rows if r["length"] == length]
        saved = [(r["encode"] + r["json text"] - r["json ids"]) * 1e3 for r in got]
        out.append(
            f"| {length} | {got[0]['tokens']} | {cell(got, 'encode')} | {cell(got, 'json ids')} | "
            f"{cell(got, 'json text')} | {statistics.median(saved):.1f} |"
        )
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3, help="calls per measure (fastest)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory")
    parser.add_argument("--vocab", type=int, default=4096, help="the small BPE's size")
    parser.add_argument("--out", default=None, help="folder for prompt_handoff.md/.json")
    args = parser.parse_args()
    tok = tokenizer(args.tokenizer, args.vocab)
    rows = []
    for rnd in range(args.rounds):
        k = rnd % len(args.lengths)
        for length in args.lengths[k:] + args.lengths[:k]:
            rows.append({"round": rnd, "length": length,
                         **measure(tok, length, 1000 * rnd + length, args.repeat)})  # fmt: skip
    text = table(rows)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        head = (
            f"# The prompt on its way to decode: tokenize again, or parse prefill's ids\n\n"
            f"`python -m lab.benchmarks.bench_prompt_handoff --rounds {args.rounds} --out {out}`, "
            f"{time.strftime('%Y-%m-%d')}, tokenizer: "
            f"{args.tokenizer or f'the serving benchmark BPE, vocab {args.vocab}'}; "
            f"ms per prompt, median over {args.rounds} rounds (min-max), each the fastest of "
            f'{args.repeat} calls. "hand-off saves" = encode + json text - json ids.\n\n'
        )
        (out / "prompt_handoff.md").write_text(head + text + "\n")
        (out / "prompt_handoff.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
