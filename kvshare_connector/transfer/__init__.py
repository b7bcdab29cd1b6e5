"""Layer 2, the pull transfer over NIXL, without vLLM.

``protocol``: msgspec wire types (handshake, layout, claims, notifications) and
``kv_transfer_params``. ``side_channel``: pyzmq request/reply with bounded waits. ``nixl``: a
thin NIXL agent wrapper. ``source``: prefill's ``KVSource``. ``sink``: decode's ``KVSink``.
"""
