"""A fake vLLM OpenAI server for CPU tests of the PD proxy, the launcher and the sweep.

It speaks the same HTTP as ``vllm serve`` (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health``, SSE streaming) and is strict about the PD protocol, so a proxy
bug shows up as a 400 with a precise message instead of a silently wrong answer:

* ``prefill`` requires ``max_tokens == 1``, ``stream`` false and
  ``kv_transfer_params.do_remote_decode`` true; it answers NIXL-style ``kv_transfer_params``
  and remembers them under ``remote_request_id``.
* ``decode`` requires exactly those parameters: it *pulls* the record from the prefill
  server named by ``remote_host``/``remote_port`` (this fake's HTTP port doubles as its side
  channel), checks every field and the prompt digest, and consumes the record (a second
  pull fails, as a freed KV block would).
* ``colocated`` is a plain server.

Generation is deterministic and derived from the prompt (``fake_model.py``), so PD output can
be compared with the colocated baseline. Like our prefill, a prefill states the prompt it
computed (``remote_prompt_tokens``/``remote_prompt_digest``; not with ``kvshare_params=False``,
as NIXL's), and a decode then takes a prompt of ids that ends with the words prefill
generated (the proxy's first-token hand-off) and continues after them.

With ``FAKE_CORRUPT_DECODE=1`` in its environment a decode server shifts every number it
generates (a negative control for the sweep).

For the fault tests (lab/benchmarks/gpu/serving/faults.py): ``KVSHARE_FAILPOINTS`` is honoured
with the real parser, a prefill hitting its ``source.*`` points at each KV pull and a decode
its ``sink.*``/``peers.*`` points at each load, before it pulls (so ``exit@K`` dies at the
K+1st); a prefill reports ``vllm:kv_cache_usage_perc`` from the KV records it still holds,
freed when pulled or, with ``FAKE_KV_LEASE=S``, after S seconds (without: a dead decode's
records leak); ``FAKE_PREFILL_LOCAL=1`` lets a prefill serve plain requests;
``FAKE_VERIFY_FAILURES=N`` makes a decode report N verify_kv failures;
``fail_mode="engine_dead"`` answers every request as vLLM does once its EngineCore died
(HTTP 500, or an error event in a stream) and fails ``/health``; ``"error_event"`` answers the
same while ``/health`` stays 200 (a server that is up and answered an error);
``FAKE_DECODE_RECOMPUTE=1`` makes a decode that cannot pull (prefill unreachable, or it holds
no record: killed, restarted) compute the prompt locally and answer 200 with
``kv_transfer_params.kv_load_error``, counted in ``vllm:kvshare_failed_loads_total``, as the
connector does under vLLM's ``recompute`` policy (without it: 400, strict).

Run as ``python tests/support/fake_vllm_server.py --port N --role prefill|decode|colocated``;
unknown (vLLM) arguments are accepted, and ``--kv-transfer-config`` is checked against the role.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import os
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kvshare_connector.common import failpoints

if not __package__:  # run as a script: the project's root, not this folder, is the base
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.support.fake_model import (
    TOKEN,
    digest,
    fake_answer,
    fake_text,
    fake_token_ids,
    fake_tokens,
    prompt_of,
    split_prompt,
    token_logprob,
    word_id,
)
from tests.support.thread_server import ThreadServer

__all__ = ["ThreadServer", "fake_answer", "fake_server", "fake_text", "fake_token_ids"]

KV_KEYS = frozenset(
    {
        "do_remote_prefill",
        "do_remote_decode",
        "remote_engine_id",
        "remote_block_ids",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "tp_size",
        "remote_num_tokens",
    }
)
#: What our prefill adds (the prompt it computed): a decode may then send a prompt that
#: extends it by prefill's first token (the proxy's first-token hand-off).
KVSHARE_KEYS = frozenset({"remote_prompt_tokens", "remote_prompt_digest"})
FAIL_MODES = ("none", "garbage", "no_kv", "bad_kv", "error400", "error500", "slow", "hang_stream",
              "engine_dead", "error_event")
ROLE_TO_KV_ROLES = {
    "prefill": {"kv_producer", "kv_both"},
    "decode": {"kv_consumer", "kv_both"},
    "colocated": {None},
}
ENV_REPORTED = (
    "VLLM_NIXL_SIDE_CHANNEL_PORT",
    "VLLM_NIXL_SIDE_CHANNEL_HOST",
    "CUDA_VISIBLE_DEVICES",
    "ENABLE_KVCACHED",
    "KVCACHED_CONTIGUOUS_LAYOUT",
    "VLLM_USE_V2_MODEL_RUNNER",
    "FAKE_MARKER",
    "FAKE_CORRUPT_DECODE",
)


@functools.cache
def engine_dead_error() -> dict[str, Any]:
    """vLLM's own error body for a request whose EngineCore died: its error response of
    ``EngineDeadError`` (the module moved between 0.26 and 0.33). Made once: importing
    vLLM's entrypoints takes seconds, so a server in a fail mode that needs it makes it
    before it serves."""
    from vllm.v1.engine.exceptions import EngineDeadError

    try:  # vLLM 0.33
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )
    except ImportError:  # vLLM 0.26
        from vllm.entrypoints.serve.utils.error_response import create_error_response
    return create_error_response(EngineDeadError()).model_dump()


def engine_dead_answer(stream: bool) -> Response:
    """What vLLM's API server answers a request whose EngineCore died under it (its server
    outlives the engine): an HTTP 500, or a stream opened 200 with an error event and
    ``[DONE]``."""
    error = engine_dead_error()
    if not stream:
        return JSONResponse(error, status_code=error["error"]["code"])

    async def events():
        yield f"data: {json.dumps(error)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


class PDViolation(Exception):
    """The request breaks the PD protocol; answered as a 400 naming the problem."""


# A pull that waits this long on a stopped prefill fails (as the connector's transfer
# timeout does), under the fault driver's 5 s probe timeout so the stale load is answered.
PULL_TIMEOUT_S = 3.0


class LoadFailed(PDViolation):
    """Decode could not pull the KV (its prefill is gone, or no longer holds it): a 400, or
    with ``FAKE_DECODE_RECOMPUTE=1`` the prompt computed locally."""


@dataclass
class FakeState:
    role: str
    model: str = "fake-model"
    port: int = 0
    fail_mode: str = "none"
    delay: float = 0.0
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    issued: dict[str, dict[str, Any]] = field(default_factory=dict)
    hits: Counter = field(default_factory=Counter)
    requests: list[dict[str, Any]] = field(default_factory=list)
    launch: dict[str, Any] = field(default_factory=dict)
    issued_at: dict[str, float] = field(default_factory=dict)
    failpoints: list[str] = field(default_factory=list)  # armed points of this role
    kvshare_params: bool = True  # a prefill states its prompt, as ours does (not NIXL's)
    gate: threading.Event | None = None  # set: requests are answered (until then they wait)

    def held(self) -> int:
        """KV records still held (those past ``FAKE_KV_LEASE`` seconds freed first)."""
        lease = os.environ.get("FAKE_KV_LEASE")
        if lease:
            now = time.monotonic()
            for rid in [r for r, t in self.issued_at.items() if now - t > float(lease)]:
                self.issued.pop(rid, None)
                self.issued_at.pop(rid, None)
        return len(self.issued)

    def hit_failpoints(self) -> None:
        for name in self.failpoints:
            failpoints.failpoint(name)


def armed_points(role: str) -> list[str]:
    """The points of ``KVSHARE_FAILPOINTS`` this role's fake hits."""
    prefixes = {"prefill": ("source.",), "decode": ("sink.", "peers.")}.get(role, ())
    armed = failpoints.parse(os.environ.get(failpoints.ENV, ""))
    return [n for n in armed if n.startswith(prefixes)]


def _check_prefill(body: dict[str, Any], chat: bool) -> None:
    kv = body.get("kv_transfer_params")
    if not isinstance(kv, dict) or kv.get("do_remote_decode") is not True:
        raise PDViolation(f"prefill expects kv_transfer_params.do_remote_decode=true, got {kv}")
    if kv.get("do_remote_prefill"):
        raise PDViolation("prefill got do_remote_prefill=true")
    if body.get("max_tokens") != 1:
        raise PDViolation(f"prefill expects max_tokens=1, got {body.get('max_tokens')}")
    if chat and "max_completion_tokens" in body and body["max_completion_tokens"] != 1:
        raise PDViolation("prefill expects max_completion_tokens=1")
    if body.get("stream"):
        raise PDViolation("prefill expects stream=false")
    if body.get("stream_options"):
        raise PDViolation("stream_options given with stream=false")  # vLLM rejects this too
    if (body.get("min_tokens") or 0) > 1:
        raise PDViolation("min_tokens > max_tokens")


async def _check_decode(
    state: FakeState, body: dict[str, Any], chat: bool, request_id: str | None
) -> None:
    kv = body.get("kv_transfer_params")
    if not isinstance(kv, dict):
        raise PDViolation("decode expects kv_transfer_params from the prefill server")
    if set(kv) not in (KV_KEYS, KV_KEYS | KVSHARE_KEYS):
        raise PDViolation(f"decode kv_transfer_params keys {sorted(kv)} != {sorted(KV_KEYS)}")
    if split_prompt(body, chat)[1] and not set(kv) >= KVSHARE_KEYS:
        raise PDViolation("a prompt that extends prefill's, for a prefill that did not state it")
    if kv["do_remote_prefill"] is not True or kv["do_remote_decode"] is not False:
        raise PDViolation(f"decode got wrong do_remote_* flags: {kv}")
    if request_id != kv["remote_request_id"]:
        raise PDViolation(
            f"X-Request-Id {request_id!r} != remote_request_id {kv['remote_request_id']!r}"
        )
    url = f"http://{kv['remote_host']}:{kv['remote_port']}/debug/kv/{kv['remote_request_id']}"
    async with httpx.AsyncClient(timeout=PULL_TIMEOUT_S) as client:
        try:
            resp = await client.get(url)
        except httpx.HTTPError as exc:
            raise LoadFailed(f"cannot pull KV from {url}: {exc!r}") from exc
    if resp.status_code == 404:
        raise LoadFailed(f"KV pull from {url} answered 404: {resp.text}")
    if resp.status_code != 200:
        raise PDViolation(f"KV pull from {url} answered {resp.status_code}: {resp.text}")
    record = resp.json()
    if record["kv_transfer_params"] != kv:
        raise PDViolation(f"kv_transfer_params differ from issued: {record} vs {kv}")
    if record["digest"] != digest(body, chat):
        raise PDViolation("prompt differs from the one the prefill server computed KV for")


def _completion_json(
    state: FakeState, body: dict[str, Any], chat: bool, kv_out: dict[str, Any] | None
) -> dict[str, Any]:
    prompt, generated = split_prompt(body, chat)
    max_tokens = body.get("max_completion_tokens") if chat else None
    max_tokens = max_tokens or body.get("max_tokens")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else list(stop)
    corrupt = state.role == "decode" and os.environ.get("FAKE_CORRUPT_DECODE") == "1"
    wanted = max_tokens + len(generated) if max_tokens is not None else None
    tokens, finish = fake_tokens(prompt, wanted, stop, corrupt)
    if [word_id(t) for t in tokens[: len(generated)]] != generated:  # a model continues
        raise PDViolation(f"the prompt ends with {generated}: not what the model generates")
    tokens = tokens[len(generated) :]
    text = "".join(tokens)
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "stop_reason": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = None
    else:
        choice["text"] = text
        if body.get("return_token_ids"):  # as vLLM: the prompt's ids and the generated ones
            choice["prompt_token_ids"] = fake_token_ids(prompt)
            choice["token_ids"] = [word_id(t) for t in tokens]
        choice["logprobs"] = (
            {
                "tokens": tokens,
                "token_logprobs": [token_logprob(t) for t in tokens],
                "top_logprobs": [{t: token_logprob(t)} for t in tokens],
                "text_offset": [],
            }
            if body.get("logprobs")
            else None
        )
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:8]}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": state.model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(TOKEN.findall(prompt)) + len(generated),
            "completion_tokens": len(tokens),
            "total_tokens": len(TOKEN.findall(prompt)) + len(generated) + len(tokens),
        },
        "kv_transfer_params": kv_out,
    }


async def _sse(
    state: FakeState, full: dict[str, Any], chat: bool, stream_options: dict[str, Any] | None
):
    """Stream a finished completion as SSE chunks, one token each."""
    choice = full["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    obj = "chat.completion.chunk" if chat else "text_completion"
    for i, tok in enumerate(TOKEN.findall(text)):
        if state.fail_mode == "hang_stream" and i == 1:
            await asyncio.sleep(3600)
        if chat:
            piece = {"index": 0, "delta": {"content": tok}, "finish_reason": None}
        else:
            piece = {"index": 0, "text": tok, "logprobs": None, "finish_reason": None}
        chunk = {"id": full["id"], "object": obj, "model": state.model, "choices": [piece]}
        yield f"data: {json.dumps(chunk)}\n\n".encode()
        await asyncio.sleep(0)
    last: dict[str, Any] = {"index": 0, "finish_reason": choice["finish_reason"]}
    last.update({"delta": {}} if chat else {"text": ""})
    yield f"data: {json.dumps({'id': full['id'], 'object': obj, 'choices': [last]})}\n\n".encode()
    if (stream_options or {}).get("include_usage"):  # as vLLM: a last chunk of usage
        usage = {"id": full["id"], "object": obj, "choices": [], "usage": full["usage"]}
        yield f"data: {json.dumps(usage)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def create_fake_app(state: FakeState) -> FastAPI:
    """The fake server's FastAPI app; ``state`` stays mutable so tests can change modes."""
    app = FastAPI()
    app.state.fake = state
    if state.fail_mode in ("engine_dead", "error_event"):
        engine_dead_error()

    @app.get("/health")
    async def health() -> Response:  # vLLM's /health is 503 once its engine is dead
        return Response(status_code=503 if state.fail_mode == "engine_dead" else 200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.model, "object": "model"}]}

    @app.get("/debug/stats")
    async def stats() -> dict[str, Any]:
        return {"role": state.role, "hits": dict(state.hits), "engine_id": state.engine_id}

    @app.get("/metrics")
    async def prom_metrics() -> PlainTextResponse:
        """A few of vLLM's series (and the connector's) in Prometheus text, from the hits."""
        served = state.hits["completions"] + state.hits["chat"]
        lab = f'engine="0",model_name="{state.model}"'
        lines = [
            f'vllm:request_success_total{{{lab},finished_reason="length"}} {served}',
            f"vllm:kv_cache_usage_perc{{{lab}}} {state.held() / 100}",
            f"vllm:num_requests_running{{{lab}}} 0.0",
        ]
        if state.role == "decode":
            lines.append(f"vllm:kvshare_read_seconds_count{{{lab}}} {served}")
            lines.append(f"vllm:kvshare_verified_loads_total{{{lab}}} {state.hits['loads']}")
            failed = state.hits["failed_loads"]
            lines.append(f"vllm:kvshare_failed_loads_total{{{lab}}} {failed}")
            bad = os.environ.get("FAKE_VERIFY_FAILURES", "0")
            lines.append(f"vllm:kvshare_verify_failures_total{{{lab}}} {bad}")
        elif state.role == "prefill":
            lines.append(f"vllm:kvshare_sent_total{{{lab}}} {served}")
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.get("/debug/launch")
    async def launch() -> dict[str, Any]:
        return state.launch

    @app.get("/debug/kv/{request_id}")
    async def pull_kv(request_id: str) -> Response:
        state.hit_failpoints()
        state.held()
        state.issued_at.pop(request_id, None)
        record = state.issued.pop(request_id, None)
        if record is None:
            return JSONResponse({"error": f"no KV held for {request_id}"}, status_code=404)
        return JSONResponse(record)

    async def handle(request: Request, chat: bool) -> Response:
        path = "chat" if chat else "completions"
        state.hits[path] += 1
        while state.gate is not None and not state.gate.is_set():
            await asyncio.sleep(0.01)
        if state.delay or state.fail_mode == "slow":
            await asyncio.sleep(state.delay or 30.0)
        if state.fail_mode == "garbage":
            return PlainTextResponse("<html>definitely not JSON</html>", status_code=200)
        if state.fail_mode == "error400":
            return JSONResponse({"error": {"message": "fake: invalid request"}}, status_code=400)
        if state.fail_mode == "error500":
            return JSONResponse({"error": {"message": "fake: engine died"}}, status_code=500)
        body = await request.json()
        request_id = request.headers.get("x-request-id")
        state.requests.append(
            {
                "path": path,
                "body": body,
                "request_id": request_id,
                "authorization": request.headers.get("authorization"),
            }
        )
        if state.fail_mode in ("engine_dead", "error_event"):  # error_event: stays healthy
            return engine_dead_answer(bool(body.get("stream")))
        if body.get("model") not in (None, state.model):
            return JSONResponse(
                {"error": {"message": f"model {body['model']!r} not served"}}, status_code=404
            )
        kv_out = None
        plain = "kv_transfer_params" not in body
        try:
            if state.role == "prefill" and plain and os.environ.get("FAKE_PREFILL_LOCAL") == "1":
                pass  # a plain request on a prefill engine: computed there, as vLLM does
            elif state.role == "prefill":
                _check_prefill(body, chat)
                rid = request_id or uuid.uuid4().hex
                kv_out = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_engine_id": state.engine_id,
                    "remote_block_ids": [[1, 2, 3], [7, 8]],
                    "remote_request_id": rid,
                    "remote_host": "127.0.0.1",
                    "remote_port": state.port,
                    "tp_size": 1,
                    "remote_num_tokens": len(TOKEN.findall(prompt_of(body, chat))),
                }
                if state.kvshare_params:  # ours: the prompt it computed
                    ids = fake_token_ids(prompt_of(body, chat))
                    kv_out["remote_prompt_tokens"] = len(ids)
                    kv_out["remote_prompt_digest"] = hashlib.sha256(str(ids).encode()).hexdigest()
                state.issued[rid] = {"kv_transfer_params": kv_out, "digest": digest(body, chat)}
                state.issued_at[rid] = time.monotonic()
            elif state.role == "decode" and not (
                plain and os.environ.get("FAKE_DECODE_LOCAL") == "1"
            ):  # FAKE_DECODE_LOCAL=1: a request without params is computed locally, as vLLM does
                state.hit_failpoints()
                try:
                    await _check_decode(state, body, chat, request_id)
                    state.hits["loads"] += 1
                except LoadFailed as exc:
                    if os.environ.get("FAKE_DECODE_RECOMPUTE") != "1":
                        raise
                    state.hits["failed_loads"] += 1
                    kv_out = {"kv_load_error": f"KV load failed: {exc}; recomputed locally"}
        except PDViolation as exc:
            return JSONResponse(
                {"error": {"message": f"fake {state.role}: {exc}"}}, status_code=400
            )
        full = _completion_json(state, body, chat, kv_out)
        if state.fail_mode == "no_kv":
            full.pop("kv_transfer_params")
        elif state.fail_mode == "bad_kv" and kv_out:
            full["kv_transfer_params"] = {k: v for k, v in kv_out.items() if k != "tp_size"}
        if body.get("stream"):
            return StreamingResponse(
                _sse(state, full, chat, body.get("stream_options")),
                media_type="text/event-stream",
            )
        return JSONResponse(full)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, chat=True)

    return app


def fake_server(role: str, **kwargs: Any) -> ThreadServer:
    """A fake vLLM server in a thread; its ``FakeState`` is ``server.state``."""
    state = FakeState(role=role, **kwargs)
    server = ThreadServer(create_fake_app(state))
    state.port = server.port
    server.state = state  # type: ignore[attr-defined]
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_pos", nargs="?", help="model (like `vllm serve MODEL`)")
    parser.add_argument("--role", choices=sorted(ROLE_TO_KV_ROLES), required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--kv-transfer-config", default=None)
    parser.add_argument("--fail-mode", choices=FAIL_MODES, default="none")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--startup-delay", type=float, default=0.0)
    args, unknown = parser.parse_known_args(argv)
    kv_role = json.loads(args.kv_transfer_config)["kv_role"] if args.kv_transfer_config else None
    if kv_role not in ROLE_TO_KV_ROLES[args.role]:
        print(f"fake server: role {args.role} cannot run with kv_role {kv_role}", file=sys.stderr)
        return 2
    state = FakeState(
        role=args.role,
        model=args.served_model_name or args.model_pos or "fake-model",
        port=args.port,
        fail_mode=args.fail_mode,
        delay=args.delay,
        failpoints=armed_points(args.role),
    )
    state.launch = {
        "argv": sys.argv[1:] if argv is None else argv,
        "unknown_args": unknown,
        "kv_transfer_config": json.loads(args.kv_transfer_config)
        if args.kv_transfer_config
        else None,
        "env": {k: os.environ.get(k) for k in ENV_REPORTED},
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
    }
    print(f"fake {args.role} server pid={os.getpid()} port={args.port}", flush=True)
    time.sleep(args.startup_delay)
    uvicorn.run(create_fake_app(state), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
