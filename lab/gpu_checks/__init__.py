"""GPU correctness drivers: PD on real vLLM engines must move KV byte for byte and leave
outputs as a colocated engine's (``kv_exact``, ``kv_exact_tp``, ``gpu_pd_e2e``), each with
a negative control that must fail. Run from the repository root as ``python -m
gpu_checks.<driver>``; ``lab/benchmarks/`` times what these prove correct."""
