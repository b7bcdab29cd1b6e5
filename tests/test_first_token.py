"""The first-token hand-off (toolkit/first_token.py): its pieces, then the proxy's flow against
fake servers; decode's side (a prompt extending prefill's) is in test_connector.py."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from kvshare_connector.toolkit.first_token import (
    count_first_token_as_output,
    decode_body_after,
    first_token_of,
    first_token_or_why,
    ineligible,
    opening_events,
)
from kvshare_connector.toolkit.procs import pick_free_port
from kvshare_connector.toolkit.proxy import create_app

from .support.fake_model import word_id
from .support.fake_vllm_server import ThreadServer, fake_server, fake_token_ids
from .support.pd_stack import QUESTION, fast, pd_stack, sse_events

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
    ids = {"prompt_token_ids": None, "token_ids": None}
    assert chunk["choices"] == [{**want, "stop_reason": None, **ids}]
    assert "usage" not in chunk  # as vLLM's chunks (model_dump_json(exclude_unset=True))
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


# ---- through the proxy, against fake servers -----------------------------------------


def _stream(url: str, body: dict[str, Any]) -> list[Any]:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        return sse_events(resp.read().decode())


@pytest.mark.parametrize("first_token", ["prefill", "decode"])
def test_completion_streaming_matches_colocated(first_token: str) -> None:
    """The client's stream is colocated's: the same text token by token and the same usage.
    With the first token from prefill, decode's prompt is prefill's ids and that token, one
    token fewer to generate; from decode (the control), the ids and the client's count."""
    ftp = first_token == "prefill"
    body = {
        "prompt": QUESTION,
        "max_tokens": 20,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    with (
        pd_stack(first_token_from_prefill=ftp) as (url, prefills, decodes),
        fake_server("colocated") as colo,
    ):
        pd = _stream(url, body)
        base = _stream(colo.url, body)
    text = [c["choices"][0]["text"] for c in pd if c["choices"]]
    assert len(text) > 3  # token by token, not one blob
    assert text == [c["choices"][0]["text"] for c in base if c["choices"]]
    assert pd[-1]["usage"] == base[-1]["usage"]  # the first token counted as output
    assert prefills[0].state.requests[0]["body"]["stream"] is False
    (dec,) = [r["body"] for r in decodes[0].state.requests]
    if ftp:
        assert pd[0]["choices"][0]["text"] == text[0] == " The"
        assert dec["prompt"] == [*fake_token_ids(QUESTION), word_id(" The")]
        assert dec["max_tokens"] == 19
    else:
        assert dec["prompt"] == fake_token_ids(QUESTION) and dec["max_tokens"] == 20


def test_the_first_token_reaches_the_client_before_decode_answers() -> None:
    """Decode answers nothing until the test lets it: the client has prefill's token by
    then (the control, the first token from decode, has nothing to read: its read times
    out)."""
    body = {"prompt": QUESTION, "max_tokens": 5, "stream": True}
    for ftp in (True, False):
        gate = threading.Event()
        with pd_stack(first_token_from_prefill=ftp) as (url, _, decodes):
            decodes[0].state.gate = gate
            try:
                with httpx.stream(
                    "POST", url + "/v1/completions", json=body, timeout=2.0
                ) as resp:
                    lines = resp.iter_lines()
                    first = next(line for line in lines if line.startswith("data: "))
                    assert ftp, "the client had a token before decode answered"
                    assert json.loads(first[6:])["choices"][0]["text"] == " The"
                    assert decodes[0].state.hits["completions"] <= 1  # asked, not answered
                    gate.set()
                    rest = [line for line in lines if line.startswith("data: ")]
            except httpx.ReadTimeout:
                assert not ftp, "the first token from prefill waited for decode"
                gate.set()
                continue
        texts = [json.loads(x[6:])["choices"][0]["text"] for x in rest[:-1]]
        assert "".join([" The", *texts]) == " The answer is 10. ####"
        assert rest[-1] == "data: [DONE]"


@pytest.mark.parametrize(
    "change",
    [
        {"stream": False},
        {"seed": 7},
        {"stop": ["Question:"]},
        {"logprobs": 1},
        {"max_tokens": 1},
        {"frequency_penalty": 0.5},
        {"prompt": [5, 6, 7]},
        {"response_format": {"type": "json_object"}},
        "prefill_of_elsewhere",
    ],
    ids=lambda c: next(iter(c)) if isinstance(c, dict) else c,
)
def test_the_first_token_comes_from_decode_where_the_output_could_differ(
    change: Any, caplog: Any
) -> None:
    """Requests whose output could depend on where it starts, and a prefill that does not
    state its prompt (NIXL's: its decode would not take a longer prompt), keep the classic
    legs: decode gets the client's token count and no token appended; the proxy's log line
    says why (a prompt given as ids has none to give: no ids to hand decode either)."""
    body = {"prompt": QUESTION, "max_tokens": 6, "stream": True}
    kwargs = {"kvshare_params": False} if change == "prefill_of_elsewhere" else {}
    if isinstance(change, dict):
        body.update(change)
    proxy_log = caplog.at_level("INFO", logger="kvshare_connector.toolkit.proxy")
    with proxy_log, pd_stack(**kwargs) as (url, _, decodes):
        resp = httpx.post(url + "/v1/completions", json=body, timeout=10)
    assert resp.status_code == 200, resp.text
    (dec,) = [r["body"] for r in decodes[0].state.requests]
    assert dec["max_tokens"] == body["max_tokens"]
    assert isinstance(dec["prompt"], str) or max(dec["prompt"]) < word_id("")
    why = {"stream": "not streamed", "seed": "seed=7", "stop": "stop=['Question:']",
           "logprobs": "logprobs=1", "max_tokens": "max_tokens=1",
           "frequency_penalty": "frequency_penalty=0.5", "prompt": None,
           "response_format": "field 'response_format'",
           "prefill_of_elsewhere": "prefill's answer states no prompt digest"}  # fmt: skip
    name = next(iter(change)) if isinstance(change, dict) else change
    lines = [r.getMessage() for r in caplog.records if "decode=" in r.getMessage()]
    said = [line.split("first token from decode: ")[-1] for line in lines
            if "first token from decode: " in line]  # fmt: skip
    assert said == ([why[name]] if why[name] else []), lines


def test_the_proxy_log_says_why_prefills_token_could_not_open_the_stream() -> None:
    """What the log names for a token that cannot open the stream (2026-12-06d: 4-8
    streams per run took the classic legs and the log did not say why)."""
    cases = {"text": ("", "no text of its own"), "token_ids": ([1, 2], "not one token id")}
    for field, (value, reason) in cases.items():
        why = first_token_or_why(_answer(**{field: value}))
        assert isinstance(why, str) and reason in why, why
    assert "mid-character" in first_token_or_why(_answer(text="caf\ufffd"))
    assert "'abort'" in first_token_or_why(_answer(finish_reason="abort"))
    assert not isinstance(first_token_or_why(_answer()), str)


def test_a_decode_that_fails_after_the_first_token_ends_the_stream_with_an_error() -> None:
    """The stream is under way (status 200, prefill's token sent) when decode refuses the
    connection: an error event names the server, as a broken stream does (``--side-down
    fail``; prefill continuing the stream alone: test_proxy_side_down.py)."""
    with fake_server("prefill") as prefill:
        dead = f"http://127.0.0.1:{pick_free_port()}"
        app = create_app([prefill.url], [dead], fast(serve_alone=False))
        with ThreadServer(app) as proxy:
            body = {"prompt": QUESTION, "max_tokens": 4, "stream": True}
            resp = httpx.post(proxy.url + "/v1/completions", json=body, timeout=10)
    assert resp.status_code == 200
    events = [json.loads(x[6:]) for x in resp.text.splitlines() if x.startswith("data: ")]
    assert events[0]["choices"][0]["text"] == " The"
    err = events[-1]["error"]
    assert err["type"] == "backend_unreachable" and dead in err["message"]
