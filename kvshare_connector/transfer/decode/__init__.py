"""Decode's side: peers and handshakes, claims, the READ of each request and its landing, TP
shards."""
