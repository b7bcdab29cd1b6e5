"""bench_serving.py's parts: deployments (what runs where), client (``vllm bench serve``,
in one long-lived process), runs (rounds), checks (warmup requests that check generations),
scaling (the length x concurrency curve under a time bound), faults (prefill killed under
load), metrics (Prometheus text)."""
