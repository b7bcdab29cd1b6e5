"""Errors of the LMCache backend; each one ends a request (or the start-up), never the engine."""

from __future__ import annotations


class LMCacheConfigError(ValueError):
    """``kv_connector_extra_config`` does not describe a usable LMCache backend."""


class LMCacheStoreError(RuntimeError):
    """A request's KV could not be stored (nothing is announced as stored)."""


class LMCacheLoadError(RuntimeError):
    """A request's KV could not be loaded; the request must be computed locally."""


class HashSeedMismatch(LMCacheLoadError):
    """Both sides hash the same tokens to different LMCache keys."""
