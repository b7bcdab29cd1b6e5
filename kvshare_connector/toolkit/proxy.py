"""OpenAI-compatible prefill/decode (PD) proxy.

One client request becomes two backend requests: a *prefill* request (``max_tokens=1``,
``kv_transfer_params.do_remote_decode=true``) that makes a ``kv_producer`` server compute and
hold the prompt's KV, then the original request plus the ``kv_transfer_params`` that server
answered, sent to a ``kv_consumer`` server that pulls the KV and generates. The parameter
names are those of vLLM's NIXL connector, so this proxy also fronts NIXL deployments. A
completions prompt given as text reaches decode as the token ids prefill computed
(``pd_legs``), so decode's server does not tokenize it again; where the output allows it, a
streamed completion opens with the token prefill sampled and decode generates the rest
(``first_token``).

The proxy never imports vLLM: it is plain FastAPI + httpx, so it runs anywhere.
Errors name the backend and the request id; backend 4xx (client errors) pass through
unchanged, everything else becomes 502 (bad answer, connection dropped), 503 (unreachable)
or 504 (timeout). A backend that refused the connection is passed over; a prefill leg whose
connection dropped without an answer is sent once more; with every server of one side down,
a server of the other side computes the request alone (``proxy_legs``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvshare_connector.common.failpoints import FailpointError, failpoint
from kvshare_connector.toolkit.first_token import (
    FirstToken,
    count_first_token_as_output,
    decode_body_after,
    first_token_or_why,
    ineligible,
    opening_events,
)
from kvshare_connector.toolkit.pd_legs import (  # noqa: F401 (PREFILL_KV_PARAMS: public here)
    PREFILL_KV_PARAMS,
    answered_token_ids,
    count_prompts,
    forwarded_headers,
    make_decode_body,
    make_prefill_body,
    make_request_id,
    text_prompt,
)
from kvshare_connector.toolkit.proxy_backends import (  # noqa: F401 (ProxyTimeouts: public here)
    ProxyError,
    ProxyOptions,
    ProxyTimeouts,
    error_event,
    snippet,
    transport_error,
)
from kvshare_connector.toolkit.proxy_legs import REQUEST_ID_HEADER, Legs
from kvshare_connector.toolkit.proxy_streams import relay

logger = logging.getLogger(__name__)


async def accept(request: Request, path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The client's request as a body the proxy can split, and the headers both legs carry
    (a request id of the proxy's, the client's credentials); a 400 otherwise."""
    request_id = make_request_id(request.headers.get(REQUEST_ID_HEADER))
    request.state.request_id = request_id
    try:
        body = await request.json()
    except ValueError as exc:
        raise ProxyError(400, "request body is not valid JSON", kind="invalid_request") from exc
    if not isinstance(body, dict):
        raise ProxyError(400, "request body must be a JSON object", kind="invalid_request")
    if path == "/v1/completions" and count_prompts(body.get("prompt")) != 1:
        raise ProxyError(
            400,
            "the PD proxy takes one prompt per request (vLLM returns "
            "one kv_transfer_params per response)",
            kind="invalid_request",
        )
    return body, {REQUEST_ID_HEADER: request_id, **forwarded_headers(request.headers)}


def error_response(request: Request, exc: ProxyError) -> Response:
    """A failed request's answer: a backend's client error as it came, else an OpenAI-style
    JSON error naming server and request."""
    request_id = getattr(request.state, "request_id", None)
    headers = {REQUEST_ID_HEADER: request_id} if request_id else {}
    if exc.passthrough is not None:
        logger.warning("req=%s %s: HTTP %d %s", request_id, exc.message, exc.status,
                       snippet(exc.passthrough))  # fmt: skip
        return Response(
            content=exc.passthrough.content,
            status_code=exc.status,
            media_type=exc.passthrough.headers.get("content-type"),
            headers=headers,
        )
    logger.error("req=%s HTTP %d: %s", request_id, exc.status, exc.message)
    error = {"message": exc.message, "type": exc.kind, "code": exc.status,
             "server": exc.server, "request_id": request_id}  # fmt: skip
    return JSONResponse({"error": error}, status_code=exc.status, headers=headers)


class PDProxy(Legs):
    """The proxy's request flow (``proxy_legs.Legs`` carries each leg); ``create_app`` wires
    it into FastAPI."""

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        options: ProxyOptions,
    ) -> None:
        super().__init__(prefill_urls, decode_urls, options)

    async def run_prefill(
        self, url: str, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[dict[str, Any], list[int] | None, dict[str, Any]]:
        """Send the prefill request; return the ``kv_transfer_params`` it answered, the
        prompt's token ids when they were asked for and given, and the whole answer."""
        want_ids = self.options.hand_off_token_ids and text_prompt(path, body)
        prefill_body = make_prefill_body(body, want_token_ids=want_ids)
        resp = await self._post("prefill", url, path, prefill_body, headers)
        try:
            data = resp.json()
        except ValueError as exc:
            raise ProxyError(
                502,
                f"prefill server {url} answered non-JSON: {snippet(resp)}",
                server=url,
                kind="bad_backend_response",
            ) from exc
        kv = data.get("kv_transfer_params") if isinstance(data, dict) else None
        if not isinstance(kv, dict):
            raise ProxyError(
                502,
                f"prefill server {url} answered without kv_transfer_params "
                "(is it running with a KV connector and kv_role kv_producer or "
                "kv_both?)",
                server=url,
                kind="bad_backend_response",
            )
        return kv, answered_token_ids(data, kv) if want_ids else None, data

    def stream_after_first(
        self,
        first: FirstToken,
        path: str,
        decode_body: dict[str, Any],
        opening: list[bytes],
        headers: dict[str, str],
        decode_url: str,
    ) -> Response:
        """The client's stream opens with prefill's token at once; the decode leg is sent
        behind it. With every decode down, or decode's stream broken before any of it was
        relayed, a prefill server continues the stream alone; any other decode failure is an
        error event (the stream is under way)."""
        request_id = headers[REQUEST_ID_HEADER]

        async def events() -> AsyncIterator[bytes]:
            for event in opening:
                yield event
            if first.ends:  # prefill's KV goes at its lease: nobody will read it
                logger.info("req=%s: the first token ends the answer (%s)", request_id,
                            first.finish_reason)  # fmt: skip
                return
            try:
                resp, url, side = await self._open_rest(path, decode_body, headers, decode_url)
            except ProxyError as exc:
                logger.error("req=%s decode leg after the first token: %s", request_id,
                             exc.message)  # fmt: skip
                yield error_event(exc, request_id)
                return
            edit = count_first_token_as_output
            rescue = self.rescuer(path, decode_body, headers) if side == "decode" else None
            async for chunk in relay(resp, url, request_id, self.timeouts, edit, side, rescue):
                yield chunk

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={REQUEST_ID_HEADER: request_id}
        )

    async def _open_rest(
        self, path: str, decode_body: dict[str, Any], headers: dict[str, str], decode_url: str
    ) -> tuple[httpx.Response, str, str]:
        """The rest of a stream opened with prefill's first token: decode's stream; with every
        decode down, a prefill server's, computing the prompt and that token whole. The
        stream, its server's URL and side."""
        request_id = headers[REQUEST_ID_HEADER]
        opener = self.opener("decode", path, decode_body, headers)
        try:
            resp, url = await self._failover(self.decode, request_id, opener, decode_url)
            return resp, url, "decode"
        except ProxyError as exc:
            if not self.may_serve_alone(exc):
                raise
            cause = exc
        resp, url = await self.open_alone("prefill", path, decode_body, headers, cause)
        return resp, url, "prefill"

    async def handle(self, request: Request, path: str) -> Response:
        body, headers = await accept(request, path)
        request_id = headers[REQUEST_ID_HEADER]
        stream = bool(body.get("stream"))
        t0 = time.perf_counter()
        sent: list[str] = []

        def prefill_leg(
            url: str,
        ) -> Awaitable[tuple[dict[str, Any], list[int] | None, dict[str, Any]]]:
            # Each try after the first under an id of its own: a dropped try may have reached
            # prefill, which then holds KV under its id until the lease ends, and two holds
            # (and vLLM's requests) must not share one. Decode gets the id that answered.
            headers[REQUEST_ID_HEADER] = make_request_id(request_id) if sent else request_id
            sent.append(headers[REQUEST_ID_HEADER])
            return self.run_prefill(url, path, body, headers)

        try:
            (kv, token_ids, answer), prefill_url = await self._failover(
                self.prefill, request_id, prefill_leg, resend_dropped=True
            )
        except ProxyError as exc:
            if not self.may_serve_alone(exc):
                raise
            headers[REQUEST_ID_HEADER] = request_id  # decode is another engine
            return await self.alone("decode", path, body, headers, exc)
        request_id = headers[REQUEST_ID_HEADER]
        t1 = time.perf_counter()
        decode_url = self.decode.pick()
        try:
            failpoint("proxy.before_decode")
        except FailpointError as exc:
            raise ProxyError(503, f"decode leg not sent ({exc}): prefill {prefill_url} holds "
                             "the request's KV until its lease ends", server=decode_url,
                             kind="decode_dropped") from exc  # fmt: skip
        first = self._first_token(path, body, kv, token_ids, answer)
        if isinstance(first, FirstToken) and token_ids is not None:
            logger.info(
                "req=%s %s prefill=%s decode=%s: prefill %.1f ms, first token from prefill; "
                "prompt as %d token ids",
                request_id, path, prefill_url, decode_url, (t1 - t0) * 1e3, len(token_ids),
            )  # fmt: skip
            leg = decode_body_after(body, kv, token_ids, first)
            opening = opening_events(first, body, len(token_ids))
            return self.stream_after_first(first, path, leg, opening, headers, decode_url)
        decode_body = make_decode_body(body, kv, token_ids)

        def decode_leg(url: str) -> Awaitable[Response]:
            if stream:
                rescue = self.rescuer(path, body, headers)  # the client's own request
                return self.stream_leg("decode", url, path, decode_body, headers, rescue)
            return self.run_leg("decode", url, path, decode_body, headers)

        try:
            response, decode_url = await self._failover(
                self.decode, request_id, decode_leg, first=decode_url
            )
        except ProxyError as exc:  # before the client got anything: the whole request
            if not self.may_serve_alone(exc):  # on prefill
                raise
            return await self.alone("prefill", path, body, headers, exc)
        logger.info(
            "req=%s %s prefill=%s decode=%s stream=%s: prefill %.1f ms, decode %s %.1f ms%s%s",
            request_id,
            path,
            prefill_url,
            decode_url,
            stream,
            (t1 - t0) * 1e3,
            "stream opened" if stream else "done",
            (time.perf_counter() - t1) * 1e3,
            f"; prompt as {len(token_ids)} token ids" if token_ids is not None else "",
            f"; first token from decode: {first}" if first else "",
        )
        response.headers[REQUEST_ID_HEADER] = request_id
        return response

    def _first_token(
        self,
        path: str,
        body: dict[str, Any],
        kv: dict[str, Any],
        token_ids: list[int] | None,
        answer: dict[str, Any],
    ) -> FirstToken | str | None:
        """Prefill's token where it can open the client's stream (first_token.py): a
        request that allows it, a prefill of ours (it states the prompt it computed, so
        its decode takes a prompt extending it), the prompt's ids in hand. Otherwise why
        not, for the log (None: the hand-off is off, or the prompt's ids are not at hand)."""
        if not self.options.first_token_from_prefill or token_ids is None:
            return None
        if not kv.get("remote_prompt_digest"):
            return "prefill's answer states no prompt digest"
        why = ineligible(path, body)
        return why or first_token_or_why(answer)

    async def passthrough(self, request: Request, method: str, path: str) -> Response:
        """Forward a non-PD request (models, tokenize) to the next decode server."""
        url = self.decode.pick()
        try:
            resp = await self._client().request(
                method,
                url + path,
                content=await request.body(),
                headers={"content-type": "application/json"},
            )
        except httpx.HTTPError as exc:
            raise transport_error(exc, "decode", url, self.timeouts) from exc
        return Response(
            content=resp.content,
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type"),
        )

    async def health(self) -> tuple[bool, dict[str, Any]]:
        """Whether the proxy can serve (a load balancer's question), and every backend's
        answer: "ok" all up; "degraded" some down, requests still served (another server
        of the side, or the other side alone); "unhealthy" no request can be served."""
        urls = self.prefill.urls + self.decode.urls
        probes = await asyncio.gather(*(self.probe(u) for u in urls))
        n = len(self.prefill.urls)
        up = {side: any(p["ok"] for p in part)
              for side, part in (("prefill", probes[:n]), ("decode", probes[n:]))}  # fmt: skip
        serving = all(up.values()) or (self.options.serve_alone and any(up.values()))
        every = all(p["ok"] for p in probes)
        return serving, {
            "status": "ok" if every else "degraded" if serving else "unhealthy",
            "prefill": probes[:n],
            "decode": probes[n:],
            "served_alone": {"decode": self.served_alone["decode"],
                             "prefill": self.served_alone["prefill"]},
        }


def create_app(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    options: ProxyOptions | None = None,
) -> FastAPI:
    """Build the proxy app. The httpx client lives in the app's lifespan (its event loop)."""
    proxy = PDProxy(prefill_urls, decode_urls, options or ProxyOptions())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        cap = proxy.options.max_connections
        limits = httpx.Limits(max_connections=cap, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=proxy.timeouts.as_httpx(), limits=limits) as client:
            proxy.client = client
            logger.info("PD proxy: prefill=%s decode=%s", proxy.prefill.urls, proxy.decode.urls)
            yield
            proxy.client = None

    app = FastAPI(title="kvshare PD proxy", lifespan=lifespan)
    app.state.proxy = proxy

    @app.exception_handler(ProxyError)
    async def on_proxy_error(request: Request, exc: ProxyError) -> Response:
        return error_response(request, exc)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.passthrough(request, "GET", "/v1/models")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await proxy.passthrough(request, "POST", "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await proxy.passthrough(request, "POST", "/detokenize")

    @app.get("/health")
    async def health() -> Response:
        ok, report = await proxy.health()
        return JSONResponse(report, status_code=200 if ok else 503)

    return app


def serve(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    host: str,
    port: int,
    options: ProxyOptions | None = None,
    log_level: str = "info",
) -> None:
    """Run the proxy with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(create_app(prefill_urls, decode_urls, options), host=host, port=port,
                log_level=log_level)  # fmt: skip
