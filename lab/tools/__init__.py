"""Tools the tests and benchmarks drive the product with: an engine simulator on vLLM's
scheduler, KV probes and digests, attack clients and targets, negative-control connectors.
Never in the wheel."""
