"""The first-token hand-off's pieces (toolkit/first_token.py); the proxy flow end to end is in
test_proxy.py, decode's side (a prompt extending prefill's) in test_connector.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvshare_connector.toolkit.first_token import (
    count_first_token_as_output,
    decode_body_after,
    first_token_of,
    ineligible,
    opening_events,
)

#: What `vllm bench serve` sends (openai completions backend), with a temperature.
BENCH = {
    "model": "m",
    "prompt": "some text",
    "repetition_penalty": 1.0,
    "max_tokens": 128,
    "logprobs": None,
    "stream": True,
    "stream_options": {"include_usage": True},
    "ignore_eos": True,
    "temperature": 0.0,
}


def test_what_clients_send_by_default_is_eligible() -> None:
    assert ineligible("/v1/completions", BENCH) is None
    defaults = {"seed": None, "n": 1, "stop": [], "echo": False, "presence_penalty": 0.0,
                "frequency_penalty": 0, "min_tokens": 0, "max_tokens": None}  # fmt: skip
    assert ineligible("/v1/completions", {**BENCH, **defaults}) is None


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"stream": False}, "not streamed"),
        ({"prompt": [1, 2, 3]}, "not a completion of one text prompt"),
        ({"echo": True}, "not a completion of one text prompt"),
        ({"seed": 0}, "seed=0"),
        ({"stop": "\n"}, "stop='\\n'"),
        ({"logprobs": 0}, "logprobs=0"),
        ({"n": 2}, "n=2"),
        ({"presence_penalty": 0.1}, "presence_penalty=0.1"),
        ({"min_tokens": 4}, "min_tokens=4"),
        ({"max_tokens": 1}, "max_tokens=1"),
        ({"response_format": {"type": "json_object"}}, "field 'response_format'"),
        ({"some_new_field": 1}, "field 'some_new_field'"),
    ],
)
def test_what_could_change_the_output_is_named(change: dict[str, Any], why: str) -> None:
    assert ineligible("/v1/completions", {**BENCH, **change}) == why
    assert ineligible("/v1/chat/completions", BENCH) == "not a completion of one text prompt"


def _answer(**choice: Any) -> dict[str, Any]:
    base = {"text": " Hello", "token_ids": [42], "finish_reason": "length", "stop_reason": None}
    return {"id": "cmpl-r1", "created": 5, "model": "m", "choices": [{**base, **choice}]}


def test_prefills_token_opens_the_stream_only_when_whole() -> None:
    first = first_token_of(_answer())
    assert first is not None and (first.token_id, first.text, first.ends) == (42, " Hello", False)
    assert first_token_of(_answer(finish_reason="stop")).ends  # type: ignore[union-attr]
    for bad in (
        {"text": "caf\ufffd"},  # a character split over two tokens
        {"text": ""},  # a special token, or one held back by the detokenizer
        {"token_ids": [1, 2]},
        {"token_ids": None},
        {"token_ids": [-1]},
        {"finish_reason": "abort"},
    ):
        assert first_token_of(_answer(**bad)) is None, bad
    assert first_token_of({"choices": []}) is None
    assert first_token_of("not an answer") is None


def _events(raw: list[bytes]) -> list[Any]:
    text = b"".join(raw).decode()
    return [x[len("data: ") :] for x in text.split("\n\n") if x]


def test_opening_events_are_vllms_chunks() -> None:
    first = first_token_of(_answer())
    assert first is not None
    body = {"stream_options": {"include_usage": True}}
    (chunk,) = (json.loads(e) for e in _events(opening_events(first, body, 7)))
    assert chunk["id"] == "cmpl-r1" and chunk["object"] == "text_completion"
    want = {"index": 0, "text": " Hello", "logprobs": None, "finish_reason": None}
    assert chunk["choices"] == [{**want, "stop_reason": None}]
    assert chunk["usage"] is None
    continuous = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    (chunk,) = (json.loads(e) for e in _events(opening_events(first, continuous, 7)))
    assert chunk["usage"] == {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}

    # A token that ends the answer: the whole stream, usage and all.
    ending = first_token_of(_answer(finish_reason="stop", stop_reason=2))
    assert ending is not None
    *chunks, done = _events(opening_events(ending, body, 7))
    assert done == "[DONE]"
    head, usage = (json.loads(c) for c in chunks)
    assert head["choices"][0]["finish_reason"] == "stop" and head["choices"][0]["stop_reason"] == 2
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 1
    assert _events(opening_events(ending, {}, 7))[-1] == "[DONE]"
    assert len(_events(opening_events(ending, {}, 7))) == 2  # no usage asked for


def test_decode_counts_the_first_token_as_output() -> None:
    usage = {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12}
    line = "data: " + json.dumps({"choices": [], "usage": usage})
    fixed = json.loads(count_first_token_as_output(line)[len("data: ") :])["usage"]
    assert fixed == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    for same in ('data: {"choices":[{"text":" a"}],"usage":null}', "data: [DONE]", "",
                 'data: {"usage": bad json', ": ping"):  # fmt: skip
        assert count_first_token_as_output(same) == same


def test_decodes_leg_appends_the_token_and_wants_one_fewer() -> None:
    first = first_token_of(_answer())
    assert first is not None
    kv = {"remote_request_id": "r1"}
    body = dict(BENCH)
    leg = decode_body_after(body, kv, [5, 6], first)
    assert leg["prompt"] == [5, 6, 42] and leg["max_tokens"] == 127
    assert leg["kv_transfer_params"] is kv and leg["stream"] is True
    assert body == BENCH  # the client's body is left as it came
    unbounded = decode_body_after({**BENCH, "max_tokens": None}, kv, [5], first)
    assert unbounded["max_tokens"] is None
