"""LMCache's GPU connector for owner rows: how LMCache reads and writes vLLM's KV blocks.

``LMCacheEngine.store`` / ``retrieve`` chunk and key the tokens, allocate memory objects
and call back here for each chunk; this connector copies one stream's owner rows between
the blocks and the objects (``rows.OwnerRows``). Which blocks, and from which position on,
travels per call as the ``kvshare`` keyword (a ``Transfer``), which also collects what
was copied for the caller to check.

This module imports LMCache (the class subclasses its interface); only ``store`` imports
it, so the backend package still imports without the optional extra.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

from kvshare_connector.backends.lmcache.rows import OwnerRows, Stream


@dataclass
class Transfer:
    """One store or retrieve of one stream, handed through LMCache as a kwarg."""

    tables: Sequence[np.ndarray]  # per group, block table from position 0
    first: Sequence[int]  # per group, first position copied
    chunks: list[tuple[int, int]] = field(default_factory=list)  # token ranges copied
    nbytes: int = 0


class OwnerRowsConnector(GPUConnectorInterface):
    """Copies one stream's owner rows between vLLM's KV blocks and LMCache objects."""

    def __init__(self, rows: OwnerRows, stream: Stream):
        self.rows = rows
        self.stream = stream

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([1, 1, num_tokens, self.stream.width])

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self._copy(self.rows.gather, memory_obj, start, end, kwargs["kvshare"])

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self._copy(self.rows.scatter, memory_obj, start, end, kwargs["kvshare"])

    def _copy(
        self, copy: Callable[..., None], memory_obj: Any, start: int, end: int, transfer: Transfer
    ) -> None:
        """One chunk's rows between the blocks and ``memory_obj`` (``copy``: ``rows.gather``
        or ``rows.scatter``), noted on ``transfer`` for the caller's coverage check."""
        rows = memory_obj.tensor.view(-1, self.stream.width)[: end - start]
        copy(self.stream, transfer.tables, transfer.first, start, end, rows)
        transfer.chunks.append((start, end))
        transfer.nbytes += memory_obj.get_size()

    def batched_from_gpu(
        self, memory_objs: Any, starts: Sequence[int], ends: Sequence[int], **kwargs: Any
    ) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(
        self,
        memory_objs: Any = None,
        starts: Sequence[int] | None = None,
        ends: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kwargs)
