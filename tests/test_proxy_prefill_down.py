"""No prefill answers: the proxy has a decode server compute the request alone (the
default, ``--prefill-down decode``), against real HTTP fake vLLM servers on 127.0.0.1.

On 2026-12-05 (one H100, 1P2D, the fault matrix's ``prefill_claim``) prefill was down ~33 s
after its kill and 67 of 80 requests failed 502/503, while two decode engines stood idle.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from kvshare_connector.toolkit.procs import pick_free_port
from kvshare_connector.toolkit.proxy import create_app

from .support.fake_vllm_server import ThreadServer, fake_server
from .support.pd_stack import FAST, QUESTION, sse_events
from .test_proxy import dropping_server


def _ask(url: str, stream: bool) -> httpx.Response:
    body = {"model": "fake-model", "prompt": QUESTION, "max_tokens": 12, "temperature": 0,
            "stream": stream}  # fmt: skip
    return httpx.post(url + "/v1/completions", json=body, timeout=10)


def _text(resp: httpx.Response, stream: bool) -> str:
    if not stream:
        return resp.json()["choices"][0]["text"]
    return "".join(e["choices"][0]["text"] for e in sse_events(resp.text) if e.get("choices"))


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
        px = stack.enter_context(ThreadServer(create_app([dead], [dec.url], FAST)))
        stack.enter_context(caplog.at_level("WARNING"))
        resp = _ask(px.url, stream)
        base = _ask(colo.url, stream)
        health = httpx.get(px.url + "/health", timeout=10).json()
    assert resp.status_code == 200, resp.text
    assert _text(resp, stream) == _text(base, stream) and _text(base, stream)
    (seen,) = dec.state.requests
    assert "kv_transfer_params" not in seen["body"] and seen["body"]["prompt"] == QUESTION
    assert dec.state.hits["loads"] == 0
    assert health["served_by_decode_alone"] == 1 and health["status"] == "unhealthy"
    warned = [r.getMessage() for r in caplog.records if "decode computes" in r.getMessage()]
    assert len(warned) == 1 and dead in warned[0]


def test_a_prefill_that_drops_every_request_leaves_decode_to_serve_it(monkeypatch: Any) -> None:
    """A lone prefill that closes each connection unanswered is asked twice (the resend),
    then decode serves the request alone."""
    monkeypatch.setenv("FAKE_DECODE_LOCAL", "1")
    with ExitStack() as stack:
        dropper, seen = stack.enter_context(dropping_server())
        dec = stack.enter_context(fake_server("decode"))
        px = stack.enter_context(ThreadServer(create_app([dropper], [dec.url], FAST)))
        resp = _ask(px.url, stream=False)
    assert resp.status_code == 200 and len(seen) == 2
    assert resp.headers["x-request-id"] == seen[0]  # the client's id: decode is another engine
    assert dec.state.hits["completions"] == 1


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
        px = stack.enter_context(ThreadServer(create_app([pre.url], [dec.url], FAST)))
        resp = _ask(px.url, stream=False)
        health = httpx.get(px.url + "/health", timeout=10).json()
    assert resp.status_code == status
    assert dec.state.hits["completions"] == 0 and health["served_by_decode_alone"] == 0


@pytest.mark.parametrize("argv, expected", [([], "decode"), (["--prefill-down", "fail"], "fail")])
def test_serve_pd_hands_the_choice_to_its_proxy(argv: list[str], expected: str) -> None:
    """``kvshare serve-pd --prefill-down`` reaches the proxy it starts; a value that is
    neither is refused by the CLI and by ServeConfig."""
    from kvshare_connector.toolkit.cli import build_parser, serve_config_from_args
    from kvshare_connector.toolkit.launcher import ServeConfig, plan_pd, proxy_argv

    args = build_parser().parse_args(["serve-pd", "m", *argv])
    args.passthrough = []  # what `kvshare` (cli.main) sets: arguments after `--`
    cfg = serve_config_from_args(args)
    line = proxy_argv(cfg, plan_pd(cfg))
    assert line[line.index("--prefill-down") + 1] == expected
    proxy_args = build_parser().parse_args(["proxy", "--prefill", "http://a:1", "--decode",
                                            "http://b:2", *argv])  # fmt: skip
    assert proxy_args.prefill_down == expected
    with pytest.raises(SystemExit):
        build_parser().parse_args(["proxy", "--prefill", "http://a:1", "--decode", "http://b:2",
                                   "--prefill-down", "retry"])  # fmt: skip
    with pytest.raises(ValueError, match="prefill_down"):
        ServeConfig(model="m", prefill_down="retry")
