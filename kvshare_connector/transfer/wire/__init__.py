"""What crosses between engines: kv_transfer_params, the side channel's messages, framing,
admission and replay, and the settings both roles read."""
