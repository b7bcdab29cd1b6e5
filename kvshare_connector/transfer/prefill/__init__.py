"""Prefill's side: the requests it holds for decode and its answers to claims."""
