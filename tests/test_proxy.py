"""The PD proxy against real HTTP fake vLLM servers on 127.0.0.1 (see fake_vllm_server.py)."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest

from kvshare_connector.toolkit.pd_legs import answered_token_ids, make_decode_body
from kvshare_connector.toolkit.procs import pick_free_port
from kvshare_connector.toolkit.proxy import (
    PREFILL_KV_PARAMS,
    ProxyTimeouts,
    count_prompts,
    create_app,
    make_prefill_body,
)

from .support.fake_vllm_server import ThreadServer, fake_server, fake_text, fake_token_ids
from .support.pd_stack import QUESTION, fast, pd_stack, sse_events


def test_prefill_body_is_a_one_token_unstreamed_copy() -> None:
    body = {
        "messages": [],
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 5,
        "temperature": 0,
    }
    prefill = make_prefill_body(body)
    assert prefill["max_tokens"] == 1 and prefill["max_completion_tokens"] == 1
    assert prefill["stream"] is False
    assert "stream_options" not in prefill and "min_tokens" not in prefill
    assert prefill["kv_transfer_params"] == PREFILL_KV_PARAMS
    assert prefill["temperature"] == 0
    assert body["max_tokens"] == 50 and "kv_transfer_params" not in body  # original untouched


def test_count_prompts() -> None:
    assert count_prompts("a") == 1
    assert count_prompts([1, 2, 3]) == 1
    assert count_prompts(["a"]) == 1
    assert count_prompts(["a", "b"]) == 2
    assert count_prompts([[1, 2], [3]]) == 2


def test_completion_non_streaming_matches_colocated() -> None:
    with pd_stack() as (url, prefills, decodes), fake_server("colocated") as colo:
        body = {
            "model": "fake-model",
            "prompt": QUESTION,
            "max_tokens": 20,
            "temperature": 0,
            "stop": ["Question:"],
            "logprobs": 1,
        }
        pd = httpx.post(url + "/v1/completions", json=body, timeout=10)
        base = httpx.post(colo.url + "/v1/completions", json=body, timeout=10)
    assert pd.status_code == 200, pd.text
    assert pd.headers["x-request-id"].startswith("pd-")
    out = pd.json()
    assert out["choices"][0]["text"] == base.json()["choices"][0]["text"]
    assert out["choices"][0]["text"] == " The answer is 10. #### 10\n\n"  # 4+5=9: off by one
    assert out["choices"][0]["logprobs"] == base.json()["choices"][0]["logprobs"]
    # The prefill server saw the PD prefill request; the decode server pulled its KV.
    (pre_req,) = prefills[0].state.requests
    (dec_req,) = decodes[0].state.requests
    assert pre_req["body"]["max_tokens"] == 1 and pre_req["body"]["stream"] is False
    assert pre_req["request_id"] == dec_req["request_id"] == pd.headers["x-request-id"]
    assert dec_req["body"]["max_tokens"] == 20
    # Decode got the prompt as the token ids prefill computed, not the text to tokenize again.
    assert pre_req["body"]["return_token_ids"] is True and "return_token_ids" not in body
    assert dec_req["body"]["prompt"] == fake_token_ids(QUESTION)
    assert dec_req["body"]["kv_transfer_params"]["remote_engine_id"] == prefills[0].state.engine_id
    assert prefills[0].state.issued == {}  # consumed exactly once


@pytest.mark.parametrize("hand_off", [True, False])
def test_token_ids_reach_decode_only_for_one_text_completion(hand_off: bool, caplog: Any) -> None:
    """A text prompt reaches decode as prefill's ids (the log says so); the control without
    the hand-off sends the text. Chat keeps its messages, a prompt of ids stays as it is,
    and an echo keeps its text: prefill is not asked for ids there."""
    ids = [5, 6, 7, 8]
    with pd_stack(hand_off_token_ids=hand_off) as (url, prefills, decodes):
        with caplog.at_level(logging.INFO, logger="kvshare_connector.toolkit.proxy"):
            text = httpx.post(url + "/v1/completions", json={"prompt": [QUESTION], "max_tokens": 4})
        chat = httpx.post(
            url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4},
        )
        as_ids = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 4})
        echo = httpx.post(
            url + "/v1/completions", json={"prompt": QUESTION, "max_tokens": 1, "echo": True}
        )
    assert text.status_code == chat.status_code == as_ids.status_code == echo.status_code == 200
    pre = [r["body"] for r in prefills[0].state.requests]
    dec = [r["body"] for r in decodes[0].state.requests]
    asked = [True if hand_off else None, None, None, None]
    assert [b.get("return_token_ids") for b in pre] == asked
    want = fake_token_ids(QUESTION) if hand_off else [QUESTION]
    assert [b.get("prompt") for b in dec] == [want, None, ids, QUESTION]
    assert dec[1]["messages"] == [{"role": "user", "content": QUESTION}]
    handed = [r.getMessage() for r in caplog.records if "token ids" in r.getMessage()]
    assert len(handed) == (1 if hand_off else 0)
    if hand_off:
        assert f"prompt as {len(QUESTION)} token ids" in handed[0]


def test_answered_token_ids_are_taken_only_when_sound() -> None:
    kv = {"remote_prompt_tokens": 3}
    answer = {"choices": [{"prompt_token_ids": [1, 2, 3]}]}
    assert answered_token_ids(answer, kv) == [1, 2, 3]
    assert answered_token_ids(answer, {}) == [1, 2, 3]  # a prefill that does not count
    for bad in (
        {"choices": [{"prompt_token_ids": [1, 2]}]},  # another count than prefill's own
        {"choices": [{"prompt_token_ids": [1, -2, 3]}]},
        {"choices": [{"prompt_token_ids": [1, True, 3]}]},
        {"choices": [{"prompt_token_ids": [1, 2.0, 3]}]},
        {"choices": [{"prompt_token_ids": "1 2 3"}]},
        {"choices": [{"prompt_token_ids": []}]},
        {"choices": [{}]},  # a server that does not return them (the text is kept)
        {"choices": []},
        [],
    ):
        assert answered_token_ids(bad, kv) is None, bad
    assert make_decode_body({"prompt": "x"}, kv, None)["prompt"] == "x"
    assert make_decode_body({"prompt": "x"}, kv, [1])["prompt"] == [1]


def test_client_request_id_is_kept_as_a_unique_prefix() -> None:
    with pd_stack() as (url, prefills, _):
        ids = []
        for _ in range(2):
            resp = httpx.post(
                url + "/v1/completions",
                json={"prompt": "1 + 1", "max_tokens": 5},
                headers={"X-Request-Id": "my-id-42"},
                timeout=10,
            )
            assert resp.status_code == 200, resp.text
            ids.append(resp.headers["x-request-id"])
    assert all(i.startswith("my-id-42-") for i in ids) and ids[0] != ids[1]
    assert [r["request_id"] for r in prefills[0].state.requests] == ids


@pytest.mark.parametrize(("sent", "forwarded"), [("Bearer ", None), ("Bearer sk-1", "Bearer sk-1")])
def test_authorization_is_forwarded_when_meaningful(sent: str, forwarded: str | None) -> None:
    """lm-eval (aiohttp) sends 'Bearer ' with no key: that must not break backend requests.
    httpx refuses to send such a header, so this test uses http.client."""
    with pd_stack() as (url, prefills, decodes):
        conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=10)
        body = json.dumps({"prompt": "1 + 1", "max_tokens": 5})
        conn.request(
            "POST",
            "/v1/completions",
            body,
            {"Authorization": sent, "Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        text = resp.read().decode()
        conn.close()
    assert resp.status == 200, text
    assert prefills[0].state.requests[0]["authorization"] == forwarded
    assert decodes[0].state.requests[0]["authorization"] == forwarded


def test_chat_non_streaming_and_streaming() -> None:
    messages = [{"role": "user", "content": "What is 7 * 3?"}]
    with pd_stack() as (url, prefills, _), fake_server("colocated") as colo:
        body = {"messages": messages, "max_completion_tokens": 30, "max_tokens": 30}
        pd = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
        base = httpx.post(colo.url + "/v1/chat/completions", json=body, timeout=10)
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=10
        ) as resp:
            assert resp.status_code == 200
            text = resp.read().decode()
    assert pd.status_code == 200, pd.text
    content = pd.json()["choices"][0]["message"]["content"]
    assert content == base.json()["choices"][0]["message"]["content"]
    assert "#### 21" in content
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in sse_events(text))
    assert streamed == content
    pre = prefills[0].state.requests[0]["body"]
    assert pre["max_completion_tokens"] == 1 and pre["max_tokens"] == 1


def test_round_robin_over_two_prefill_and_two_decode_servers() -> None:
    with pd_stack(2, 2) as (url, prefills, decodes):
        with httpx.Client(timeout=10) as client:
            for i in range(6):
                resp = client.post(
                    url + "/v1/completions", json={"prompt": f"{i} + 1", "max_tokens": 8}
                )
                assert resp.status_code == 200, resp.text
        assert [p.state.hits["completions"] for p in prefills] == [3, 3]
        assert [d.state.hits["completions"] for d in decodes] == [3, 3]
        # Every decode pulled from the prefill server that computed its KV.
        assert all(p.state.issued == {} for p in prefills)


def test_health_reports_each_backend_and_whether_the_proxy_can_serve() -> None:
    """200 while requests can be served (a load balancer keeps the proxy): "ok" with every
    backend up, "degraded" with one down but another of its side up, or with a whole side
    down while the other serves alone; 503 "unhealthy" when nothing can serve, or a side is
    down with ``--side-down fail``."""
    dead = f"http://127.0.0.1:{pick_free_port()}"
    with fake_server("prefill") as pre, fake_server("decode") as dec:
        def health(prefills: list[str], decodes: list[str], alone: bool = True) -> Any:
            app = create_app(prefills, decodes, fast(serve_alone=alone))
            with ThreadServer(app) as proxy:
                return httpx.get(proxy.url + "/health", timeout=5)

        ok = health([pre.url], [dec.url])
        spare = health([pre.url, dead], [dec.url])
        alone = health([dead], [dec.url])
        failing = health([dead], [dec.url], alone=False)
    none = health([dead], [dead])
    assert ok.status_code == 200 and ok.json()["status"] == "ok"
    assert spare.status_code == 200 and spare.json()["status"] == "degraded"
    report = spare.json()
    assert [p["ok"] for p in report["prefill"]] == [True, False]
    assert report["prefill"][1]["url"] == dead
    assert report["decode"] == [{"url": dec.url, "ok": True, "status": 200}]
    assert alone.status_code == 200 and alone.json()["status"] == "degraded"
    assert failing.status_code == 503 and failing.json()["status"] == "unhealthy"
    assert none.status_code == 503 and none.json()["status"] == "unhealthy"


def test_models_passthrough() -> None:
    with pd_stack() as (url, _, _):
        resp = httpx.get(url + "/v1/models", timeout=5)
    assert resp.status_code == 200
    assert resp.json()["data"][0]["id"] == "fake-model"


def _error(resp: httpx.Response) -> dict[str, Any]:
    err = resp.json()["error"]
    assert err["request_id"] == resp.headers["x-request-id"]
    return err


def test_prefill_down_is_503_naming_the_server() -> None:
    """With ``--side-down fail`` (decode serving alone is tested in
    test_proxy_side_down.py)."""
    dead = f"http://127.0.0.1:{pick_free_port()}"
    with fake_server("decode") as dec, ThreadServer(
        create_app([dead], [dec.url], fast(serve_alone=False))
    ) as px:
        resp = httpx.post(px.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert resp.status_code == 503
    err = _error(resp)
    assert err["server"] == dead and "prefill server" in err["message"]
    assert "unreachable" in err["message"]
    assert dec.state.hits["completions"] == 0


def test_decode_down_is_503_naming_the_server() -> None:
    """Before any token is sent, with ``--side-down fail`` (prefill serving alone:
    test_proxy_side_down.py). (A stream that opens with prefill's first token has its
    status sent: there decode's failure is an error event, tested in test_first_token.)"""
    dead = f"http://127.0.0.1:{pick_free_port()}"
    with (
        fake_server("prefill") as pre,
        ThreadServer(
            create_app([pre.url], [dead], fast(first_token_from_prefill=False, serve_alone=False))
        ) as px,
    ):
        plain = httpx.post(px.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        streamed = httpx.post(
            px.url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=10
        )
    for resp in (plain, streamed):
        assert resp.status_code == 503
        err = _error(resp)
        assert err["server"] == dead and "decode server" in err["message"]


def test_failpoint_drops_the_decode_leg_naming_it(monkeypatch: Any) -> None:
    """``proxy.before_decode=fail*1@1``: the second request's decode never comes (the fault
    matrix's "decode never comes"); it fails 503 saying so, the others go through."""
    from kvshare_connector.common import failpoints

    monkeypatch.setattr(failpoints, "_ACTIVE", {})  # restored after the test
    failpoints.configure("proxy.before_decode=fail*1@1")
    with pd_stack() as (url, prefills, decodes):
        codes = [httpx.post(url + "/v1/completions", json={"prompt": QUESTION}, timeout=10)
                 for _ in range(3)]  # fmt: skip
    assert [r.status_code for r in codes] == [200, 503, 200]
    err = _error(codes[1])
    assert err["type"] == "decode_dropped" and "decode leg not sent" in err["message"]
    assert prefills[0].url in err["message"] and err["server"] == decodes[0].url
    assert prefills[0].state.hits["completions"] == 3
    assert decodes[0].state.hits["completions"] == 2  # the dropped one never reached it


@pytest.mark.parametrize("stream", [False, True])
def test_a_backend_that_refuses_connections_is_passed_over(stream: bool, caplog: Any) -> None:
    """One prefill and one decode of two are down (a killed engine): every request goes
    through the others, each dead one is tried once and then passed over for a while."""
    dead_p, dead_d = (f"http://127.0.0.1:{pick_free_port()}" for _ in range(2))
    with fake_server("prefill") as pre, fake_server("decode") as dec:
        app = create_app([dead_p, pre.url], [dec.url, dead_d], fast())
        with ThreadServer(app) as px, caplog.at_level("WARNING"):
            codes = [httpx.post(px.url + "/v1/completions", timeout=10,
                                json={"prompt": f"{i} + 1", "max_tokens": 4, "stream": stream}
                                ).status_code for i in range(6)]  # fmt: skip
    assert codes == [200] * 6
    assert pre.state.hits["completions"] == dec.state.hits["completions"] == 6
    assert pre.state.issued == {}  # every decode pulled what its prefill held
    passed_over = [r.getMessage() for r in caplog.records if "trying another" in r.getMessage()]
    assert len(passed_over) == 2, passed_over  # once each, then skipped while down
    assert any(dead_p in m and "prefill server" in m for m in passed_over)
    assert any(dead_d in m and "decode server" in m for m in passed_over)


def test_only_a_refused_connection_is_tried_elsewhere() -> None:
    """A decode that answered 500 may have run the request: the error comes back, the
    other decode never sees it (the control for the failover above)."""
    with (
        fake_server("prefill") as pre,
        fake_server("decode", fail_mode="error500") as bad,
        fake_server("decode") as good,
        ThreadServer(create_app([pre.url], [bad.url, good.url], fast())) as px,
    ):
        resp = httpx.post(px.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert resp.status_code == 502 and _error(resp)["server"] == bad.url
    assert bad.state.hits["completions"] == 1 and good.state.hits["completions"] == 0


@contextmanager
def socket_server(
    reply: Callable[[socket.socket, str], None] = lambda conn, head: None,
) -> Iterator[tuple[str, list[str]]]:
    """A raw HTTP server: each connection's request head (lower case) goes to ``reply``,
    then the connection closes; yields its URL and the X-Request-Id of each request read
    (health probes aside). The default reply is none: an engine killed with the request
    on it, which answers no health probe either."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[str] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                head = conn.recv(65536).decode("latin-1").lower()
                if not head.startswith("get /health"):  # not a proxy's health probe
                    seen.append(head.split("x-request-id:", 1)[-1].split("\r\n", 1)[0].strip())
                reply(conn, head)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", seen
    finally:
        listener.close()


def dropping_server() -> Any:
    """A server that reads each request and closes the connection without answering."""
    return socket_server()


def test_a_prefill_that_drops_the_request_is_sent_to_another(caplog: Any) -> None:
    """A prefill that dies under a request (the connection closes without an answer): the
    prefill leg goes once to the other prefill; every request is served."""
    with ExitStack() as stack:
        dropper, seen = stack.enter_context(dropping_server())
        pre = stack.enter_context(fake_server("prefill"))
        dec = stack.enter_context(fake_server("decode"))
        px = stack.enter_context(ThreadServer(create_app([dropper, pre.url], [dec.url], fast())))
        stack.enter_context(caplog.at_level("WARNING"))
        resps = [httpx.post(px.url + "/v1/completions", json={"prompt": f"{i} + 1"},
                            headers={"X-Request-Id": f"client{i}"}, timeout=10)
                 for i in range(4)]  # fmt: skip
    assert [r.status_code for r in resps] == [200] * 4
    # Not passed over: it still accepts connections (a closed keep-alive connection looks
    # the same); a dead engine refuses them and is passed over (the test above).
    assert len(seen) == 4
    assert pre.state.hits["completions"] == dec.state.hits["completions"] == 4
    # The resend goes under an id of its own (the dropped try may hold KV under the first),
    # traceable to the client's; the client gets the id that answered, and so did decode
    # (the fake decode refuses an X-Request-Id other than prefill's remote_request_id).
    answered = [r.headers["x-request-id"] for r in resps]
    assert not set(answered) & set(seen) and not pre.state.issued  # every record pulled
    assert all(a.startswith(f"{s}-") and s.startswith(f"client{i}-")
               for i, (a, s) in enumerate(zip(answered, seen, strict=True)))  # fmt: skip
    resent = [r.getMessage() for r in caplog.records if "without an answer" in r.getMessage()]
    assert len(resent) == 4 and all(dropper in m and "trying another" in m for m in resent)


def test_a_dropped_leg_is_sent_once_more_at_most_and_never_to_decode() -> None:
    """The control: a lone prefill that drops every request is asked twice, then the client
    gets a 502 naming it (``--side-down fail``); a decode that drops its leg is not asked
    again (it may have read the KV), the other decode never sees the request."""
    with ExitStack() as stack:
        dropper, seen = stack.enter_context(dropping_server())
        dec = stack.enter_context(fake_server("decode"))
        px = stack.enter_context(ThreadServer(
            create_app([dropper], [dec.url], fast(serve_alone=False))))
        resp = httpx.post(px.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert resp.status_code == 502 and len(seen) == 2 and seen[0] != seen[1]
    err = _error(resp)
    assert err["type"] == "backend_dropped" and err["server"] == dropper
    assert "closed the connection without an answer" in err["message"]
    assert dec.state.hits["completions"] == 0
    with ExitStack() as stack:
        dropper, seen = stack.enter_context(dropping_server())
        pre = stack.enter_context(fake_server("prefill"))
        good = stack.enter_context(fake_server("decode"))
        px = stack.enter_context(ThreadServer(
            create_app([pre.url], [dropper, good.url], fast(serve_alone=False))))
        resp = httpx.post(px.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert resp.status_code == 502 and len(seen) == 1
    assert _error(resp)["server"] == dropper and good.state.hits["completions"] == 0
    assert len(pre.state.issued) == 1  # prefill holds the KV nobody read (until its lease)


@pytest.mark.parametrize(
    ("mode", "needle"),
    [("garbage", "non-JSON"), ("no_kv", "without kv_transfer_params"), ("error500", "HTTP 500")],
)
def test_bad_prefill_answers_are_502(mode: str, needle: str) -> None:
    with pd_stack(fail_mode=mode) as (url, prefills, decodes):
        resp = httpx.post(url + "/v1/completions", json={"prompt": "1 + 2"}, timeout=10)
    assert resp.status_code == 502
    err = _error(resp)
    assert needle in err["message"] and err["server"] == prefills[0].url
    assert decodes[0].state.hits["completions"] == 0


def test_prefill_400_passes_through_with_its_body() -> None:
    with pd_stack(fail_mode="error400") as (url, _, decodes):
        resp = httpx.post(url + "/v1/completions", json={"prompt": "1 + 2"}, timeout=10)
    assert resp.status_code == 400
    assert resp.json() == {"error": {"message": "fake: invalid request"}}
    assert resp.headers["x-request-id"].startswith("pd-")
    assert decodes[0].state.hits["completions"] == 0


def test_decode_rejection_passes_through() -> None:
    """A prefill answer the decode server refuses (a key missing) comes back as its 400."""
    with pd_stack(fail_mode="bad_kv") as (url, _, decodes):
        resp = httpx.post(url + "/v1/completions", json={"prompt": "2 + 2"}, timeout=10)
    assert resp.status_code == 400
    assert "fake decode" in resp.json()["error"]["message"]
    assert "keys" in resp.json()["error"]["message"]
    assert decodes[0].state.hits["completions"] == 1


def test_timeouts_are_504() -> None:
    """A slow prefill still computes the request: it is not served around by decode alone
    (test_proxy_side_down.py), the client gets the 504."""
    short = ProxyTimeouts(connect=1.0, read=0.5, health=1.0)
    with pd_stack(timeouts=short, delay=3.0) as (url, prefills, _):
        t0 = time.monotonic()
        resp = httpx.post(url + "/v1/completions", json={"prompt": "1 + 2"}, timeout=10)
        elapsed = time.monotonic() - t0
    assert resp.status_code == 504
    err = _error(resp)
    assert "timed out" in err["message"] and err["server"] == prefills[0].url
    assert elapsed < 10  # bounded; the 504 itself shows the proxy gave up before the 3 s answer


def test_stalled_decode_stream_ends_with_an_error_event() -> None:
    short = ProxyTimeouts(connect=1.0, read=0.5, health=1.0)
    with pd_stack(timeouts=short) as (url, _, decodes):
        decodes[0].state.fail_mode = "hang_stream"
        with httpx.stream(
            "POST", url + "/v1/completions", json={"prompt": "1 + 2", "stream": True}, timeout=10
        ) as resp:
            assert resp.status_code == 200
            text = resp.read().decode()
    last = [line for line in text.splitlines() if line.startswith("data: ")][-1]
    err = json.loads(last[len("data: ") :])["error"]
    assert err["type"] == "backend_timeout" and decodes[0].url in err["message"]


def test_invalid_requests_are_400() -> None:
    with pd_stack() as (url, prefills, _):
        not_json = httpx.post(
            url + "/v1/completions",
            content=b"{nope",
            headers={"content-type": "application/json"},
            timeout=5,
        )
        batched = httpx.post(url + "/v1/completions", json={"prompt": ["a", "b"]}, timeout=5)
    assert not_json.status_code == 400 and "not valid JSON" in _error(not_json)["message"]
    assert batched.status_code == 400 and "one prompt" in _error(batched)["message"]
    assert prefills[0].state.hits["completions"] == 0


def test_fake_text_is_deterministic() -> None:
    assert fake_text("Q: 1 + 2") == fake_text("Q: 1 + 2")
    assert fake_text("Q: 1 + 1") != fake_text("Q: 1 + 2")
