"""Decode's prefix-cache hit per KV cache group, for the requests it loads from prefill.

vLLM looks up one hit for all the KV cache groups of a hybrid model: the longest prefix every
group holds. A sliding-window group holds a prefix only where it holds the window before the
prefix's end, and decode's sliding-window groups hold only what its loads brought, each
prompt's last window. So on decode a prompt that shares a system prompt with an earlier one
(anything short of the same prompt again) hit nothing, and its load read the whole prompt
while the full-attention groups held most of it (issue 50: 18.9 MB per load, the no-hit
amount, with 75 % of each prompt in decode's cache).

A load needs no window before the hit: it brings every token past it, so each sliding-window
group gets its window at the prompt's end from prefill. For the requests decode will load,
the lookup here gives each group its own hit (vLLM's per-group lookup, the one it uses for
Mamba hybrids under a connector) and the request the full-attention groups' hit; vLLM then
allocates each group's blocks past its own hit (a sliding-window group's null up to its
window), which are the blocks the load fills. Where no group hits deeper than vLLM's common
hit, where a lagging group hits deeper than full attention (its blocks were evicted), or
where the request would not load, vLLM's own lookup stands; where full attention holds all
that prefill computed but another group does not, its hit stops a block boundary short so
the load brings the other groups' windows.

This is the one place the connector changes what vLLM does rather than answering its hooks:
vLLM has no hook for it with sliding windows. Only engines whose connector installed it
(decode, NIXL backend) and only requests it accepts are affected; ``compat`` names the
method per release. A load that then fails must not resume at the full-attention hit (the
sliding-window groups lack the window before it): ``release`` frees the request's blocks so
it starts over (vLLM >= 0.30 does so itself for a failed load).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from kvshare_connector.common.log import LogBudget, get_logger
from kvshare_connector.vllm import compat

logger = get_logger(__name__)
_log = LogBudget(5, 600.0, subject="per-group prefix hit", logger=logger)


class Loads(Protocol):
    """The connector's scheduler side, as the lookup asks it."""

    def loads_to(self, request: Any) -> int:
        """The prompt tokens whose KV ``request``'s load brings (0: it loads nothing)."""

    def took_group_hits(self, request_id: str, release: Callable[[], None]) -> None:
        """``request`` got per-group hits; ``release`` frees its blocks (a failed load)."""


# id(kv_cache_config) -> (that config, its engine's connector), both weakly
_ENGINES: dict[int, tuple[weakref.ref, weakref.ref]] = {}
_INSTALLED: set[str] = set()


def install(kv_cache_config: Any, loads: Loads) -> bool:
    """Per-group hits for the engine of ``kv_cache_config`` (the object vLLM's scheduler
    hands both its KV cache manager and its connector). False where this vLLM lacks what it
    takes (no hybrid coordinator's per-group lookup) or the model has Mamba layers."""
    if getattr(kv_cache_config, "has_mamba_layers", False):
        return False
    lookup = compat.prefix_lookup()
    if lookup is None:
        return False
    manager_cls, name, arity = lookup
    if name not in _INSTALLED:
        original = getattr(manager_cls, name)
        setattr(manager_cls, name, _wrapped(original, arity))
        _INSTALLED.add(name)
    key = id(kv_cache_config)
    _ENGINES[key] = (weakref.ref(kv_cache_config), weakref.ref(loads))
    weakref.finalize(kv_cache_config, _ENGINES.pop, key, None)
    if len(kv_cache_config.kv_cache_groups) > 1:
        logger.info(
            "prefix caching: a load reads past each KV cache group's own hit (vLLM's %s "
            "wrapped for the requests this decode loads)",
            name,
        )
    return True


def _wrapped(original: Callable[..., tuple], arity: int) -> Callable[..., tuple]:
    @functools.wraps(original)
    def lookup(manager: Any, request: Any, *args: Any, **kwargs: Any) -> tuple:
        found = original(manager, request, *args, **kwargs)
        hit, boundary = found[1], found[2]
        if boundary <= hit:  # no group holds more than every group does
            return found
        loads = _loads_of(manager)
        if loads is None:
            return found
        try:
            deeper = _group_hits(manager, request, hit, loads, *args, **kwargs)
        except Exception as exc:  # never stop the scheduler: vLLM's own hit stands
            _log.log(f"request {request.request_id}: per-group prefix hits: {exc!r}")
            return found
        if deeper is None:
            return found
        per_group, full = deeper
        loads.took_group_hits(request.request_id, functools.partial(manager.free, request))
        out = (manager.create_kv_cache_blocks(per_group), full, 0)
        return out + (True,) * (arity - 3)  # 0.34: the hit diverged (vLLM reconciles if
        # nothing loads)

    return lookup


def _loads_of(manager: Any) -> Loads | None:
    config = getattr(manager, "kv_cache_config", None)
    entry = _ENGINES.get(id(config))
    if entry is None or entry[0]() is not config:
        return None
    return entry[1]()


def _group_hits(
    manager: Any, request: Any, hit: int, loads: Loads, *args: Any, **kwargs: Any
) -> tuple[tuple[list[Any], ...], int] | None:
    """Each group's own hit and the full-attention groups' hit, where a load takes it."""
    coordinator = manager.coordinator
    full_ids = compat.full_attention_group_ids(coordinator)
    if not full_ids:
        return None
    max_length = compat.max_cache_hit_length(request, *args, **kwargs)
    per_group, hits = coordinator.find_longest_cache_hit_per_group(request.block_hashes, max_length)
    full = min(hits[g] for g in full_ids)
    others = max((h for g, h in enumerate(hits) if g not in full_ids), default=0)
    if others > full:  # a lagging group hit deeper: full attention's blocks were evicted
        return None
    # A load brings the tokens past the hit: one that holds all prefill computed reads
    # nothing (that is vLLM's common hit's case, where every group holds it); short of
    # that, full attention's hit stops on a boundary before the prompt's end.
    align = math.lcm(*(g.kv_cache_spec.block_size for g in manager.kv_cache_config.kv_cache_groups))
    end = loads.loads_to(request)
    full = min(full, (end - 1) // align * align)
    if full <= hit or others > full:
        return None
    for g in full_ids:
        size = manager.kv_cache_config.kv_cache_groups[g].kv_cache_spec.block_size
        per_group[g][full // size :] = []
    return per_group, full
