"""The first token from prefill: a streamed completion's first token reaches the client when
prefill has sampled it, not after decode's first step.

Prefill answers ``max_tokens=1``: it samples the first token. The classic PD proxy (vLLM's
toy proxy, and ours with ``--first-token decode``) drops it, and decode samples it again:
decode loads the prompt's KV, computes the last prompt position once more, and the client's
first token waits for prefill, the way back through the servers, decode's scheduling, the
load and a decode step. Here the proxy streams prefill's token at once and asks decode for
the rest, with that token appended to the prompt's ids. Decode loads the KV of prefill's
prompt (a prefix of its own: ``kv_params.loaded_prompt_tokens``), computes one position, the
first token's, and samples the second. The wait moves from the first token to the second.

Taken only where the client gets what decode would have streamed (otherwise the classic path
runs, unchanged):

* a streamed ``/v1/completions`` request with one text prompt, whose ids prefill handed over
  (``pd_legs``), and a prefill of ours: its ``kv_transfer_params`` carry
  ``remote_prompt_digest``, so the decode reading from it is ours too and takes a prompt
  that extends prefill's;
* sampling that does not depend on where the output starts (``ineligible``): no seed (a
  seeded generator would draw the second token as its first draw), no presence or
  frequency penalty (they count output tokens only), no stop strings (one spanning the
  first two tokens would go unseen), no logprobs, echo, several choices, structured output
  or ``min_tokens``, and at least 2 tokens wanted; unknown fields count as ineligible;
* a first token with complete text (``first_token_of``): not empty, not ending in U+FFFD
  (a character split over two tokens, which decode would then not emit).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvshare_connector.toolkit.pd_legs import make_decode_body, text_prompt

#: Request fields that leave the output the same wherever it starts.
_FREE_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "max_tokens",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",  # counts prompt and output tokens alike
        "logit_bias",
        "allowed_token_ids",
        "stop_token_ids",  # the first token is one: prefill ends there (finish "stop")
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "add_special_tokens",
        "include_stop_str_in_output",  # without stop strings, a stop token's text only
        "priority",
        "user",
        "cache_salt",
        "request_id",
    }
)
#: Fields that are fine at these values only (what clients send as defaults).
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "seed": (None,),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "stop": (None, "", []),
    "n": (None, 1),
    "best_of": (None, 1),
    "logprobs": (None,),
    "prompt_logprobs": (None,),
    "echo": (None, False),
    "min_tokens": (None, 0),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    "return_token_ids": (None, False),
    "return_tokens_as_token_ids": (None, False),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
}


def ineligible(path: str, body: dict[str, Any]) -> str | None:
    """Why this request's first token must come from decode, or None."""
    if not body.get("stream"):
        return "not streamed"
    if not text_prompt(path, body):
        return "not a completion of one text prompt"
    for key, value in body.items():
        if key in _FREE_FIELDS:
            continue
        if key not in _NEUTRAL_VALUES:
            return f"field {key!r}"
        if value not in _NEUTRAL_VALUES[key]:
            return f"{key}={value!r}"
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 2):
        return f"max_tokens={max_tokens!r}"
    return None


@dataclass(frozen=True)
class FirstToken:
    """What prefill's answer says of the token it sampled."""

    token_id: int
    text: str
    finish_reason: str  # "length": more to come; anything else: the answer ends here
    stop_reason: int | str | None  # vLLM's: the stop token id or string, when it ended there
    response_id: str
    created: int
    model: str

    @property
    def ends(self) -> bool:
        return self.finish_reason != "length"


def first_token_of(answer: Any) -> FirstToken | None:
    """The token in prefill's answer, or None where it cannot open the stream."""
    first = first_token_or_why(answer)
    return first if isinstance(first, FirstToken) else None


def first_token_or_why(answer: Any) -> FirstToken | str:
    """The token in prefill's answer, or why it cannot open the stream (no single token
    id, text empty or ending mid-character, an unknown finish): the proxy's log says which,
    for the requests that then take the classic legs."""
    try:
        choice = answer["choices"][0]
        ids, text, finish = choice["token_ids"], choice["text"], choice["finish_reason"]
    except (KeyError, IndexError, TypeError):
        return "prefill's answer has no choice with token_ids, text and finish_reason"
    if not isinstance(ids, list) or len(ids) != 1 or type(ids[0]) is not int or ids[0] < 0:
        return f"prefill's answer has token_ids {ids!r}, not one token id"
    if not isinstance(text, str) or not text:
        return "prefill's token has no text of its own"
    if text.endswith("\ufffd"):
        return "prefill's token ends mid-character"
    if finish not in ("length", "stop"):
        return f"prefill's answer finished with {finish!r}"
    return FirstToken(
        token_id=ids[0],
        text=text,
        finish_reason=finish,
        stop_reason=reason if isinstance(reason := choice.get("stop_reason"), int | str) else None,
        response_id=str(answer.get("id") or ""),
        created=answer.get("created") if type(answer.get("created")) is int else 0,
        model=str(answer.get("model") or ""),
    )


def decode_body_after(
    body: dict[str, Any], kv: dict[str, Any], prompt_ids: list[int], first: FirstToken
) -> dict[str, Any]:
    """The decode leg: the prompt's ids and the first token, one token fewer to generate."""
    decode = make_decode_body(body, kv, [*prompt_ids, first.token_id])
    if decode.get("max_tokens") is not None:
        decode["max_tokens"] -= 1
    return decode


def _event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def opening_events(first: FirstToken, body: dict[str, Any], prompt_tokens: int) -> list[bytes]:
    """The stream's first event, with the token, as vLLM would have sent it; where the token
    ends the answer, also its usage (if asked for) and the end of the stream."""
    options = body.get("stream_options") or {}
    head = {"id": first.response_id, "object": "text_completion", "created": first.created,
            "model": first.model}  # fmt: skip
    choice = {"index": 0, "text": first.text, "logprobs": None,
              "finish_reason": first.finish_reason if first.ends else None,
              "stop_reason": first.stop_reason if first.ends else None,
              "prompt_token_ids": None, "token_ids": None}  # fmt: skip
    chunk: dict[str, Any] = {**head, "choices": [choice]}  # vLLM: usage only if continuous
    if options.get("include_usage") and options.get("continuous_usage_stats"):
        chunk["usage"] = _usage(prompt_tokens, 1)
    events = [_event(chunk)]
    if first.ends:
        if options.get("include_usage"):
            events.append(_event({**head, "choices": [], "usage": _usage(prompt_tokens, 1)}))
        events.append(b"data: [DONE]\n\n")
    return events


def count_first_token_as_output(line: str) -> str:
    """One line of decode's stream, its usage counting the first token as output (decode
    saw it as the last prompt token); every other line as it came."""
    if not line.startswith("data: {") or '"usage"' not in line:
        return line
    try:
        data = json.loads(line[len("data: ") :])
    except ValueError:
        return line
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict):
        return line
    for key, delta in (("prompt_tokens", -1), ("completion_tokens", 1)):
        if type(usage.get(key)) is int:
            usage[key] += delta
    return "data: " + json.dumps(data, separators=(",", ":"))
