"""``kv_transfer_params``: what prefill returns for decode, and decode's strict check of it.

The names are vLLM NixlConnector's, so existing PD proxies pass them on unchanged. Decode
takes them from whoever sent the request, so every field is checked before anything
connects anywhere: a host that is not a host name or address, ids that are too long or
hold control characters, negative or absurd counts are refused with the field named.
Patterns match whole strings (``fullmatch``: ``$`` would pass a final newline), and a
host is one that names a single machine the same way everywhere: no unspecified,
multicast or scoped address, and no name a resolver would read as a number instead.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import socket
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from kvshare_connector.transfer.wire.protocol import MAX_BLOCK_IDS_PER_MESSAGE, MAX_ID_CHARS, MAX_TP

# Whole-string patterns, used with ``fullmatch`` only.
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
_PRINTABLE = re.compile(r"[\x21-\x7e]+")  # visible ASCII, no spaces or control characters
_DIGEST = re.compile(r"[0-9a-f]{64}")
MAX_HOST_CHARS = 253
MAX_TOKENS = 1 << 24  # a prompt length beyond any model's context
MAX_BLOCK_ID = (1 << 31) - 1  # vLLM's block tables hold int32 block ids


class KVTransferParamsError(ValueError):
    """Malformed ``kv_transfer_params`` of a request."""


class RemotePrefillParams(msgspec.Struct, kw_only=True):
    """What a decode request must carry to read its KV from a prefill engine."""

    do_remote_prefill: bool
    remote_block_ids: list[list[int]]
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    do_remote_decode: bool = False
    tp_size: int = 1
    remote_num_tokens: int | None = None
    # The prompt prefill computed (absent from proxies and prefills of elsewhere).
    remote_prompt_tokens: int | None = None
    remote_prompt_digest: str | None = None


def prompt_digest(token_ids: Sequence[int]) -> str:
    """SHA-256 of the prompt's token ids (int64 little-endian): what decode checks its own
    prompt against, so KV computed for another prompt is never loaded."""
    h = hashlib.sha256(b"kvshare-prompt-v1\0")
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.hexdigest()


def loaded_prompt_tokens(params: RemotePrefillParams, prompt_len: int) -> int:
    """How many of decode's ``prompt_len`` prompt tokens take their KV from prefill: all of
    them, or prefill's ``remote_prompt_tokens`` when decode's prompt extends prefill's (our
    proxy streams prefill's first token and asks decode for the rest with that token
    appended; prefill computed no KV for it, so decode computes that one position). Only
    with prefill's digest: ``prompt_mismatch`` has then checked that prefix."""
    n = params.remote_prompt_tokens
    if n is None or params.remote_prompt_digest is None:
        return prompt_len
    return min(prompt_len, n)


def prompt_mismatch(params: RemotePrefillParams, token_ids: Sequence[int] | None) -> str | None:
    """Why decode's prompt is not the one prefill computed, or None (also when prefill
    did not say: a proxy or prefill from elsewhere). A prompt that extends prefill's is
    prefill's where its KV is concerned (attention is causal): its first
    ``remote_prompt_tokens`` ids are compared."""
    if params.remote_prompt_digest is None:
        return None
    ids = list(token_ids or ())
    n = params.remote_prompt_tokens
    if n is not None and len(ids) < n:
        return (
            f"the prompt is not the one prefill computed: prefill had "
            f"{n} prompt tokens, this request has {len(ids)}"
        )
    compared = ids[:n] if n is not None else ids
    if prompt_digest(compared) != params.remote_prompt_digest:
        first = f"first {len(compared)} of {len(ids)}" if len(compared) < len(ids) else len(ids)
        return (
            f"the prompt is not the one prefill computed: digest of the prompt's {first} "
            f"token ids differs from prefill's"
        )
    return None


def kv_transfer_params(
    *,
    remote_block_ids: Sequence[Sequence[int]],
    remote_engine_id: str,
    remote_request_id: str,
    remote_host: str,
    remote_port: int,
    remote_num_tokens: int | None,
    tp_size: int = 1,
    prompt_token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The ``kv_transfer_params`` prefill returns for decode (the one place they are built)."""
    prompt = list(prompt_token_ids) if prompt_token_ids is not None else None
    return msgspec.to_builtins(
        RemotePrefillParams(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_block_ids=[list(ids) for ids in remote_block_ids],
            remote_engine_id=remote_engine_id,
            remote_request_id=remote_request_id,
            remote_host=remote_host,
            remote_port=remote_port,
            tp_size=tp_size,
            remote_num_tokens=remote_num_tokens,
            remote_prompt_tokens=len(prompt) if prompt is not None else None,
            remote_prompt_digest=prompt_digest(prompt) if prompt is not None else None,
        )
    )


def remote_prefill_params(params: Any) -> RemotePrefillParams:
    """Validate a decode request's kv_transfer_params (vLLM NixlConnector names)."""
    if not isinstance(params, dict):
        raise KVTransferParamsError(
            f"kv_transfer_params must be an object, got {type(params).__name__}"
        )
    try:
        parsed = msgspec.convert(
            {k: v for k, v in params.items() if k in RemotePrefillParams.__struct_fields__},
            RemotePrefillParams,
            strict=True,
        )
    except msgspec.ValidationError as exc:
        raise KVTransferParamsError(f"kv_transfer_params: {exc}") from exc
    if not 0 < parsed.remote_port < 65536:
        raise KVTransferParamsError(
            f"kv_transfer_params: remote_port {parsed.remote_port} out of range"
        )
    if not 1 <= parsed.tp_size <= MAX_TP or parsed.remote_port + parsed.tp_size > 65536:
        raise KVTransferParamsError(
            f"kv_transfer_params: tp_size {parsed.tp_size} out of range [1, {MAX_TP}] (prefill "
            f"rank r serves on remote_port + r)"
        )
    for group, ids in enumerate(parsed.remote_block_ids):
        if ids and not 0 <= min(ids) <= max(ids) <= MAX_BLOCK_ID:
            worst = min(ids) if min(ids) < 0 else max(ids)
            raise KVTransferParamsError(
                f"kv_transfer_params: block id {worst} not in [0, {MAX_BLOCK_ID}] (vLLM's "
                f"block tables hold int32) - at `$.remote_block_ids[{group}]`"
            )
    _check_fields(parsed)
    return parsed


def host_problem(host: str) -> str | None:
    """Why ``host`` is not one machine's host name or IP address, or None.

    Refused: what is not one host (``0.0.0.0`` and ``::`` connect to this machine on
    Linux, multicast and broadcast reach many), a scoped IPv6 address (its zone is free
    text), and what is neither an address in the strict form ``ipaddress`` accepts nor a
    host name: ``999999``, ``0x7f000001``, ``010.0.0.1`` (which inet_aton, hence
    getaddrinfo, reads as an address of its own) and ``256.1.1.1`` (a name's last label
    is never all digits, RFC 3696), so the allow-list and the peer see the same host."""
    if not 0 < len(host) <= MAX_HOST_CHARS:
        return f"length {len(host)} not in [1, {MAX_HOST_CHARS}]"
    if not _PRINTABLE.fullmatch(host):
        return "holds spaces or control characters"
    if "%" in host:
        return "a scoped IPv6 address (its zone is free text): name the host or its address"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if address is not None:
        if address.is_unspecified:
            return "the unspecified address (any interface), not one host"
        if address.is_multicast or address == ipaddress.IPv4Address("255.255.255.255"):
            return "a multicast or broadcast address, not one host"
        return None
    if not _HOSTNAME.fullmatch(host):
        return "not a host name or IP address"
    try:
        number = socket.inet_aton(host)
    except OSError:
        number = None
    if number is not None:
        return f"not an IP address, yet resolvers read it as {socket.inet_ntoa(number)}"
    if host.rstrip(".").rsplit(".", 1)[-1].isdigit():
        return "not an IP address, and a host name's last label is never all digits"
    return None


def valid_host(host: str) -> bool:
    """A host name or an IP address of one machine (what a side channel is reached at)."""
    return host_problem(host) is None


def _check_fields(p: RemotePrefillParams) -> None:
    """Refuse what no prefill of ours sends, naming the field."""

    def bad(field: str, why: str) -> KVTransferParamsError:
        return KVTransferParamsError(f"kv_transfer_params: {why} - at `$.{field}`")

    why = host_problem(p.remote_host)
    if why is not None:
        raise bad("remote_host", f"{why}: {p.remote_host[:80]!r}")
    for name in ("remote_engine_id", "remote_request_id"):
        value = getattr(p, name)
        if not 0 < len(value) <= MAX_ID_CHARS:
            raise bad(name, f"length {len(value)} not in [1, {MAX_ID_CHARS}]")
        if not _PRINTABLE.fullmatch(value):
            raise bad(name, f"holds spaces or control characters: {value[:80]!r}")
    blocks = sum(len(ids) for ids in p.remote_block_ids)
    if blocks > MAX_BLOCK_IDS_PER_MESSAGE:
        raise bad("remote_block_ids", f"{blocks} block ids (at most {MAX_BLOCK_IDS_PER_MESSAGE})")
    for name in ("remote_num_tokens", "remote_prompt_tokens"):
        value = getattr(p, name)
        if value is not None and not 0 <= value <= MAX_TOKENS:
            raise bad(name, f"{value} not in [0, {MAX_TOKENS}]")
    digest = p.remote_prompt_digest
    if digest is not None and not _DIGEST.fullmatch(digest):
        raise bad("remote_prompt_digest", f"not a SHA-256 hex digest: {digest[:80]!r}")


def is_loopback(host: str) -> bool:
    """Every address ``host`` stands for is a loopback address (a name is resolved, as the
    side channel's bind and decode's connect resolve it)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)
