"""GPU benchmarks: ``bench_serving`` (real ``vllm serve`` deployments; its parts in
``serving/``), ``bench_pd_gpu`` (decode-side PD time, on ``lab.gpu_checks.gpu_pd_e2e``'s cells),
``bench_nixl_read`` (one NIXL READ between two processes), and their reports."""
