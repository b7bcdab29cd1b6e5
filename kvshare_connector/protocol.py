"""Wire types: the side-channel handshake, kv_transfer_params and transfer notifications.

msgspec structs decoded strictly: a peer speaking garbage, an old version or a wrong type
gets an error that names the field, never a half-filled object. kv_transfer_params keep
vLLM's NixlConnector field names so existing PD proxies work unchanged.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvshare_connector.topology import (
    BlockGeometry,
    Dim,
    GroupSpec,
    KVTopology,
    LayerSpec,
    OwnerLayer,
    Region,
)

PROTOCOL_VERSION = 1
NOTIF_PREFIX = b"kvshare:v1:"
NOTIF_DONE = b"done:"  # decode read the blocks: free them
NOTIF_ABORT = b"abort:"  # decode gave up on the request: free them too


class ProtocolError(ValueError):
    """A message that does not decode into what the protocol promises."""


class KVTransferParamsError(ValueError):
    """Malformed ``kv_transfer_params`` of a request."""


# ---- layout description -------------------------------------------------------------------


class DimMsg(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    label: str
    size: int
    stride: int


class OwnerMsg(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    group: int
    base: int
    block_stride: int
    dims: list[DimMsg]
    split: int
    itemsize: int
    device_id: int
    labels: list[str]


class SpecMsg(msgspec.Struct, forbid_unknown_fields=True):
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    itemsize: int
    kind: str
    sliding_window: int | None = None


class GroupMsg(msgspec.Struct, forbid_unknown_fields=True):
    index: int
    spec: SpecMsg
    layer_names: list[str]


class RegionMsg(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    addr: int
    nbytes: int
    device_id: int


class LayoutMsg(msgspec.Struct, forbid_unknown_fields=True):
    groups: list[GroupMsg]
    owners: list[OwnerMsg]
    sharers: dict[str, str]
    regions: list[RegionMsg]
    num_blocks: int
    layout: str
    fingerprint: str


def layout_to_msg(topology: KVTopology) -> LayoutMsg:
    return LayoutMsg(
        groups=[
            GroupMsg(g.index, _spec_struct(g.spec), list(g.layer_names)) for g in topology.groups
        ],
        owners=[
            OwnerMsg(
                name=o.name,
                group=o.group,
                base=o.geometry.base,
                block_stride=o.geometry.block_stride,
                dims=[DimMsg(d.label, d.size, d.stride) for d in o.geometry.dims],
                split=o.geometry.split,
                itemsize=o.geometry.itemsize,
                device_id=o.geometry.device_id,
                labels=list(o.labels),
            )
            for o in topology.owners.values()
        ],
        sharers=dict(topology.sharers),
        regions=[RegionMsg(r.addr, r.nbytes, r.device_id) for r in topology.regions],
        num_blocks=topology.num_blocks,
        layout=topology.layout,
        fingerprint=topology.logical_fingerprint(),
    )


def _spec_struct(spec: LayerSpec) -> SpecMsg:
    return SpecMsg(
        spec.block_size,
        spec.num_kv_heads,
        spec.head_size,
        spec.dtype,
        spec.itemsize,
        spec.kind,
        spec.sliding_window,
    )


def layout_from_msg(msg: LayoutMsg) -> KVTopology:
    """The peer's topology (addresses in the peer's space), checked for internal sense."""
    groups = tuple(
        GroupSpec(
            g.index,
            LayerSpec(
                g.spec.block_size,
                g.spec.num_kv_heads,
                g.spec.head_size,
                g.spec.dtype,
                g.spec.itemsize,
                g.spec.kind,
                g.spec.sliding_window,
            ),
            tuple(g.layer_names),
        )
        for g in msg.groups
    )
    if [g.index for g in groups] != list(range(len(groups))):
        raise ProtocolError(f"layout groups are not numbered 0..{len(groups) - 1}")
    owners = {}
    for o in msg.owners:
        if not 0 <= o.group < len(groups) or o.name not in groups[o.group].layer_names:
            raise ProtocolError(f"layout owner {o.name!r} is not in its group {o.group}")
        if not 0 <= o.split <= len(o.dims) or o.itemsize <= 0 or o.block_stride <= 0:
            raise ProtocolError(f"layout owner {o.name!r} has an impossible geometry")
        geometry = BlockGeometry(
            o.base,
            o.block_stride,
            tuple(Dim(d.label, d.size, d.stride) for d in o.dims),
            o.split,
            o.itemsize,
            o.device_id,
        )
        owners[o.name] = OwnerLayer(
            o.name, o.group, groups[o.group].spec, geometry, tuple(o.labels)
        )
    missing = {n for g in groups for n in g.layer_names} - set(owners)
    if missing:
        raise ProtocolError(f"layout lists owners without geometry: {sorted(missing)[:5]}")
    topology = KVTopology(
        groups=groups,
        owners=owners,
        sharers=dict(msg.sharers),
        regions=tuple(Region(r.addr, r.nbytes, r.device_id) for r in msg.regions),
        num_blocks=msg.num_blocks,
        layout=msg.layout,
    )
    if topology.logical_fingerprint() != msg.fingerprint:
        raise ProtocolError("layout fingerprint does not match its content")
    return topology


# ---- side channel -------------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello", forbid_unknown_fields=True):
    """Decode asks prefill for its agent metadata and layout."""

    protocol_version: int
    engine_id: str  # the asking engine, for logs
    expect_engine_id: str | None = None  # the engine the asker believes it reaches


class HandshakeReply(msgspec.Struct, tag="handshake", forbid_unknown_fields=True):
    protocol_version: int
    engine_id: str
    agent_name: str
    agent_metadata: bytes
    layout: LayoutMsg


class ErrorReply(msgspec.Struct, tag="error", forbid_unknown_fields=True):
    message: str


class Claim(msgspec.Struct, tag="claim", forbid_unknown_fields=True):
    """Decode, just before it reads: are these requests' blocks still held? Hold them on.

    A READ is one-sided: prefill cannot refuse it. Without this, a decode that comes after
    the lease ended would read blocks that may already hold another request's KV.
    """

    protocol_version: int
    engine_id: str
    request_ids: list[str]
    hold_s: float  # keep them at least this long from now (the reader's transfer bound)


class ClaimReply(msgspec.Struct, tag="claimed", forbid_unknown_fields=True):
    held: list[str]  # held, lease extended: read now
    gone: list[str]  # read already, or lease expired: the blocks are free
    # any other id asked for: not held yet (the prefill scheduler has not handed it over)


class Release(msgspec.Struct, tag="release", forbid_unknown_fields=True):
    """Decode gives up on requests before it could add prefill as a NIXL peer (their
    layouts differ), so a NIXL notification cannot reach prefill: free their blocks now
    instead of at the end of the lease. Answered with a ``ClaimReply`` (all ``gone``)."""

    protocol_version: int
    engine_id: str
    request_ids: list[str]
    reason: str


SideMessage = Hello | HandshakeReply | ErrorReply | Claim | ClaimReply | Release
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SideMessage)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> SideMessage:
    """Strict decode of a side-channel message; ``ProtocolError`` names what is wrong."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        preview = data[:32].hex() + ("..." if len(data) > 32 else "")
        raise ProtocolError(
            f"malformed side-channel message ({exc}); {len(data)} B: {preview}"
        ) from exc


# ---- notifications ------------------------------------------------------------------------


def notification(kind: bytes, request_id: str) -> bytes:
    return NOTIF_PREFIX + kind + request_id.encode()


def parse_notification(message: bytes) -> tuple[bytes, str]:
    """``(kind, request_id)`` of one of our notifications, else ``ProtocolError``."""
    if not message.startswith(NOTIF_PREFIX):
        raise ProtocolError(f"not a kvshare notification: {message[:40]!r}")
    body = message[len(NOTIF_PREFIX) :]
    for kind in (NOTIF_DONE, NOTIF_ABORT):
        if body.startswith(kind) and len(body) > len(kind):
            try:
                return kind, body[len(kind) :].decode()
            except UnicodeDecodeError as exc:
                raise ProtocolError(f"notification with a non-UTF-8 request id: {exc}") from exc
    raise ProtocolError(f"unknown kvshare notification: {message[:40]!r}")


# ---- kv_transfer_params -------------------------------------------------------------------


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
    if parsed.tp_size != 1:
        raise KVTransferParamsError(
            f"kv_transfer_params: tp_size {parsed.tp_size} (prefill with tensor parallelism is "
            "not supported yet)"
        )
    for group, ids in enumerate(parsed.remote_block_ids):
        if any(b < 0 for b in ids):
            raise KVTransferParamsError(
                f"kv_transfer_params: negative block id {min(ids)} - at "
                f"`$.remote_block_ids[{group}]`"
            )
    return parsed
