"""vllm-router (the real Rust binary of the ``router`` extra) in front of fake vLLM servers.

What vllm-router 0.1.17 does in ``--vllm-pd-disaggregation`` mode (``--kv-connector nixl``,
its default), as these tests pin down: prefill gets a copy of the body with ``max_tokens=1``
(``max_completion_tokens=1`` if present), ``stream=false``, no ``stream_options``, and
``kv_transfer_params={"do_remote_decode": true, "do_remote_prefill": false, ...: null}``;
decode gets the original body with ``kv_transfer_params`` replaced by prefill's answered
object, unchanged (our ``remote_prompt_tokens``/``remote_prompt_digest`` included). Both get
the same ``X-Request-Id``, made by the router (``___prefill_addr_H:P___decode_addr_H:P_<hex>``,
a client's own id is dropped). Without vllm-router installed the tests skip.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvshare_connector.toolkit.launcher import (
    SIDE_CHANNEL_STRIDE,
    EngineSpec,
    ServeConfig,
    pd_deployment,
    router_argv,
    start_waves,
    vllm_router_available,
)
from kvshare_connector.toolkit.procs import (
    ManagedProcess,
    free_port_run,
    pick_free_port,
    stop_processes,
)
from kvshare_connector.toolkit.procs import wait_healthy as wait_ok
from kvshare_connector.transfer.wire.kv_params import (
    kv_transfer_params,
    prompt_mismatch,
    remote_prefill_params,
)
from kvshare_connector.transfer.wire.protocol import NOTIF_DONE, notification, parse_notification

from .support.fake_vllm_server import ThreadServer, fake_answer, fake_server, fake_text

FAKE = Path(__file__).resolve().parent / "support" / "fake_vllm_server.py"
FAKE_CMD = (
    f"{{python}} {shlex.quote(str(FAKE))} {{model}} --role {{role}} --host {{host}} --port {{port}}"
)
needs_router = pytest.mark.skipif(
    not vllm_router_available(),
    reason="vllm-router not installed (pip install 'kvshare-connector[router]')",
)


def _spec(role: str, i: int, url: str) -> EngineSpec:
    port = int(url.rsplit(":", 1)[1])
    return EngineSpec(f"{role}{i}", role, "127.0.0.1", port, [], {"CUDA_VISIBLE_DEVICES": "0"})


@contextmanager
def router_over(prefills: list[str], decodes: list[str], log: Path) -> Iterator[str]:
    """The real router (round robin) over these URLs; yields its endpoint."""
    cfg = ServeConfig(model="m", port=pick_free_port())
    engines = [_spec("prefill", i, u) for i, u in enumerate(prefills)]
    engines += [_spec("decode", i, u) for i, u in enumerate(decodes)]
    proc = ManagedProcess("router", router_argv(cfg, engines, pick_free_port()), os.environ, log)
    proc.start()
    try:
        url = f"http://127.0.0.1:{cfg.port}"
        wait_ok(url + "/health", proc, 60)
        yield url
    finally:
        stop_processes([proc], 5)


def test_router_command_and_start_waves() -> None:
    cfg = ServeConfig(model="m", port=8000, router="vllm-router", router_args=["--x", "1"])
    engines = [_spec("prefill", 0, "http://127.0.0.1:8100")]
    engines += [_spec("decode", i, f"http://127.0.0.1:{8200 + i}") for i in range(2)]
    argv = router_argv(cfg, engines, 29001)
    assert argv[1:4] == ["-m", "vllm_router.launch_router", "--vllm-pd-disaggregation"]
    text = " ".join(argv)
    assert "--prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --decode " in text
    assert "--policy round_robin" in text and "--prometheus-port 29001" in text
    assert argv[-2:] == ["--x", "1"]
    with pytest.raises(ValueError, match="router"):
        ServeConfig(model="m", router="nginx")
    # One engine per GPU per wave: 1P2D with prefill on 0 and both decodes on 1.
    engines[1].env["CUDA_VISIBLE_DEVICES"] = engines[2].env["CUDA_VISIBLE_DEVICES"] = "1"
    waves = start_waves(engines, None)
    assert [[e.name for e in w] for w in waves] == [["prefill0", "decode0"], ["decode1"]]
    assert len(start_waves(engines, True)) == 1 and len(start_waves(engines, False)) == 3


def test_router_style_request_ids_survive_our_notifications() -> None:
    rid = "___prefill_addr_127.0.0.1:8100___decode_addr_127.0.0.1:8201_0123abcd"
    assert parse_notification(notification(NOTIF_DONE, rid, "tok")) == (NOTIF_DONE, rid, "tok")


@needs_router
def test_2p2d_behind_the_real_router(tmp_path: Path) -> None:
    with ExitStack() as stack:
        prefills = [stack.enter_context(fake_server("prefill")) for _ in range(2)]
        decodes = [stack.enter_context(fake_server("decode")) for _ in range(2)]
        url = stack.enter_context(
            router_over([p.url for p in prefills], [d.url for d in decodes], tmp_path / "r.log")
        )
        with httpx.Client(base_url=url, timeout=20) as client:
            for i in range(8):
                prompt = f"Question: What is {i} + 5?\nAnswer:"
                body: dict[str, Any] = {"model": "fake-model", "max_tokens": 16}
                if i % 4 == 3:
                    body["messages"] = [{"role": "user", "content": prompt}]
                    resp = client.post("/v1/chat/completions", json=body)
                    assert resp.status_code == 200, resp.text
                    text = resp.json()["choices"][0]["message"]["content"]
                else:
                    body.update(prompt=prompt, stream=i % 2 == 1)
                    if body["stream"]:
                        body["stream_options"] = {"include_usage": True}
                    resp = client.post("/v1/completions", json=body)
                    assert resp.status_code == 200, resp.text
                    text = (
                        "".join(e["choices"][0]["text"] for e in _events(resp.text))
                        if body["stream"]
                        else resp.json()["choices"][0]["text"]
                    )
                assert (
                    text == fake_text(prompt)[: len(text)]
                    and f"#### {fake_answer(i, '+', 5)}" in text
                )
    # Round robin: each prefill and each decode served half.
    assert [len(s.state.requests) for s in prefills + decodes] == [4, 4, 4, 4]
    issued = {}
    for p in prefills:
        for r in p.state.requests:
            body = r["body"]
            assert body["max_tokens"] == 1 and body["stream"] is False
            assert "stream_options" not in body
            assert body["kv_transfer_params"]["do_remote_decode"] is True
            assert r["request_id"].startswith("___prefill_addr_127.0.0.1:")
            issued[r["request_id"]] = p.state.engine_id
    for d in decodes:
        for r in d.state.requests:
            kv = r["body"]["kv_transfer_params"]
            # prefill's answer, unchanged, to the request with the same id
            assert kv["remote_request_id"] == r["request_id"]
            assert kv["remote_engine_id"] == issued[r["request_id"]]
            assert r["body"]["max_tokens"] == 16


def _events(text: str) -> list[dict[str, Any]]:
    lines = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    return [json.loads(x) for x in lines if x != "[DONE]" and json.loads(x).get("choices")]


def _kvshare_app(role: str, seen: list[dict[str, Any]]) -> FastAPI:
    """Prefill answers our connector's real kv_transfer_params; decode checks them with the
    connector's own parser and prompt check, as vLLM's scheduler side would."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        rid = request.headers.get("x-request-id", "")
        seen.append({"body": body, "request_id": rid})
        kv_out = None
        if role == "prefill":
            kv_out = kv_transfer_params(
                remote_block_ids=[[3, 4], [9]], remote_engine_id="eng-p",
                remote_request_id=f"cmpl-{rid}-0", remote_host="127.0.0.1", remote_port=5600,
                remote_num_tokens=len(body["prompt"]), prompt_token_ids=body["prompt"],
            )  # fmt: skip
        else:
            try:
                parsed = remote_prefill_params(body["kv_transfer_params"])
            except Exception as exc:
                return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
            problem = prompt_mismatch(parsed, body["prompt"])
            if problem:
                return JSONResponse({"error": {"message": problem}}, status_code=400)
        choice = {"index": 0, "text": f" {role} ok", "finish_reason": "length"}
        return JSONResponse({"choices": [choice], "kv_transfer_params": kv_out})

    return app


@needs_router
def test_our_kv_transfer_params_pass_the_router_intact(tmp_path: Path) -> None:
    seen_p: list[dict[str, Any]] = []
    seen_d: list[dict[str, Any]] = []
    with (
        ThreadServer(_kvshare_app("prefill", seen_p)) as p,
        ThreadServer(_kvshare_app("decode", seen_d)) as d,
        router_over([p.url], [d.url], tmp_path / "r.log") as url,
    ):
        prompt = list(range(40, 90))
        body = {"model": "m", "prompt": prompt, "max_tokens": 8, "ignore_eos": True}
        resp = httpx.post(url + "/v1/completions", json=body, timeout=20)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == " decode ok"
    kv = seen_d[0]["body"]["kv_transfer_params"]
    assert kv["remote_prompt_tokens"] == 50 and len(kv["remote_prompt_digest"]) == 64
    assert seen_d[0]["body"]["ignore_eos"] is True and seen_d[0]["body"]["max_tokens"] == 8
    assert seen_p[0]["body"]["ignore_eos"] is True  # sampling fields reach prefill too


@needs_router
def test_router_answers_to_prefill_failures(tmp_path: Path) -> None:
    """What the router makes of a failing prefill (no retry on another prefill in 0.1.17):
    a 4xx passes through, a 5xx or a non-JSON answer becomes a plain-text 500."""
    with (
        fake_server("prefill") as p,
        fake_server("decode") as d,
        router_over([p.url], [d.url], tmp_path / "r.log") as url,
    ):
        body = {"model": "fake-model", "prompt": "What is 2 + 5?", "max_tokens": 12}
        codes = {}
        for mode in ("error400", "error500", "garbage"):
            p.state.fail_mode = mode
            codes[mode] = httpx.post(url + "/v1/completions", json=body, timeout=20).status_code
        assert codes == {"error400": 400, "error500": 500, "garbage": 500}
        assert d.state.hits["completions"] == 0
        p.state.fail_mode = "none"
        assert httpx.post(url + "/v1/completions", json=body, timeout=20).status_code == 200


@needs_router
def test_serve_pd_2p2d_with_router_subprocesses(tmp_path: Path) -> None:
    cfg = ServeConfig(
        model="fake-model", server_cmd=FAKE_CMD, log_dir=tmp_path, num_prefill=2, num_decode=2,
        router="vllm-router", port=pick_free_port(), prefill_port=free_port_run(2),
        decode_port=free_port_run(2), side_channel_port=free_port_run(4 * SIDE_CHANNEL_STRIDE),
        ready_timeout=30,
        grace=5,
    )  # fmt: skip
    # The launcher numbers ports up from the first one of each role.
    deployment = pd_deployment(cfg)
    with deployment:
        assert [p.name for p in deployment.procs][-1] == "router"
        for i in range(6):
            body = {"model": "fake-model", "prompt": f"What is {i} * 3?", "max_tokens": 12}
            resp = httpx.post(deployment.endpoint + "/v1/completions", json=body, timeout=20)
            assert resp.status_code == 200, resp.text
            assert f"#### {fake_answer(i, '*', 3)}" in resp.json()["choices"][0]["text"]
        hits = {
            e.name: httpx.get(e.url + "/debug/stats", timeout=5).json()["hits"].get("completions")
            for e in deployment.engines
        }
    assert hits == {"prefill0": 3, "prefill1": 3, "decode0": 3, "decode1": 3}
    assert (tmp_path / "router.log").read_text().startswith("$ ")
    assert not any(p.alive() for p in deployment.procs)


def test_serve_pd_cli_router_options() -> None:
    from kvshare_connector.toolkit.cli import build_parser, serve_config_from_args

    def config(*argv: str) -> Any:
        args = build_parser().parse_args(["serve-pd", "m", *argv])
        args.passthrough = []
        return serve_config_from_args(args)

    cfg = config(
        "--router", "vllm-router", "--router-policy", "power_of_two", "--num-decode", "2",
        "--router-metrics-port", "29100", "--router-args", "--disable-retries --queue-size 0",
    )  # fmt: skip
    assert (cfg.router, cfg.router_policy, cfg.router_metrics_port) == (
        "vllm-router", "power_of_two", 29100)  # fmt: skip
    assert cfg.router_args == ["--disable-retries", "--queue-size", "0"]
    assert (config().router, config().router_policy) == ("kvshare", "round_robin")
