#!/usr/bin/env bash
# NIXL's progress thread busy-polling (poll 0 ms, NIXL's Python API) vs sleeping on UCX's
# events (poll 1 ms, the connector's default) vs off; E2B-shaped loopback READs, rotated.
set -euo pipefail
cd "$(dirname "$0")/../../.."
R=results/cpu/2026-12-03b/raw
run() {  # NAME POLL_MS THREAD
  KVSHARE_NIXL_PROGRESS_POLL_MS=$2 .venv/bin/python -m lab.benchmarks.bench_transfer --tokens 16384 \
    --batch 2 --progress-thread "$3" --json "$R/transfer-$1.json" > "$R/transfer-$1.md"
}
for round in 1 2 3; do
  case $round in
    1) order="spin sleep off";; 2) order="sleep off spin";; 3) order="off spin sleep";;
  esac
  for v in $order; do
    case $v in
      spin) run "spin-$round" 0 on;; sleep) run "sleep-$round" 1 on;; off) run "off-$round" 1 off;;
    esac
  done
done
