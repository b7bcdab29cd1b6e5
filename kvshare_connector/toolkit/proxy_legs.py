"""How one leg of a PD request reaches one backend: the servers of each side, failover
between them, a plain or streamed answer, and a side that is down.

``Legs`` is the proxy's HTTP plumbing; ``proxy.PDProxy`` builds on it the PD flow (which legs,
with which bodies). No vLLM here: plain httpx.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import httpx
from fastapi.responses import Response, StreamingResponse

from kvshare_connector.toolkit.pd_legs import make_request_id
from kvshare_connector.toolkit.proxy_backends import (
    ProxyError,
    ProxyOptions,
    RoundRobin,
    check_status,
    transport_error,
)
from kvshare_connector.toolkit.proxy_streams import Rescue, open_stream, relay

logger = logging.getLogger("kvshare_connector.toolkit.proxy")

REQUEST_ID_HEADER = "X-Request-Id"
T = TypeVar("T")
#: How a leg failed when every server of its side was tried: none is serving (refused the
#: connection, closed it unanswered after the resend, or its engine is dead). Not a timeout:
#: a slow server still computes the request; not an answer from a server that is up (an
#: error, a client error): it must be seen.
SIDE_DOWN = ("backend_unreachable", "backend_dropped", "backend_dead")
#: An answer that may come from a server whose engine died: vLLM's API server outlives its
#: EngineCore and answers HTTP 500, or an error event in a stream, while its ``/health``
#: says 503 (vLLM 0.26 and 0.33; until the server exits). ``Legs.diagnose`` asks ``/health``.
MAYBE_DEAD = ("bad_backend_response", "backend_error_event")


def without_kv_params(body: dict[str, Any]) -> dict[str, Any]:
    """A leg's body as a plain request: one server computes it whole, as colocated."""
    return {k: v for k, v in body.items() if k != "kv_transfer_params"}


class Legs:
    """The backends of each side, and legs sent to them."""

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        options: ProxyOptions,
    ) -> None:
        self.prefill = RoundRobin(prefill_urls)
        self.decode = RoundRobin(decode_urls)
        self.options = options
        self.timeouts = options.timeouts
        self.served_alone: Counter[str] = Counter()  # by the side that served them
        self.client: httpx.AsyncClient | None = None

    def _client(self) -> httpx.AsyncClient:
        if self.client is None:
            raise RuntimeError("proxy HTTP client not started (app lifespan not running)")
        return self.client

    def pool(self, side: str) -> RoundRobin:
        return self.prefill if side == "prefill" else self.decode

    async def _failover(
        self,
        pool: RoundRobin,
        request_id: str,
        leg: Callable[[str], Awaitable[T]],
        first: str | None = None,
        resend_dropped: bool = False,
    ) -> tuple[T, str]:
        """``leg(url)`` on ``first`` or the next backend of ``pool``; a backend that refused
        the connection (the request never reached it) is passed over for a while and the
        leg goes to the next one, until each was tried once.

        With ``resend_dropped`` (the prefill leg) a connection closed without an answer (a
        prefill that died under the request, a reused connection it had closed) is sent
        once more, to the next backend (the same one when it is alone): a prefill answer
        nobody received only holds blocks until its lease ends. A backend whose engine is
        dead is not asked again: the leg goes to another one, if any. A decode leg is never sent
        twice: the first decode may have read the KV, which prefill then freed."""
        tried: list[str] = []
        resent = False
        while True:
            url = first if first is not None and not tried else pool.pick(tried)
            try:
                return await leg(url), url
            except ProxyError as exc:
                err = await self.diagnose(exc)
                tried.append(url)
                if err.kind == "backend_unreachable" and len(tried) < len(pool.urls):
                    pool.mark_down(url)
                elif err.kind == "backend_dropped" and resend_dropped and not resent:
                    resent = True
                elif err.kind == "backend_dead" and resend_dropped and not resent \
                        and len(tried) < len(pool.urls):  # fmt: skip
                    resent = True
                    pool.mark_down(url)
                elif err is exc:
                    raise
                else:
                    raise err from exc
                logger.warning("req=%s %s; trying another", request_id, err.message)

    async def probe(self, url: str) -> dict[str, Any]:
        """``url``'s ``/health``: ok, its status, or why it did not answer."""
        try:
            resp = await self._client().get(url + "/health", timeout=self.timeouts.health)
        except httpx.HTTPError as exc:
            return {"url": url, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return {"url": url, "ok": resp.status_code == 200, "status": resp.status_code}

    async def diagnose(self, exc: ProxyError) -> ProxyError:
        """A bad answer (``MAYBE_DEAD``) from a server whose ``/health`` then fails is its
        engine's death (``backend_dead``, a side down): vLLM's own answer to a request its
        EngineCore died under, an HTTP 500 or an error event. Anything else stays as it is:
        a server that is up and answered an error may have run the request."""
        if exc.kind not in MAYBE_DEAD or exc.server is None:
            return exc
        health = await self.probe(exc.server)
        if health["ok"]:
            return exc
        said = f"HTTP {health['status']}" if "status" in health else health["error"]
        return ProxyError(503, f"{exc.message}; its /health then answered {said}: its engine "
                          "is down", server=exc.server, kind="backend_dead")  # fmt: skip

    async def _post(
        self, side: str, url: str, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> httpx.Response:
        try:
            resp = await self._client().post(url + path, json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise transport_error(exc, side, url, self.timeouts) from exc
        check_status(resp, side, url)
        return resp

    async def run_leg(
        self, side: str, url: str, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> Response:
        """An unstreamed leg whose answer goes to the client as it is."""
        resp = await self._post(side, url, path, body, headers)
        return Response(
            content=resp.content,
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type", "application/json"),
        )

    def opener(
        self, side: str, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> Callable[[str], Awaitable[httpx.Response]]:
        """A leg that opens ``side``'s stream at a URL (for ``_failover``)."""

        def open_at(url: str) -> Awaitable[httpx.Response]:
            return open_stream(self._client(), url, path, body, headers, self.timeouts, side)

        return open_at

    async def stream_leg(
        self, side: str, url: str, path: str, body: dict[str, Any], headers: dict[str, str],
        rescue: Rescue | None = None,
    ) -> Response:  # fmt: skip
        """Open the stream first, so a refused request still gets a proper status
        (``rescue``: see ``relay``)."""
        request_id = headers[REQUEST_ID_HEADER]
        resp = await self.opener(side, path, body, headers)(url)
        return StreamingResponse(
            relay(resp, url, request_id, self.timeouts, side=side, rescue=rescue),
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type", "text/event-stream"),
            headers={REQUEST_ID_HEADER: request_id},
        )

    def may_serve_alone(self, exc: ProxyError) -> bool:
        return self.options.serve_alone and exc.kind in SIDE_DOWN

    def rescuer(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Rescue:
        """For a decode stream that broke, or whose first event was an error, before any of
        it reached the client (its server or engine died under the request, ``SIDE_DOWN``
        after ``diagnose``): a prefill server computes ``body`` alone, its stream relayed in
        place of decode's. The client sees one answer, only later."""

        async def rescue(cause: ProxyError) -> tuple[httpx.Response, str, str]:
            cause = await self.diagnose(cause)
            if not self.may_serve_alone(cause):
                raise cause
            resp, url = await self.open_alone("prefill", path, body, headers, cause)
            return resp, url, "prefill"

        return rescue

    def count_alone(self, side: str, request_id: str, cause: ProxyError) -> None:
        self.served_alone[side] += 1
        logger.warning("req=%s: %s; %s computes the request alone", request_id, cause.message,
                       side)  # fmt: skip

    @staticmethod
    def alone_headers(side: str, headers: dict[str, str]) -> dict[str, str]:
        """The headers of a request a ``side`` server computes alone: prefill already holds
        the first leg's KV under the request's id (until its lease), so it gets an id of its
        own; decode is another engine."""
        if side != "prefill":
            return headers
        return {**headers, REQUEST_ID_HEADER: make_request_id(headers[REQUEST_ID_HEADER])}

    async def alone(
        self, side: str, path: str, body: dict[str, Any], headers: dict[str, str],
        cause: ProxyError,
    ) -> Response:  # fmt: skip
        """Every server of the other side is down (``SIDE_DOWN``): a ``side`` server computes
        the whole request as a colocated engine would, so the client gets its answer,
        later, instead of the other side's error; that server's batch pays the compute."""
        request_id = headers[REQUEST_ID_HEADER]
        self.count_alone(side, request_id, cause)
        plain, own = without_kv_params(body), self.alone_headers(side, headers)

        def leg(url: str) -> Awaitable[Response]:
            if plain.get("stream"):
                return self.stream_leg(side, url, path, plain, own)
            return self.run_leg(side, url, path, plain, own)

        response, url = await self._failover(self.pool(side), request_id, leg)
        logger.info("req=%s %s %s=%s: served by %s alone", request_id, path, side, url, side)
        response.headers[REQUEST_ID_HEADER] = own[REQUEST_ID_HEADER]
        return response

    async def open_alone(
        self, side: str, path: str, body: dict[str, Any], headers: dict[str, str],
        cause: ProxyError,
    ) -> tuple[httpx.Response, str]:  # fmt: skip
        """``alone`` for a stream its caller relays itself (the rest of one that opened with
        prefill's first token): the opened stream and the server's URL."""
        request_id = headers[REQUEST_ID_HEADER]
        self.count_alone(side, request_id, cause)
        opener = self.opener(side, path, without_kv_params(body), self.alone_headers(side, headers))
        resp, url = await self._failover(self.pool(side), request_id, opener)
        logger.info("req=%s %s %s=%s: served by %s alone", request_id, path, side, url, side)
        return resp, url
