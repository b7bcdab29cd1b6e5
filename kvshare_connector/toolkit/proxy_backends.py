"""The PD proxy's backends: its options and the timeouts it waits with, the round robin over
each pool, and its errors, each naming the backend and what went wrong (``kind``:
``backend_unreachable``, ``backend_dropped``, ``backend_timeout``, ``bad_backend_response``,
``backend_error``, ``backend_client_error``; ``backend_error_event``, an error event first in
a stream, and ``backend_dead``, a bad answer from a server whose ``/health`` then failed)."""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True)
class ProxyTimeouts:
    """Seconds. ``read`` bounds the wait for each chunk of a response (not the whole
    generation), so long streamed generations are fine while a hung server is caught."""

    connect: float = 10.0
    read: float = 600.0
    write: float = 30.0
    pool: float = 30.0
    health: float = 3.0

    def as_httpx(self) -> httpx.Timeout:
        return httpx.Timeout(connect=self.connect, read=self.read, write=self.write, pool=self.pool)


@dataclass(frozen=True)
class ProxyOptions:
    """How the proxy waits, splits and serves: one object from the command line (``kvshare
    proxy``'s flags) down to the legs, so a new setting is one field, not one more argument
    threaded through ``serve``, ``create_app`` and ``PDProxy``."""

    timeouts: ProxyTimeouts = field(default_factory=ProxyTimeouts)
    #: httpx's cap on open connections to the backends (None: no cap).
    max_connections: int | None = None
    #: A completions prompt given as text reaches decode as prefill's token ids (pd_legs).
    hand_off_token_ids: bool = True
    #: A streamed completion opens with the token prefill sampled (first_token).
    first_token_from_prefill: bool = True
    #: With every server of one side down, the other side computes requests alone (proxy_legs).
    serve_alone: bool = True


class RoundRobin:
    """Cycles over backend URLs, passing over one that refused a connection for
    ``down_s`` seconds (while another is left). The proxy runs on one event loop, so no
    lock is needed."""

    def __init__(self, urls: Sequence[str], down_s: float = 5.0) -> None:
        if not urls:
            raise ValueError("need at least one backend URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.down_s = down_s
        self._next = 0
        self._down_until: dict[str, float] = {}

    def pick(self, tried: Collection[str] = ()) -> str:
        """The next URL not in ``tried``, one marked down only when no other is left."""
        order = [self.urls[(self._next + i) % len(self.urls)] for i in range(len(self.urls))]
        self._next += 1
        fresh = [u for u in order if u not in tried]
        now = time.monotonic()
        up = [u for u in fresh if self._down_until.get(u, 0.0) <= now]
        return (up or fresh or order)[0]

    def mark_down(self, url: str) -> None:
        self._down_until[url] = time.monotonic() + self.down_s


class ProxyError(Exception):
    """A failed request, rendered as an OpenAI-style JSON error naming server and request."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        server: str | None = None,
        kind: str = "proxy_error",
        passthrough: httpx.Response | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.server = server
        self.kind = kind
        self.passthrough = passthrough


def snippet(resp: httpx.Response, limit: int = 300) -> str:
    text = resp.text.strip().replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


def check_status(resp: httpx.Response, side: str, url: str) -> None:
    if resp.status_code < 400:
        return
    if resp.status_code < 500:
        raise ProxyError(
            resp.status_code,
            f"{side} server {url} rejected the request",
            server=url,
            kind="backend_client_error",
            passthrough=resp,
        )
    raise ProxyError(
        502,
        f"{side} server {url} answered HTTP {resp.status_code}: {snippet(resp)}",
        server=url,
        kind="bad_backend_response",
    )


def transport_error(
    exc: httpx.HTTPError, side: str, url: str, timeouts: ProxyTimeouts
) -> ProxyError:
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return ProxyError(
            503,
            f"{side} server {url} is unreachable ({type(exc).__name__}: {exc})",
            server=url,
            kind="backend_unreachable",
        )
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        return ProxyError(
            502,
            f"{side} server {url} closed the connection without an answer "
            f"({type(exc).__name__}: {exc})",
            server=url,
            kind="backend_dropped",
        )
    if isinstance(exc, httpx.TimeoutException):
        return ProxyError(
            504,
            f"{side} server {url} timed out ({type(exc).__name__}; read timeout {timeouts.read}s)",
            server=url,
            kind="backend_timeout",
        )
    return ProxyError(
        502,
        f"{side} server {url} failed: {type(exc).__name__}: {exc}",
        server=url,
        kind="backend_error",
    )


def error_event(err: ProxyError, request_id: str) -> bytes:
    """An SSE event naming a failure in a stream already under way (its status is sent)."""
    payload = {"error": {"message": err.message, "type": err.kind, "request_id": request_id}}
    return f"data: {json.dumps(payload)}\n\n".encode()
