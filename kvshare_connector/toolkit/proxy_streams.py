"""A backend's SSE stream through the proxy (decode's, or a server's serving alone): opened
so that a refusal keeps its status, then relayed as it comes, or event by event where the
proxy edits a line (first_token.py)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from kvshare_connector.toolkit.proxy_backends import (
    ProxyError,
    ProxyTimeouts,
    check_status,
    error_event,
    transport_error,
)

logger = logging.getLogger("kvshare_connector.toolkit.proxy")


async def open_stream(
    client: httpx.AsyncClient,
    url: str,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
    timeouts: ProxyTimeouts,
    side: str = "decode",
) -> httpx.Response:
    """Open ``side``'s stream; a refusal raises ``ProxyError`` with that server's status."""
    try:
        resp = await client.send(
            client.build_request("POST", url + path, json=body, headers=headers), stream=True
        )
    except httpx.HTTPError as exc:
        raise transport_error(exc, side, url, timeouts) from exc
    if resp.status_code >= 400:
        await resp.aread()
        await resp.aclose()
        check_status(resp, side, url)
    return resp


#: Opens the stream of another server for the same answer, given why the first one broke:
#: (stream, its server's URL, its side); a ``ProxyError`` when it cannot (``proxy_legs``).
Rescue = Callable[[ProxyError], Awaitable[tuple[httpx.Response, str, str]]]


async def relay(
    resp: httpx.Response,
    url: str,
    request_id: str,
    timeouts: ProxyTimeouts,
    edit: Callable[[str], str] | None = None,
    side: str = "decode",
    rescue: Rescue | None = None,
) -> AsyncIterator[bytes]:
    """The stream as it comes (decoded: content-encoding is not relayed), or event by
    event with each line through ``edit``. A break ends it with an error event, unless
    nothing of it was relayed yet and ``rescue`` opens another server's stream, relayed in
    its place (a decode that died under its request: prefill computes it alone). With
    ``rescue``, an error event that comes first is held back and ``rescue`` asked too (an
    engine that died under the request answers so); where it declines, the event goes on."""
    relayed = False
    while True:
        err = switched = None
        events = _events(resp, edit or (_unchanged if rescue else None))
        try:
            async for chunk in events:
                message = None if relayed or rescue is None else error_in(chunk)
                if message is not None:
                    cause = ProxyError(502, f"{side} server {url} answered an error before any "
                                       f"token: {message}", server=url,
                                       kind="backend_error_event")  # fmt: skip
                    switched, rescue = await _try(rescue, cause), None
                    if switched is not None:
                        break
                relayed = True
                yield chunk
        except httpx.HTTPError as exc:
            err = transport_error(exc, side, url, timeouts)
            logger.error("req=%s stream broken: %s", request_id, err.message)
        finally:
            await events.aclose()
            await resp.aclose()
        if switched is not None:
            resp, url, side = switched
            continue
        if err is None:
            return
        if relayed or rescue is None:
            yield error_event(err, request_id)
            return
        try:
            resp, url, side = await rescue(err)
        except ProxyError as exc:
            yield error_event(exc, request_id)
            return
        rescue = None


async def _try(rescue: Rescue, cause: ProxyError) -> tuple[httpx.Response, str, str] | None:
    """``rescue(cause)``, or None where it declines (the server is up: its error stands)."""
    try:
        return await rescue(cause)
    except ProxyError as exc:
        logger.info("%s (not served around: %s)", cause.message, exc.message)
        return None


def _unchanged(line: str) -> str:
    return line


def error_in(event: bytes) -> str | None:
    """The message of an SSE event that is an error (``data: {"error": ...}`` without
    choices, as vLLM streams a failure), else None."""
    for line in event.decode(errors="replace").splitlines():
        if not line.startswith("data:"):
            continue
        try:
            data = json.loads(line[len("data:"):])
        except ValueError:
            continue
        if isinstance(data, dict) and "error" in data and not data.get("choices"):
            error = data["error"]
            return str(error.get("message", error) if isinstance(error, dict) else error)
    return None


async def _events(resp: httpx.Response, edit: Callable[[str], str] | None) -> AsyncIterator[bytes]:
    """``resp``'s body as it comes, or event by event with each line through ``edit``."""
    if edit is None:
        async for chunk in resp.aiter_bytes():
            yield chunk
        return
    event: list[str] = []
    async for line in resp.aiter_lines():
        event.append(edit(line) + "\n")
        if not line:  # an event ends with a blank line
            yield "".join(event).encode()
            event.clear()
    if event:
        yield "".join(event).encode()
