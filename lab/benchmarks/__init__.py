"""Benchmarks: CPU benches here, GPU ones (serving, PD timings, NIXL reads) in ``gpu/``.
Run from the repository root as ``python -m lab.benchmarks.<bench>``; what they time is proved
correct by ``lab/gpu_checks/``."""
