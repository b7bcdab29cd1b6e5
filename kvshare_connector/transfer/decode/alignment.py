"""Which remote block goes into which local block, and refusing every pairing vLLM 0.26
cannot produce (a wrong pairing moves bytes into the wrong place and nobody notices).

The exact rule, per KV cache group of block size ``B`` (sliding window ``W`` or none), for a
prompt of ``P`` tokens of which decode had ``L`` in that group's local prefix cache (each
group's own hit: a full-attention group may hold a shared prefix whose window a
sliding-window group lacks, ``vllm/prefix_hits.py``):

* prefill sends its table for the ``N = remote_num_tokens`` tokens it computed (vLLM clips
  it to ``cdiv(N, B)`` blocks), a sliding-window group clipped to its tail of
  ``keep = ceil(W / B) + 1`` blocks. ``N`` must equal ``P``: other tokens are another KV.
  So prefill sends exactly ``R = cdiv(P, B)`` blocks, or ``min(R, keep)`` for a window.
* decode loads into the blocks vLLM allocated beyond its cache hit: positions from
  ``first = L // B`` (a full-attention group) or ``max(L // B, (P - W + 1) // B)`` (a
  window: vLLM pads the positions the window has left with the null block) up to
  ``cdiv(P, B)``, so it holds exactly ``cdiv(P, B) - first`` blocks (at most ``keep``).
* both lists end at position ``cdiv(P, B) - 1``: they pair at the tail.
* prefill's null blocks (id 0) are the positions its window had left when it finished:
  below ``(N' - W + 1) // B`` for some ``N' <= N``, so below decode's ``first``. A remote
  null paired with a real local block therefore never comes from vLLM and is refused, as
  is any other count. A local null (tools may pass one) only means nothing to write.

Without decode's token counts (tools that drive ``KVSink`` directly) the counts must be
equal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvshare_connector.layout.topology import BlockIds, GroupSpec
from kvshare_connector.transfer.wire.kv_params import KVTransferParamsError


class BlockIdsMismatch(KVTransferParamsError):
    """Decode's blocks and prefill's do not pair the way vLLM lays them out."""


def expected_counts(
    num_tokens: int, num_local_tokens: int, block_size: int, window: int | None
) -> tuple[int, int]:
    """``(remote, local)`` block counts of one group (see the module's rule)."""
    total = math.ceil(num_tokens / block_size)
    first = num_local_tokens // block_size
    if not window:
        return total, max(total - first, 0)
    keep = math.ceil(window / block_size) + 1
    first = max(first, max(0, num_tokens - window + 1) // block_size)
    return min(total, keep), min(max(total - first, 0), keep)


def align_block_ids(
    local: BlockIds,
    remote: BlockIds,
    groups: Sequence[GroupSpec] | None = None,
    num_tokens: int | None = None,
    num_local_tokens: int | Sequence[int] = 0,
    remote_num_tokens: int | None = None,
) -> tuple[list[list[int]], list[list[int]]]:
    """Pair a request's blocks per group at the tail; ``BlockIdsMismatch`` unless the
    counts are exactly the module's rule (equal counts without ``num_tokens``).
    ``num_local_tokens``: decode's hit, one for every group or one per group."""
    if len(local) != len(remote):
        raise KVTransferParamsError(
            f"remote_block_ids has {len(remote)} group(s), this engine has {len(local)}"
        )
    hits = per_group(num_local_tokens, len(local))
    if num_tokens is not None and remote_num_tokens is not None and num_tokens != remote_num_tokens:
        raise BlockIdsMismatch(
            f"prefill computed {remote_num_tokens} tokens, this request's prompt has "
            f"{num_tokens}: the KV is not this prompt's"
        )
    out_local, out_remote = [], []
    for g, (lids, rids) in enumerate(zip(local, remote, strict=True)):
        if num_tokens is not None and groups is not None:
            spec = groups[g].spec
            want_r, want_l = expected_counts(
                num_tokens, hits[g], spec.block_size, spec.sliding_window
            )
            if (len(rids), len(lids)) != (want_r, want_l):
                raise BlockIdsMismatch(
                    f"group {g}: prefill sent {len(rids)} block(s) and decode holds "
                    f"{len(lids)}, a prompt of {num_tokens} tokens with {hits[g]} "
                    f"cached locally needs {want_r} and {want_l}"
                    + (f" (window {spec.sliding_window})" if spec.sliding_window else "")
                )
        elif len(lids) != len(rids):
            raise BlockIdsMismatch(
                f"group {g}: prefill sent {len(rids)} block(s), decode holds {len(lids)}"
            )
        twice = _repeated([b for b in rids if b])
        if twice is not None:
            raise BlockIdsMismatch(
                f"group {g}: prefill's block list names block {twice} more than once (no "
                "request holds a block twice: the list was altered)"
            )
        offset = len(rids) - len(lids)
        pairs = []
        for i, lb in enumerate(lids):
            rb = rids[offset + i]
            if lb == 0:
                continue
            if rb == 0:
                raise BlockIdsMismatch(
                    f"group {g}, position {i} of decode's {len(lids)} block(s): prefill sent "
                    f"the null block for decode's block {lb} (prefill no longer holds that "
                    "part of the window)"
                )
            pairs.append((lb, rb))
        out_local.append([lb for lb, _ in pairs])
        out_remote.append([rb for _, rb in pairs])
    return out_local, out_remote


def per_group(num_local_tokens: int | Sequence[int], num_groups: int) -> list[int]:
    """Decode's hit in each of ``num_groups`` groups (one number: the same in all)."""
    if isinstance(num_local_tokens, int):
        return [num_local_tokens] * num_groups
    hits = [int(n) for n in num_local_tokens]
    if len(hits) != num_groups:
        raise KVTransferParamsError(
            f"decode's prefix hits name {len(hits)} KV cache group(s), it has {num_groups}"
        )
    return hits


def token_counts(
    num_tokens: int | None, num_local_tokens: int | Sequence[int], groups: Sequence[GroupSpec]
) -> tuple[int | None, int | None]:
    """(tokens decode's prefix cache held, tokens the load brings) of a prompt of
    ``num_tokens``: the hit is the full-attention groups' (every token's KV is there; a
    sliding-window group's blocks before its window are not kept anyway)."""
    if num_tokens is None:
        return None, None
    hits = per_group(num_local_tokens, len(groups))
    full = [h for h, group in zip(hits, groups, strict=True) if not group.spec.sliding_window]
    hit = min(full or hits, default=0)
    return hit, max(num_tokens - hit, 0)


def _repeated(ids: Sequence[int]) -> int | None:
    """The first id ``ids`` names twice, or None."""
    seen: set[int] = set()
    for b in ids:
        if b in seen:
            return b
        seen.add(b)
    return None
