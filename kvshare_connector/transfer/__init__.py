"""Layer 2, the pull transfer over NIXL, without vLLM.

``protocol``: msgspec side-channel messages; ``kv_params``: kv_transfer_params;
``side_channel``: framed TCP request/reply, authenticated and bounded; ``nixl``: a thin NIXL
agent wrapper; ``lanes`` and ``probe``: the UCX lane, chosen and measured; ``source``:
prefill's ``KVSource``; ``sink`` and ``reads``: decode's ``KVSink`` and its reads' phases.
docs/architecture.md has the whole layer.
"""
