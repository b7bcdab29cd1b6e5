"""The fake servers' "model": a deterministic generation and tokenizer (fake_vllm_server.py).

Generation is derived from the prompt, so PD output can be compared with the colocated
baseline: the last ``a <op> b`` in the prompt is answered as ``#### n`` (wrong on purpose
when ``a + b`` is divisible by 3, so accuracy is neither 0 nor 1).

The tokenizer has one id per character for prompts, and one id per generated word above
the characters' range (``word_id``), so a prompt of ids can carry words the model generated:
the first-token hand-off appends prefill's first token to decode's prompt, and the fake
continues the same generation after it, as a model would.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from typing import Any

_ARITH = re.compile(r"(-?\d+)\s*([+*-])\s*(-?\d+)")
TOKEN = re.compile(r"\s*\S+|\s+")
_FIRST_WORD_ID = 0x110000  # past the last Unicode code point: never a character's id


def fake_answer(a: int, op: str, b: int) -> int:
    """The fake model's answer: right unless ``a + b`` is divisible by 3."""
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return value + 1 if (a + b) % 3 == 0 else value


def fake_text(prompt: str) -> str:
    """Deterministic "generation" for a prompt (before stop strings and max_tokens)."""
    found = _ARITH.findall(prompt)
    if found:
        a, op, b = found[-1]
        n = fake_answer(int(a), op, int(b))
        return f" The answer is {n}. #### {n}\n\nQuestion: what next?"
    h = zlib.crc32(prompt.encode())
    return " " + " ".join(f"w{(h >> s) & 0xFF}" for s in range(0, 24, 3)) + "\n\nQuestion:"


def fake_tokens(
    prompt: str, max_tokens: int | None, stop: list[str], corrupt: bool = False
) -> tuple[list[str], str]:
    """Tokens (whitespace-led words) and finish reason, honouring stop strings and max_tokens.

    ``corrupt`` imitates a decode that attended to the wrong KV: every number shifts by 2.
    """
    text = fake_text(prompt)
    if corrupt:
        text = re.sub(r"-?\d+", lambda m: str(int(m.group()) + 2), text)
    finish = "length"
    cut = [text.find(s) for s in stop if s and s in text]
    if cut:
        text, finish = text[: min(cut)], "stop"
    tokens = TOKEN.findall(text)
    if max_tokens is not None and len(tokens) > max_tokens:
        tokens, finish = tokens[:max_tokens], "length"
    elif not cut:
        finish = "stop"
    return tokens, finish


def token_logprob(token: str) -> float:
    return -((zlib.crc32(token.encode()) % 1000) / 1000.0)


def word_id(word: str) -> int:
    """The id of a generated word (what ``return_token_ids`` answers for output tokens):
    above every character's, and the same in every process (prefill and decode fakes)."""
    return _FIRST_WORD_ID + zlib.crc32(word.encode()) % (1 << 20)


def split_prompt(body: dict[str, Any], chat: bool) -> tuple[str, list[int]]:
    """The prompt's text, and the ids of generated words a prompt of ids ends with (the
    first-token hand-off). Ids are read back with the fake vocabulary, so ids a prefill
    answered give its text again."""
    if chat:
        return "\n".join(str(m.get("content", "")) for m in body.get("messages", [])), []
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list):
            ids = [int(t) for t in prompt]
            cut = next((i for i, t in enumerate(ids) if t >= _FIRST_WORD_ID), len(ids))
            return "".join(chr(t) for t in ids[:cut]), ids[cut:]
    return str(prompt), []


def prompt_of(body: dict[str, Any], chat: bool) -> str:
    return split_prompt(body, chat)[0]


def fake_token_ids(text: str) -> list[int]:
    """The fake tokenizer: one id per character (what ``return_token_ids`` answers)."""
    return [ord(c) for c in text]


def digest(body: dict[str, Any], chat: bool) -> str:
    """Of the prompt as the engine sees it: text and its token ids digest alike; generated
    words a prompt ends with are not part of it (their KV is decode's to compute)."""
    payload = body.get("messages") if chat else prompt_of(body, chat)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
