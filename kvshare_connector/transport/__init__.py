"""Transports that move KV bytes between engines."""
