"""Fake prefill/decode servers behind the PD proxy, all in threads (the proxy's tests)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from kvshare_connector.toolkit.proxy import ProxyOptions, ProxyTimeouts, create_app

from .fake_vllm_server import ThreadServer, fake_server

FAST = ProxyTimeouts(connect=2.0, read=5.0, health=1.0)


def fast(**options: Any) -> ProxyOptions:
    """The proxy's options with the tests' short timeouts."""
    return ProxyOptions(timeouts=FAST, **options)

QUESTION = "Question: What is 4 + 5?\nAnswer:"


@contextmanager
def pd_stack(
    n_prefill: int = 1,
    n_decode: int = 1,
    timeouts: ProxyTimeouts = FAST,
    hand_off_token_ids: bool = True,
    first_token_from_prefill: bool = True,
    **prefill_kwargs: Any,
) -> Iterator[tuple[str, list[Any], list[Any]]]:
    """Fake prefill/decode servers plus the proxy, all in threads."""
    with ExitStack() as stack:
        prefills = [
            stack.enter_context(fake_server("prefill", **prefill_kwargs)) for _ in range(n_prefill)
        ]
        decodes = [stack.enter_context(fake_server("decode")) for _ in range(n_decode)]
        options = ProxyOptions(
            timeouts=timeouts,
            hand_off_token_ids=hand_off_token_ids,
            first_token_from_prefill=first_token_from_prefill,
        )
        app = create_app([p.url for p in prefills], [d.url for d in decodes], options)
        proxy = stack.enter_context(ThreadServer(app))
        yield proxy.url, prefills, decodes


def sse_events(text: str) -> list[Any]:
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]
