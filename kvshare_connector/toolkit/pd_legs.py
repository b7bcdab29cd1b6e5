"""The bodies of a PD request's two legs, and the prompt's token ids handed from one to the
other.

A completions prompt given as text is tokenized by prefill's server; the decode leg used to
carry the same text, so decode's server tokenized it a second time before decode's engine
saw the request, on the path of every request's first token: with the serving benchmark's
small BPE vocabulary on one CPU core 1.5 ms for a 1k prompt, 55 ms for 32k
(``lab/benchmarks/bench_prompt_handoff.py``). Prefill's server returns the ids it computed
(``return_token_ids``, vLLM 0.26 and 0.33) and the decode leg carries them instead: the same
ids by construction, so decode's prompt check against prefill's digest holds, and JSON of
32k ids costs ~4 ms. Chat requests keep their messages (a chat endpoint takes no ids).
Both legs carry one request id and the client's credentials (``make_request_id``,
``forwarded_headers``).
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

#: What the prefill request carries: "compute the KV, keep it for a remote decode".
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def count_prompts(prompt: Any) -> int:
    """How many prompts a completions ``prompt`` holds (str, token ids, or lists of those)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def text_prompt(path: str, body: dict[str, Any]) -> bool:
    """A completions request whose one prompt is text: its ids can be handed to decode.
    Not with ``echo``: the client gets its prompt back as decode's server sees it (text as
    given, not ids turned back into text), and lm-eval's log-likelihoods read it."""
    if path != "/v1/completions" or body.get("echo"):
        return False
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return isinstance(prompt, str)


def make_prefill_body(body: dict[str, Any], want_token_ids: bool = False) -> dict[str, Any]:
    """The prefill request: the client's body asking for one token, unstreamed, KV kept;
    with ``want_token_ids`` it also asks for the prompt's token ids."""
    prefill = copy.deepcopy(body)
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill["stream"] = False
    # vLLM rejects stream_options without stream and min_tokens > max_tokens.
    prefill.pop("stream_options", None)
    prefill.pop("min_tokens", None)
    prefill["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    if want_token_ids:
        prefill["return_token_ids"] = True
    return prefill


def answered_token_ids(answer: Any, kv: dict[str, Any]) -> list[int] | None:
    """The prompt's token ids in prefill's answer, or None (none given, or not a list of
    non-negative ints, or another count than prefill's own ``remote_prompt_tokens``): then
    the decode leg keeps the text."""
    try:
        ids = answer["choices"][0]["prompt_token_ids"]
    except (KeyError, IndexError, TypeError):
        return None
    if not isinstance(ids, list) or not ids:
        return None
    if not all(type(i) is int and i >= 0 for i in ids):
        return None
    count = kv.get("remote_prompt_tokens")
    if isinstance(count, int) and count != len(ids):
        return None
    return ids


def make_decode_body(
    body: dict[str, Any], kv: dict[str, Any], token_ids: list[int] | None
) -> dict[str, Any]:
    """The decode request: the client's body with prefill's ``kv_transfer_params``, and the
    prompt as prefill's token ids when there are some."""
    decode = {**body, "kv_transfer_params": kv}
    if token_ids is not None:
        decode["prompt"] = token_ids
    return decode


_FORWARDED_HEADERS = ("authorization",)


def make_request_id(client_id: str | None) -> str:
    """A unique id for both servers. vLLM builds its internal request id from X-Request-Id,
    and a client that reuses one across concurrent requests must not make two PD requests
    collide on a prefill server; the client's id is kept as a prefix for tracing."""
    suffix = uuid.uuid4().hex
    client_id = (client_id or "").strip()
    return f"{client_id}-{suffix[:12]}" if client_id else f"pd-{suffix}"


def forwarded_headers(incoming: Any) -> dict[str, str]:
    """Client headers worth passing on (credentials), cleaned: clients such as lm-eval send
    ``Authorization: Bearer `` with an empty key, which is not a legal header value."""
    out = {}
    for name in _FORWARDED_HEADERS:
        value = (incoming.get(name) or "").strip()
        if value and value.lower() != "bearer":
            out[name] = value
    return out
