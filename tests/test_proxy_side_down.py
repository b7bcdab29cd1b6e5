"""Every server of one side down: the proxy has a server of the other side compute the
request alone (the default, ``--side-down alone``), against real HTTP fake vLLM servers on
127.0.0.1.

On 2026-12-05 (one H100, the fault matrix) the only prefill or decode was down ~33 s after
its kill, and 67-75 of 80 requests failed 502/503 while the other side stood idle.
"""

from __future__ import annotations

import json
import socket
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from kvshare_connector.toolkit.procs import pick_free_port
from kvshare_connector.toolkit.proxy import create_app

from .support.fake_vllm_server import ThreadServer, fake_server
from .support.pd_stack import QUESTION, fast, sse_events
from .test_proxy import dropping_server, socket_server


def _ask(url: str, stream: bool, **extra: Any) -> httpx.Response:
    body = {"model": "fake-model", "prompt": QUESTION, "max_tokens": 12, "temperature": 0,
            "stream": stream, **extra}  # fmt: skip
    return httpx.post(url + "/v1/completions", json=body, timeout=10)


def _text(resp: httpx.Response, stream: bool) -> str:
    if not stream:
        return resp.json()["choices"][0]["text"]
    return "".join(e["choices"][0]["text"] for e in sse_events(resp.text) if e.get("choices"))


def _plain(server: Any) -> list[dict[str, Any]]:
    """The requests a fake got without kv_transfer_params (computed whole)."""
    return [r["body"] for r in server.state.requests if "kv_transfer_params" not in r["body"]]


@pytest.mark.parametrize("stream", [False, True])
def test_a_dead_prefill_leaves_decode_to_serve_the_request_alone(
    stream: bool, monkeypatch: Any, caplog: Any
) -> None:
    """A prefill that refuses connections (a killed engine): decode gets the client's own
    request, without kv_transfer_params, and answers what a colocated engine answers; the
    proxy's health report counts it and its log names the dead prefill."""
    monkeypatch.setenv("FAKE_DECODE_LOCAL", "1")  # the fake decode computes a plain request
    dead = f"http://127.0.0.1:{pick_free_port()}"
    with ExitStack() as stack:
        dec = stack.enter_context(fake_server("decode"))
        colo = stack.enter_context(fake_server("colocated"))
        px = stack.enter_context(ThreadServer(create_app([dead], [dec.url], fast())))
        stack.enter_context(caplog.at_level("WARNING"))
        resp = _ask(px.url, stream)
        base = _ask(colo.url, stream)
        health = httpx.get(px.url + "/health", timeout=10).json()
    assert resp.status_code == 200, resp.text
    assert _text(resp, stream) == _text(base, stream) and _text(base, stream)
    (seen,) = _plain(dec)
    assert seen["prompt"] == QUESTION and len(dec.state.requests) == 1
    assert dec.state.hits["loads"] == 0
    assert health["served_alone"] == {"decode": 1, "prefill": 0}
    assert health["status"] == "degraded"
    warned = [r.getMessage() for r in caplog.records if "computes the request alone" in
              r.getMessage()]  # fmt: skip
    assert len(warned) == 1 and dead in warned[0] and "decode computes" in warned[0]


def test_a_prefill_that_drops_every_request_leaves_decode_to_serve_it(monkeypatch: Any) -> None:
    """A lone prefill that closes each connection unanswered is asked twice (the resend),
    then decode serves the request alone, under the client's id (another engine)."""
    monkeypatch.setenv("FAKE_DECODE_LOCAL", "1")
    with ExitStack() as stack:
        dropper, seen = stack.enter_context(dropping_server())
        dec = stack.enter_context(fake_server("decode"))
        px = stack.enter_context(ThreadServer(create_app([dropper], [dec.url], fast())))
        resp = _ask(px.url, stream=False)
    assert resp.status_code == 200 and len(seen) == 2
    assert resp.headers["x-request-id"] == seen[0]
    assert dec.state.hits["completions"] == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_dead_decode_leaves_prefill_to_serve_the_request_alone(
    stream: bool, monkeypatch: Any
) -> None:
    """Classic legs (no first-token hand-off): prefill answered the prefill leg, then every
    decode refused the decode leg. Nothing reached the client yet, so a prefill server
    computes the client's request whole, under an id of its own (prefill still holds the
    first leg's KV under the other until its lease ends)."""
    monkeypatch.setenv("FAKE_PREFILL_LOCAL", "1")  # the fake prefill computes a plain request
    dead = f"http://127.0.0.1:{pick_free_port()}"
    with ExitStack() as stack:
        pre = stack.enter_context(fake_server("prefill"))
        colo = stack.enter_context(fake_server("colocated"))
        app = create_app([pre.url], [dead], fast(first_token_from_prefill=False))
        px = stack.enter_context(ThreadServer(app))
        resp = _ask(px.url, stream)
        base = _ask(colo.url, stream)
        health = httpx.get(px.url + "/health", timeout=10).json()
    assert resp.status_code == 200, resp.text
    assert _text(resp, stream) == _text(base, stream)
    (seen,) = _plain(pre)
    assert seen["prompt"] == QUESTION and seen["max_tokens"] == 12
    ids = [r["request_id"] for r in pre.state.requests]
    assert len(ids) == 2 and ids[1].startswith(f"{ids[0]}-")
    assert resp.headers["x-request-id"] == ids[1]
    assert health["served_alone"] == {"decode": 0, "prefill": 1}


def test_a_decode_that_drops_its_leg_leaves_prefill_not_a_second_decode(monkeypatch: Any) -> None:
    """A decode that closed the decode leg unanswered may have read the KV (prefill frees it
    after one read): the leg never goes to the other decode; prefill computes the request."""
    monkeypatch.setenv("FAKE_PREFILL_LOCAL", "1")
    with ExitStack() as stack:
        dropper, seen = stack.enter_context(dropping_server())
        pre = stack.enter_context(fake_server("prefill"))
        good = stack.enter_context(fake_server("decode"))
        app = create_app([pre.url], [dropper, good.url], fast(first_token_from_prefill=False))
        px = stack.enter_context(ThreadServer(app))
        resp = _ask(px.url, stream=False)
    assert resp.status_code == 200, resp.text
    assert len(seen) == 1 and good.state.hits["completions"] == 0
    (plain,) = _plain(pre)
    assert plain["prompt"] == QUESTION


def test_after_prefills_first_token_a_dead_decode_leaves_prefill_to_finish_the_stream(
    monkeypatch: Any, caplog: Any
) -> None:
    """The stream opened with prefill's first token; every decode refused the rest: prefill
    computes it from the prompt's ids and that token, and the client's stream (text and
    usage) is colocated's, with no error event in it."""
    monkeypatch.setenv("FAKE_PREFILL_LOCAL", "1")
    dead = f"http://127.0.0.1:{pick_free_port()}"
    usage = {"stream_options": {"include_usage": True}}
    with ExitStack() as stack:
        pre = stack.enter_context(fake_server("prefill", kvshare_params=True))
        colo = stack.enter_context(fake_server("colocated"))
        px = stack.enter_context(ThreadServer(create_app([pre.url], [dead], fast())))
        stack.enter_context(caplog.at_level("INFO"))
        resp = _ask(px.url, True, **usage)
        base = _ask(colo.url, True, **usage)
        health = httpx.get(px.url + "/health", timeout=10).json()
    assert health["served_alone"] == {"decode": 0, "prefill": 1}
    assert any("served by prefill alone" in r.getMessage() for r in caplog.records)
    assert resp.status_code == 200
    events = sse_events(resp.text)
    assert not [e for e in events if "error" in e], resp.text
    assert _text(resp, True) == _text(base, True)
    assert events[-1]["usage"] == sse_events(base.text)[-1]["usage"]
    (seen,) = _plain(pre)
    assert isinstance(seen["prompt"], list) and seen["max_tokens"] == 11  # one token given


@pytest.mark.parametrize("fail_mode, status", [("error500", 502), ("error400", 400),
                                               ("no_kv", 502)])  # fmt: skip
def test_a_prefill_that_answers_badly_is_not_served_around(
    fail_mode: str, status: int, monkeypatch: Any
) -> None:
    """The control: a prefill that answered (an error, a client error, an answer without
    kv_transfer_params: a server that is up but wrong) is the client's error to see, named;
    decode never gets the request."""
    monkeypatch.setenv("FAKE_DECODE_LOCAL", "1")
    with ExitStack() as stack:
        pre = stack.enter_context(fake_server("prefill", fail_mode=fail_mode))
        dec = stack.enter_context(fake_server("decode"))
        px = stack.enter_context(ThreadServer(create_app([pre.url], [dec.url], fast())))
        resp = _ask(px.url, stream=False)
        health = httpx.get(px.url + "/health", timeout=10).json()
    assert resp.status_code == status
    assert dec.state.hits["completions"] == 0
    assert health["served_alone"] == {"decode": 0, "prefill": 0}


@pytest.mark.parametrize("argv, expected", [([], "alone"), (["--side-down", "fail"], "fail")])
def test_serve_pd_hands_the_choice_to_its_proxy(argv: list[str], expected: str) -> None:
    """``kvshare serve-pd --side-down`` reaches the proxy it starts; a value that is
    neither is refused by the CLI and by ServeConfig."""
    from kvshare_connector.toolkit.cli import build_parser, serve_config_from_args
    from kvshare_connector.toolkit.launcher import ServeConfig, plan_pd, proxy_argv

    args = build_parser().parse_args(["serve-pd", "m", *argv])
    args.passthrough = []  # what `kvshare` (cli.main) sets: arguments after `--`
    cfg = serve_config_from_args(args)
    line = proxy_argv(cfg, plan_pd(cfg))
    assert line[line.index("--side-down") + 1] == expected
    proxy_args = build_parser().parse_args(["proxy", "--prefill", "http://a:1", "--decode",
                                            "http://b:2", *argv])  # fmt: skip
    assert proxy_args.side_down == expected
    with pytest.raises(SystemExit):
        build_parser().parse_args(["proxy", "--prefill", "http://a:1", "--decode", "http://b:2",
                                   "--side-down", "retry"])  # fmt: skip
    with pytest.raises(ValueError, match="side_down"):
        ServeConfig(model="m", side_down="retry")


def served_around(
    decode_url: str, pre: Any, stream: bool, first_token_from_prefill: bool, caplog: Any
) -> tuple[httpx.Response, httpx.Response, dict[str, Any]]:
    """A request through a proxy of prefill ``pre`` and a decode at ``decode_url`` that
    fails under it, the same request to a colocated fake, and the proxy's /health."""
    with ExitStack() as stack:
        colo = stack.enter_context(fake_server("colocated"))
        app = create_app([pre.url], [decode_url],
                         fast(first_token_from_prefill=first_token_from_prefill))  # fmt: skip
        px = stack.enter_context(ThreadServer(app))
        stack.enter_context(caplog.at_level("INFO"))
        resp = _ask(px.url, stream)
        base = _ask(colo.url, stream)
        return resp, base, httpx.get(px.url + "/health", timeout=10).json()


def cutting_server(before_cut: bytes = b"") -> Any:
    """A decode killed under a streamed request: it answers 200 with an event stream,
    sends ``before_cut`` (none: the request was still loading) and closes the connection
    in the middle of the body; yields its URL and the X-Request-Id of each request."""

    def reply(conn: socket.socket, head: str) -> None:
        if head.startswith("get /health"):  # up until the request it dies under
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            return
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
        if before_cut:
            conn.sendall(b"%x\r\n%s\r\n" % (len(before_cut), before_cut))

    return socket_server(reply)


@pytest.mark.parametrize("first_token_from_prefill", [True, False])
def test_a_decode_stream_cut_before_any_of_it_was_relayed_is_finished_by_prefill(
    first_token_from_prefill: bool, monkeypatch: Any, caplog: Any
) -> None:
    """The 2026-12-06 fault run (decode killed at ``sink.read_posted``, one H100): 7 of 80
    streams broke with decode's stream open and nothing of it relayed yet. Such a stream
    is prefill's to compute alone: the client's stream is colocated's (after prefill's
    first token, or whole), with no error event in it."""
    monkeypatch.setenv("FAKE_PREFILL_LOCAL", "1")
    with ExitStack() as stack:
        cutter, seen = stack.enter_context(cutting_server())
        pre = stack.enter_context(fake_server("prefill", kvshare_params=True))
        resp, base, health = served_around(cutter, pre, True, first_token_from_prefill, caplog)
    assert resp.status_code == 200 and len(seen) == 1
    assert not [e for e in sse_events(resp.text) if "error" in e], resp.text
    assert _text(resp, True) == _text(base, True)
    assert health["served_alone"] == {"decode": 0, "prefill": 1}
    assert any("served by prefill alone" in r.getMessage() for r in caplog.records)
    (plain,) = _plain(pre)
    given = 1 if first_token_from_prefill else 0  # prefill's first token, already sent
    assert plain["max_tokens"] == 12 - given


@pytest.mark.parametrize("side_down, before_cut", [("alone", b'data: {"choices": []}\n\n'),
                                                   ("fail", b"")])  # fmt: skip
def test_a_decode_stream_cut_after_it_was_relayed_or_with_side_down_fail_is_an_error(
    side_down: str, before_cut: bytes, monkeypatch: Any
) -> None:
    """The controls: once decode's stream reached the client, or with ``--side-down
    fail``, a cut stream ends in a named error event and prefill computes nothing more."""
    monkeypatch.setenv("FAKE_PREFILL_LOCAL", "1")
    with ExitStack() as stack:
        cutter, _ = stack.enter_context(cutting_server(before_cut))
        pre = stack.enter_context(fake_server("prefill"))
        options = fast(first_token_from_prefill=False, serve_alone=side_down == "alone")
        px = stack.enter_context(ThreadServer(create_app([pre.url], [cutter], options)))
        resp = _ask(px.url, True)
    data = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in data, resp.text  # the stream did not end as a whole answer
    (error,) = [json.loads(d)["error"] for d in data if "error" in d]
    assert error["type"] == "backend_dropped" and cutter in error["message"], error
    assert not _plain(pre) and len(pre.state.requests) == 1


@pytest.mark.parametrize("stream, first_token_from_prefill",
                         [(False, False), (True, False), (True, True)])  # fmt: skip
def test_a_decode_whose_engine_died_under_the_request_leaves_prefill_to_serve_it(
    stream: bool, first_token_from_prefill: bool, monkeypatch: Any, caplog: Any
) -> None:
    """The 2026-12-06 fault run's 7 failures: decode's API server outlived its EngineCore
    and answered vLLM's own EngineDeadError (HTTP 500, or a stream opened with an error
    event), its /health 503. Nothing of decode's reached the client, so a prefill server
    computes the request alone: the client's answer is colocated's, with no error in it."""
    monkeypatch.setenv("FAKE_PREFILL_LOCAL", "1")
    with ExitStack() as stack:
        pre = stack.enter_context(fake_server("prefill", kvshare_params=True))
        dead = stack.enter_context(fake_server("decode", fail_mode="engine_dead"))
        resp, base, health = served_around(dead.url, pre, stream, first_token_from_prefill,
                                           caplog)  # fmt: skip
    assert resp.status_code == 200, resp.text
    if stream:
        assert not [e for e in sse_events(resp.text) if "error" in e], resp.text
    assert _text(resp, stream) == _text(base, stream) and _text(base, stream)
    assert len(dead.state.requests) == 1  # decode got its leg, and died under it
    (plain,) = _plain(pre)
    assert plain["max_tokens"] == 12 - (1 if first_token_from_prefill else 0)
    assert health["served_alone"] == {"decode": 0, "prefill": 1}
    (warned,) = [r.getMessage() for r in caplog.records if "computes the request alone" in
                 r.getMessage()]  # fmt: skip
    assert dead.url in warned and "/health then answered HTTP 503" in warned, warned


@pytest.mark.parametrize("stream, fail_mode", [(False, "error500"), (False, "error_event"),
                                               (True, "error_event")])  # fmt: skip
def test_a_decode_that_answers_an_error_while_healthy_is_not_served_around(
    stream: bool, fail_mode: str, monkeypatch: Any
) -> None:
    """The control on decode's side: a decode that answered an error (a 500, or vLLM's own
    EngineDeadError answer) while its /health stays 200 may have run the request: the
    client gets it as an error (a 502 naming decode, or vLLM's error event in the stream),
    and prefill computes nothing more."""
    monkeypatch.setenv("FAKE_PREFILL_LOCAL", "1")
    with ExitStack() as stack:
        pre = stack.enter_context(fake_server("prefill"))
        bad = stack.enter_context(fake_server("decode", fail_mode=fail_mode))
        app = create_app([pre.url], [bad.url], fast(first_token_from_prefill=False))
        px = stack.enter_context(ThreadServer(app))
        resp = _ask(px.url, stream)
        health = httpx.get(px.url + "/health", timeout=10).json()
    if stream:
        (event,) = sse_events(resp.text)
        assert event["error"]["code"] == 500 and "choices" not in event, resp.text
    else:
        assert resp.status_code == 502 and resp.json()["error"]["server"] == bad.url
    assert not _plain(pre) and len(pre.state.requests) == 1
    assert health["served_alone"] == {"decode": 0, "prefill": 0}


def test_a_prefill_whose_engine_died_is_passed_over_for_another(monkeypatch: Any) -> None:
    """A prefill answering vLLM's EngineDeadError with its /health 503 is down: the prefill
    leg goes to the other prefill (it computed nothing to hold), and the request is served
    PD through it; with that one alone, decode serves the request alone."""
    monkeypatch.setenv("FAKE_DECODE_LOCAL", "1")
    with ExitStack() as stack:
        dead = stack.enter_context(fake_server("prefill", fail_mode="engine_dead"))
        good = stack.enter_context(fake_server("prefill"))
        dec = stack.enter_context(fake_server("decode"))
        two = stack.enter_context(ThreadServer(create_app([dead.url, good.url], [dec.url],
                                                          fast())))  # fmt: skip
        one = stack.enter_context(ThreadServer(create_app([dead.url], [dec.url], fast())))
        via_two = _ask(two.url, stream=False)
        loads, asked_dead = dec.state.hits["loads"], dead.state.hits["completions"]
        via_one = _ask(one.url, stream=False)
        asked_dead = dead.state.hits["completions"] - asked_dead
        health_one = httpx.get(one.url + "/health", timeout=10).json()
    assert via_two.status_code == 200 and via_one.status_code == 200, via_one.text
    assert good.state.hits["completions"] == 1 and loads == 1  # PD through the good prefill
    assert health_one["served_alone"] == {"decode": 1, "prefill": 0}
    assert asked_dead == 1  # a dead engine alone on its side is not asked again (2026-12-06d)
    assert [r["body"]["prompt"] for r in dec.state.requests if "kv_transfer_params" not in
            r["body"]] == [QUESTION]  # fmt: skip
