"""Wire types: the side-channel handshake, kv_transfer_params and transfer notifications.

msgspec structs decoded strictly: a peer speaking garbage, an old version or a wrong type
gets an error that names the field, never a half-filled object. kv_transfer_params keep
vLLM's NixlConnector field names so existing PD proxies work unchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec
import numpy as np

from kvshare_connector.layout.matching import EngineIdentity
from kvshare_connector.layout.sharding import GroupHeads, Shard
from kvshare_connector.layout.topology import (
    BlockGeometry,
    Dim,
    GroupSpec,
    KVTopology,
    LayerSpec,
    OwnerLayer,
    Region,
)

# 2: claims name their reader and block ids, the layout carries the engine identity,
# notifications carry the reader's claim token. 3: claims may ask for KV digests.
# 4: layouts carry the TP shard, claims how many decode ranks read (tensor parallelism).
# 5: handshake replies name a lane probe, releases carry the reader's claim token.
# 7: claim replies say how long prefill took to answer. 8: handshake replies name the
# agent's nameplate (``device.nameplate``); claims name blocks in the request's order.
# 9: a handshake reply names prefill's UCX settings always (a ``ProbeRef`` of 0 bytes where
# it has no probe), for decode to refuse segments it cannot receive.
PROTOCOL_VERSION = 9
NOTIF_PREFIX = b"kvshare:v2:"
NOTIF_DONE = b"done:"  # decode read the blocks: free them
NOTIF_ABORT = b"abort:"  # decode gave up on the request: free them too
CLAIM_TOKEN_LEN = 32  # hex chars of a reader's claim token

# Bounds on one side-channel request, so a peer's message costs bounded work.
MAX_IDS_PER_MESSAGE = 256  # request ids in one claim or release
MAX_BLOCK_IDS_PER_MESSAGE = 1 << 17  # block ids named by one claim, all groups
MAX_ID_CHARS = 512  # one request or engine id
MAX_TP = 64  # TP size / readers one message may state (tensor parallelism)
MAX_REASON_CHARS = 200  # why a decode gave up on a request (``Release.reason``)


class ProtocolError(ValueError):
    """A message that does not decode into what the protocol promises."""


# Block ids travel packed, little-endian uint32 (vLLM's block tables are int32): a claim of
# 2**17 ids is 512 KiB that decodes and compares in well under a millisecond, where a
# msgpack list of ints took 4 ms of the GIL to decode, beside prefill's engine thread.
BLOCK_ID_DTYPE = np.dtype("<u4")


def pack_ids(ids: Sequence[int]) -> bytes:
    """``ids`` as they travel (``ValueError`` for an id no block table holds)."""
    array = np.asarray(ids, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() > np.iinfo(BLOCK_ID_DTYPE).max):
        raise ValueError(f"a block id out of range in {list(ids)[:5]}...")
    return array.astype(BLOCK_ID_DTYPE).tobytes()


def unpack_ids(raw: bytes) -> np.ndarray:
    """Packed ids as an array (read-only, no copy); ``ProtocolError`` if not whole ids."""
    if len(raw) % BLOCK_ID_DTYPE.itemsize:
        raise ProtocolError(f"{len(raw)} B of block ids is not a whole number of ids")
    return np.frombuffer(raw, dtype=BLOCK_ID_DTYPE)


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


class IdentityMsg(msgspec.Struct, forbid_unknown_fields=True):
    """``matching.EngineIdentity`` on the wire (None: the engine did not say)."""

    model: str | None = None
    model_config_hash: str | None = None
    dtype: str | None = None
    cache_dtype: str | None = None
    block_size: int | None = None
    vllm_version: str | None = None


class ShardMsg(msgspec.Struct, forbid_unknown_fields=True):
    """A TP rank's part of the KV (``layout.sharding.Shard``): per group, the model's KV
    heads and the ``[start, start + count)`` this rank holds."""

    tp_size: int
    tp_rank: int
    heads: list[tuple[int, int, int]]  # (total, start, count) per group


class LayoutMsg(msgspec.Struct, forbid_unknown_fields=True):
    groups: list[GroupMsg]
    owners: list[OwnerMsg]
    sharers: dict[str, str]
    regions: list[RegionMsg]
    num_blocks: int
    layout: str
    fingerprint: str  # of the logical layout and the identity: a tampered message fails
    identity: IdentityMsg | None = None
    shard: ShardMsg | None = None  # None: TP 1 (an engine without tensor parallelism)


def fingerprint(topology: KVTopology, identity: EngineIdentity | None) -> str:
    """The topology's logical fingerprint, extended by the engine identity when known."""
    base = topology.logical_fingerprint()
    if identity is None:
        return base
    return hashlib.sha256(f"{base}|{identity!r}".encode()).hexdigest()[:16]


def identity_from_msg(msg: LayoutMsg) -> EngineIdentity | None:
    if msg.identity is None:
        return None
    return EngineIdentity(**msgspec.structs.asdict(msg.identity))


def shard_to_msg(shard: Shard) -> ShardMsg:
    heads = [(g.total, g.start, g.count) for g in shard.groups]
    return ShardMsg(shard.tp_size, shard.tp_rank, heads)


def shard_from_msg(msg: LayoutMsg) -> Shard | None:
    """The peer's shard (None: it did not say, i.e. TP 1), checked for range."""
    s = msg.shard
    if s is None:
        return None
    if not 0 <= s.tp_rank < s.tp_size <= MAX_TP or any(
        c <= 0 or t <= 0 or st < 0 for t, st, c in s.heads
    ):
        raise ProtocolError(f"layout states an impossible TP shard: {s}")
    return Shard(s.tp_size, s.tp_rank, tuple(GroupHeads(t, st, c) for t, st, c in s.heads))


def layout_to_msg(
    topology: KVTopology, identity: EngineIdentity | None = None, shard: Shard | None = None
) -> LayoutMsg:
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
        fingerprint=fingerprint(topology, identity),
        identity=IdentityMsg(**identity.__dict__) if identity is not None else None,
        shard=shard_to_msg(shard) if shard is not None else None,
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
    if fingerprint(topology, identity_from_msg(msg)) != msg.fingerprint:
        raise ProtocolError("layout fingerprint does not match its content")
    return topology


# ---- side channel -------------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello", forbid_unknown_fields=True):
    """Decode asks prefill for its agent metadata and layout."""

    protocol_version: int
    engine_id: str  # the asking engine, for logs
    expect_engine_id: str | None = None  # the engine the asker believes it reaches


class ProbeRef(msgspec.Struct, forbid_unknown_fields=True):
    """Prefill's lane probe (``transfer.device.probe``): READ ``nbytes`` at ``addr``, expect the
    pattern of ``seed`` (``nbytes`` 0: no probe, the settings alone). ``ucx``: prefill's UCX
    settings in force (every ``UCX_*``, at most 64), whose tcp segments decode checks
    against its own before any READ; ``kv_ipc_capable``: whether cuda_ipc can export its KV
    memory (False: VMM, e.g. kvcached; None: unknown)."""

    addr: int
    nbytes: int
    device_id: int  # -1: host memory
    seed: int
    ucx: dict[str, str] = {}
    kv_ipc_capable: bool | None = None


class NameplateRef(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Where prefill's nameplate is in its registered host memory (``device.nameplate``)."""

    addr: int
    nbytes: int


class HandshakeReply(msgspec.Struct, tag="handshake", forbid_unknown_fields=True):
    protocol_version: int
    engine_id: str
    agent_name: str
    agent_metadata: bytes
    layout: LayoutMsg
    probe: ProbeRef | None = None
    nameplate: NameplateRef | None = None


class ErrorReply(msgspec.Struct, tag="error", forbid_unknown_fields=True):
    message: str


class Claim(msgspec.Struct, tag="claim", forbid_unknown_fields=True):
    """Decode, just before it reads: are these requests' blocks still held? Hold them on.

    A READ is one-sided: prefill cannot refuse it. Without this, a decode that comes after
    the lease ended would read blocks that may already hold another request's KV. The
    first claim of a held request makes ``token`` its only reader (a second decode, from a
    proxy retry or n>1, is refused), and every block id the reader will read must be one
    prefill holds for that request (``block_ids``: request id -> ids per group).
    """

    protocol_version: int
    engine_id: str
    request_ids: list[str]
    hold_s: float  # keep them at least this long from now (the reader's transfer bound)
    token: str = ""  # the reader's claim token (random per read)
    # several requests claimed at once (one ask per prefill per step): request id -> its
    # reader's token, for the ids it names (the others use ``token``)
    tokens: dict[str, str] = {}
    block_ids: dict[str, list[bytes]] = {}  # per group, ``pack_ids`` of the request's list
    packed: bool = False  # the reader can take a packed request (``ClaimReply.packed``)
    verify: bool = False  # the reader wants the requests' KV digests (``ClaimReply.digests``)
    # TP: this many decode ranks, all with this claim token, read the requests from this
    # prefill rank; the blocks are freed once each of them said done (or abort)
    readers: int = 1


class PackedRef(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Where prefill packed a held request (``layout.staging``): read it from here."""

    addr: int
    nbytes: int
    device_id: int  # -1: host memory


class KVDigests(msgspec.Struct, forbid_unknown_fields=True):
    """Prefill's digests of a held request (``layout.verification``): per owner layer, one
    little-endian uint64 per block of ``block_ids[group]`` (non-null ids, in this order,
    packed by ``pack_ids``)."""

    block_ids: list[bytes]
    layers: dict[str, bytes]


class ClaimReply(msgspec.Struct, tag="claimed", forbid_unknown_fields=True):
    held: list[str]  # held, lease extended: read now
    gone: list[str]  # read already, or lease expired: the blocks are free
    # refused: another reader claimed it, or the claim named blocks it does not hold
    refused: dict[str, str] = {}
    # held requests prefill packed, for a claim that asked (``Claim.packed``)
    packed: dict[str, PackedRef] = {}
    # held requests' KV digests, for a claim that asked (``Claim.verify``); a held request
    # missing here was not digested (prefill runs without verify_kv)
    digests: dict[str, KVDigests] = {}
    # how long each held request had waited on prefill when this claim came (timeline)
    held_s: dict[str, float] = {}
    # seconds from the claim's arrival to this answer (a wait for the gather or the
    # digests on the device included): what of the claim's time was prefill's
    answer_s: float = 0.0
    # any other id asked for: not held yet (the prefill scheduler has not handed it over)


class Release(msgspec.Struct, tag="release", forbid_unknown_fields=True):
    """Decode gives up on requests before any READ of theirs reached prefill (layouts or
    block counts differ, a claim could not be checked): no NIXL notification can be relied
    on then (there may be no wired-up UCX connection yet), so free their blocks now instead
    of at the end of the lease. Answered with a ``ClaimReply``: freed ids ``gone``, ids
    another reader claimed ``refused`` with why, ids never held in neither."""

    protocol_version: int
    engine_id: str
    request_ids: list[str]
    reason: str
    token: str = ""  # the reader's claim token: a claimed request is freed only by its reader


SideMessage = Hello | HandshakeReply | ErrorReply | Claim | ClaimReply | Release
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SideMessage)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> SideMessage:
    """Strict decode of a side-channel message; ``ProtocolError`` names what is wrong."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:  # nesting
        preview = data[:32].hex() + ("..." if len(data) > 32 else "")
        raise ProtocolError(
            f"malformed side-channel message ({exc}); {len(data)} B: {preview}"
        ) from exc


# ---- notifications ------------------------------------------------------------------------


def notification(kind: bytes, request_id: str, token: str = "") -> bytes:
    """``prefix kind token:request_id``; the token (empty before a claim) tells prefill
    which reader speaks, so a refused second decode cannot free the first one's blocks."""
    return NOTIF_PREFIX + kind + token.encode() + b":" + request_id.encode()


def parse_notification(message: bytes) -> tuple[bytes, str, str]:
    """``(kind, request_id, token)`` of one of our notifications, else ``ProtocolError``."""
    if not message.startswith(NOTIF_PREFIX):
        raise ProtocolError(f"not a kvshare notification: {message[:40]!r}")
    body = message[len(NOTIF_PREFIX) :]
    for kind in (NOTIF_DONE, NOTIF_ABORT):
        if body.startswith(kind):
            token, sep, request_id = body[len(kind) :].partition(b":")
            if not sep or not request_id or len(token) > CLAIM_TOKEN_LEN:
                break
            try:
                return kind, request_id.decode(), token.decode()
            except UnicodeDecodeError as exc:
                raise ProtocolError(f"notification with a non-UTF-8 request id: {exc}") from exc
    raise ProtocolError(f"unknown kvshare notification: {message[:40]!r}")
