"""Layer 4, the only code that touches vLLM's internals.

``adapter``: vLLM's KV cache specs, groups, sharing map and cross-layer views -> a topology.
``metadata``: what the scheduler hands the worker each step and what comes back.
``scheduler`` / ``worker``: the two halves of the connector; each calls the configured backend
(``kvshare_connector.backends``) and never branches on its name. ``stats``: connector stats.
``compat``: what differs between the vLLM releases supported (0.26.0 .. 0.33.0).
"""
