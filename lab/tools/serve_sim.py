"""``vllm serve`` where vLLM cannot serve (no GPU): its OpenAI completions endpoint over
``engine_sim``'s engine, for the serving stack's CPU tests.

Real: the HTTP leg as a PD proxy sees it (``kv_transfer_params`` in and out, the request id
from ``X-Request-Id``, ``return_token_ids``), vLLM's ``Scheduler``, the connector vLLM's
factory makes from ``--kv-transfer-config`` in both roles, vLLM-made KV tensors and NIXL,
with the environment ``vllm serve`` reads (``VLLM_NIXL_SIDE_CHANNEL_HOST``/``PORT``, the
secret). Emulated: the forward. A prompt's KV is a pattern keyed by its token ids
(``kvcheck``: prefill writes it, decode checks every layer of what it loaded against it)
and the sampled tokens are fixed. ``serve-pd --server-cmd`` starts it in place of vllm::

    kvshare serve-pd g4tiny --role prefill --host 0.0.0.0 --secret-file S --server-cmd \\
      '{python} -m lab.tools.serve_sim {model} --host {host} --port {port}'

Options of ``vllm serve`` it has no use for (``--gpu-memory-utilization``...) are ignored.
Each answer carries ``kvshare_sim``: the tokens decode loaded and the layer-blocks that
differ from prefill's pattern (``kv_mismatches``; None where nothing was loaded).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import queue
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from lab.tools.engine_sim import Engine

logger = logging.getLogger("lab.tools.serve_sim")

FIRST_TOKEN_ID = 3  # text is its UTF-8 bytes, each + 3 (ids 0-2 stay special)


def encode(text: str) -> list[int]:
    return [b + FIRST_TOKEN_ID for b in text.encode()]


def decode_text(ids: list[int]) -> str:
    return "".join(f" t{i}" for i in ids)


def prompt_seed(ids: list[int]) -> int:
    """The KV pattern of a prompt: its ids, hashed (same prompt, same KV, on any engine)."""
    digest = hashlib.sha256(json.dumps(ids).encode()).digest()
    return int.from_bytes(digest[:4], "little") % 1_000_003


class PromptEngine(Engine):
    """``engine_sim.Engine`` whose emulated model keys a prompt's KV by its token ids, so
    a request of any id loads what prefill wrote for the same prompt."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seeds: dict[str, int] = {}  # request -> its prompt's pattern (prefill's prompt)
        self.loaded_tokens: dict[str, int] = {}  # request -> the tokens its load brought

    def written_seed(self, req_id: str) -> int:
        return self.seeds[req_id]

    def loaded_seed(self, req_id: str) -> int:
        return self.seeds[req_id]

    def check_loaded(self, req_id: str) -> list[str]:
        self.loaded_tokens[req_id] = self.scheduler.requests[req_id].num_computed_tokens
        return super().check_loaded(req_id)


class Pending:
    """A request on its way through the engine, and the HTTP handler waiting for it."""

    def __init__(self, request: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.done = loop.create_future()
        self.loop = loop


class EngineLoop:
    """The engine on a thread of its own: requests queue in, each step runs vLLM's
    scheduler and the connector's hooks, finished requests go back to their handler."""

    def __init__(self, engine: PromptEngine) -> None:
        self.engine = engine
        self.inbox: queue.Queue[Pending] = queue.Queue()
        self.pending: dict[str, Pending] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="serve-sim-engine", daemon=True)

    def _run(self) -> None:
        while not self.stopping.is_set():
            busy = bool(self.pending)
            try:
                item = self.inbox.get(timeout=0.001 if busy else 0.02)
                self.engine.scheduler.add_request(item.request)
                self.pending[item.request.request_id] = item
            except queue.Empty:
                pass
            try:
                self.engine.step()
            except Exception as exc:  # an engine that fails says so to every waiter
                logger.exception("engine step failed")
                for item in self.pending.values():
                    item.loop.call_soon_threadsafe(_fail, item.done, exc)
                self.pending.clear()
                continue
            for rid in [r for r in self.pending if r in self.engine.outputs]:
                item = self.pending.pop(rid)
                output = self.engine.outputs.pop(rid)
                item.loop.call_soon_threadsafe(_finish, item.done, output)


def _finish(future: asyncio.Future, output: Any) -> None:
    if not future.done():
        future.set_result(output)


def _fail(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def make_request(request_id: str, ids: list[int], max_tokens: int, params: Any, hasher: Any):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sampling = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        extra_args={"kv_transfer_params": params} if params is not None else None,
    )
    return Request(request_id, ids, sampling, None, block_hasher=hasher)


def prompt_ids(prompt: Any) -> list[int]:
    """One prompt: text, or token ids (what a proxy hands decode)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return encode(prompt)
    if isinstance(prompt, list) and prompt and all(type(i) is int and i >= 0 for i in prompt):
        return list(prompt)
    raise ValueError("prompt must be one non-empty text or list of token ids")


def create_app(loop_: EngineLoop, model: str) -> Any:
    app = FastAPI()
    engine = loop_.engine

    @app.get("/health")
    async def health() -> Any:
        return JSONResponse({}, status_code=200 if loop_.thread.is_alive() else 503)

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": model, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Any:
        body = await raw.json()
        if body.get("stream"):
            return JSONResponse({"error": {"message": "serve_sim: no streaming"}}, 400)
        try:
            ids = prompt_ids(body.get("prompt"))
        except ValueError as exc:
            return JSONResponse({"error": {"message": str(exc)}}, 400)
        params = body.get("kv_transfer_params")
        base = raw.headers.get("x-request-id") or uuid.uuid4().hex
        rid = f"cmpl-{base}-0"  # as vLLM's server names it
        # The KV this prompt's prefill computed: decode's prompt may extend prefill's.
        known = params.get("remote_prompt_tokens") if isinstance(params, dict) else None
        engine.seeds[rid] = prompt_seed(ids[:known] if isinstance(known, int) else ids)
        request = make_request(
            rid, ids, int(body.get("max_tokens") or 16), params, engine.scheduler.block_hasher
        )
        item = Pending(request, asyncio.get_running_loop())
        loop_.inbox.put(item)
        output = await item.done
        out_ids = list(request.output_token_ids)
        reason = str(output.finish_reason) if output.finish_reason is not None else None
        mismatches = engine.loaded.pop(rid, None)
        engine.seeds.pop(rid, None)
        choice: dict[str, Any] = {
            "index": 0, "text": decode_text(out_ids), "logprobs": None,
            "finish_reason": reason, "stop_reason": None,
        }  # fmt: skip
        if body.get("return_token_ids"):
            choice["prompt_token_ids"] = ids
            choice["token_ids"] = out_ids
        answer = {
            "id": rid, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out_ids),
                      "total_tokens": len(ids) + len(out_ids)},
            "kv_transfer_params": output.kv_transfer_params,
            "kvshare_sim": {
                "loaded_tokens": engine.loaded_tokens.pop(rid, 0),
                "kv_mismatches": mismatches,
            },
        }  # fmt: skip
        return JSONResponse(answer, status_code=500 if reason == "error" else 200)

    return app


def kv_transfer(config: str) -> dict[str, Any]:
    """``build_engine``'s connector arguments from vLLM's ``--kv-transfer-config``."""
    kv = json.loads(config)
    return dict(
        role=kv["kv_role"],
        extra=kv.get("kv_connector_extra_config") or {},
        connector=kv.get("kv_connector", "KVShareConnector"),
        module_path=kv.get("kv_connector_module_path"),
        failure_policy=kv.get("kv_load_failure_policy", "fail"),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="serve_sim", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a cpu_stack model: g4tiny, gemma4_e2b_shape, ...")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--kv-transfer-config", required=True)
    parser.add_argument("--layout", default="per_layer")
    parser.add_argument("--served-model-name", default=None)
    args, ignored = parser.parse_known_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost")  # vLLM's default
    if ignored:
        logger.info("vllm serve options with no use here, ignored: %s", " ".join(ignored))
    kv = kv_transfer(args.kv_transfer_config)
    port = int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))
    engine = PromptEngine(args.model, args.layout, kv.pop("role"), port, kv.pop("extra"), **kv)
    loop_ = EngineLoop(engine)
    loop_.thread.start()
    import uvicorn

    try:
        app = create_app(loop_, args.served_model_name or args.model)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        loop_.stopping.set()
        loop_.thread.join(timeout=10)
        engine.close()


if __name__ == "__main__":
    main()
