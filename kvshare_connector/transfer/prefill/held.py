"""Prefill's record of a request it holds for decode, and the checks a claim must pass.

Pure bookkeeping and numpy: ``KVSource`` keeps one ``Held`` per request and runs these
checks on its side-channel thread under the lock its engine thread's ``poll`` takes too, so
each is vectorised (a claim may name 2**17 block ids) and none sorts or builds sets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvshare_connector.transfer.device.digests import PendingDigests
from kvshare_connector.transfer.device.packing import Copy
from kvshare_connector.transfer.wire import protocol


@dataclass
class Packed:
    slot: int  # offset in the staging area
    nbytes: int
    device_id: int
    copy: Copy  # the gather, possibly still running


@dataclass
class Held:
    """One request whose blocks prefill keeps for decode."""

    deadline: float  # monotonic: freed then unless decode read it
    since: float  # monotonic: when it was held
    # held block ids per group, exactly as kv_transfer_params list them (None: a tool's hold)
    blocks: list[np.ndarray] | None
    reader: str | None = None  # claim token of its one reader, once claimed
    claim_bound: float = 0.0  # monotonic: set by the first claim, no claim holds past it
    readers_left: int = 1  # TP: decode ranks (sharing the token) still to say done
    packed: Packed | None = None  # where it was gathered, with packed transfer
    digests: tuple[list[list[int]], PendingDigests] | None = None  # verify_kv


def digest_msgs(
    digests: dict[str, tuple[list[list[int]], PendingDigests]],
) -> dict[str, protocol.KVDigests]:
    """Digests as sent (waits for the device work, done long before a claim comes)."""
    out = {}
    for request_id, (block_ids, pending) in digests.items():
        layers = {name: v.astype("<u8").tobytes() for name, v in pending.result().items()}
        out[request_id] = protocol.KVDigests([protocol.pack_ids(g) for g in block_ids], layers)
    return out


def order_difference(named: bytes, held: np.ndarray) -> str | None:
    """Where the packed ids a claim names for one group differ from the held ones, or
    None."""
    try:
        ids = protocol.unpack_ids(named)
    except protocol.ProtocolError as exc:
        return str(exc)
    if len(ids) != len(held):
        return f"it names {len(ids)}, prefill holds {len(held)}"
    at = np.flatnonzero(ids != held)
    if not at.size:
        return None
    i = int(at[0])
    return (
        f"{at.size} position(s) differ, the first {i}: it names block {int(ids[i])}, prefill "
        f"holds {int(held[i])} there (a reordered, shifted or foreign list)"
    )


def over_caps(message: protocol.SideMessage) -> str | None:
    """Why a message asks for more work than one message may, or None."""
    ids = getattr(message, "request_ids", [])
    if len(ids) > protocol.MAX_IDS_PER_MESSAGE:
        return f"{len(ids)} request ids in one message (at most {protocol.MAX_IDS_PER_MESSAGE})"
    names = [*ids, getattr(message, "engine_id", ""), getattr(message, "token", "")]
    if isinstance(message, protocol.Claim):
        if not set(message.tokens) <= set(ids):
            return "claim tokens for requests the claim does not name"
        names.extend(message.tokens.values())
    if isinstance(message, protocol.Hello):
        names.append(message.expect_engine_id or "")
    if any(len(n) > protocol.MAX_ID_CHARS for n in names):
        return f"an id longer than {protocol.MAX_ID_CHARS} characters"
    if isinstance(message, protocol.Release) and len(message.reason) > protocol.MAX_REASON_CHARS:
        return f"a release reason longer than {protocol.MAX_REASON_CHARS} characters"
    if isinstance(message, protocol.Claim):
        size = protocol.BLOCK_ID_DTYPE.itemsize
        blocks = sum(len(g) // size for ids in message.block_ids.values() for g in ids)
        if blocks > protocol.MAX_BLOCK_IDS_PER_MESSAGE or len(message.block_ids) > len(ids):
            return (
                f"a claim naming {blocks} block ids of {len(message.block_ids)} request(s) "
                f"(at most {protocol.MAX_BLOCK_IDS_PER_MESSAGE}, of the claimed requests)"
            )
    return None
