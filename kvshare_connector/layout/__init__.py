"""Layer 1, pure layout math (numpy only, no vLLM, no NIXL, no torch).

``topology``: owners, sharer -> target, KV cache groups, registered regions and block geometry
read off tensors' strides. ``matching``: pair decode's owners with prefill's and list every
difference. ``descriptors``: block ids -> coalesced (addr, len, dev) rows. ``kvcached``:
recognising kvcached's buffers.
"""
