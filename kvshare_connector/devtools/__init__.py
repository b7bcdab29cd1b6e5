"""Development scaffolding the demo, tests and benchmarks share: ``cpu_stack`` builds vLLM's
real KV objects for Gemma-4 shaped configs (``models/``) on a CPU-only host, ``kvcheck`` fills
and checks KV blocks with patterns, ``demo`` is ``kvshare demo``."""
