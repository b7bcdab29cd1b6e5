"""Recognising kvcached-backed KV buffers (kvcached 0.1.6), for naming and for choices.

Nothing here patches anything: kvcached's buffers are handled by the same stride-based
topology as vLLM's own. What kvcached changes for us: its tensors are views into a
reservation of (nearly) the whole GPU, so only the span of blocks vLLM can hand out is
registered, and vLLM's cross-layer blocks tensor would bypass kvcached's allocator, so the
connector does not ask for it when kvcached is on.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

# kvcached attaches a byte view for its block copies to every KV tensor it creates.
_KVCACHED_MARK = "_kvcached_block_copy_view"


def kvcached_enabled() -> bool:
    """kvcached patches vLLM at import when this is set (its ``.pth`` hook)."""
    return os.environ.get("ENABLE_KVCACHED", "").strip().lower() == "true"


def contiguous_layout() -> bool:
    """kvcached's default on CUDA: one reservation, layers interleaved per block."""
    return os.environ.get("KVCACHED_CONTIGUOUS_LAYOUT", "true").strip().lower() == "true"


def is_kvcached_tensor(tensor: Any) -> bool:
    return hasattr(tensor, _KVCACHED_MARK)


def layout_name(tensors: Iterable[Any], default: str = "per_layer") -> str:
    """``kvcached_contiguous`` / ``kvcached_per_layer`` for kvcached buffers, else ``default``."""
    if not any(is_kvcached_tensor(t) for t in tensors):
        return default
    return "kvcached_contiguous" if contiguous_layout() else "kvcached_per_layer"
