"""The lab: benchmarks, GPU correctness drivers, test tools (lab/README.md)."""
