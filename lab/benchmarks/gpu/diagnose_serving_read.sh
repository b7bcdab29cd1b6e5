#!/usr/bin/env bash
# Which UCX lane does a READ take inside `vllm serve` engines, next to the standalone NIXL
# benchmark on the same host? In serving on one H200 (results/gpu/2026-12-01b) our packed
# READs ran at 0.40-0.43 GB/s, the rate of UCX's non-cuda_ipc lane, where the standalone
# benchmark of the same memory kind reached ~1 TB/s. This runs both with UCX's lane logs on:
#   OUT/standalone.md    bench_nixl_read.py, cudaMalloc memory, both processes on PREFILL_GPU
#   OUT/serving/         bench_serving.py: ours (NIXL's progress thread on, and off: it
#                        busy-polls a core per agent) and NixlConnector, 1P1D, 8 requests, c=1
#   OUT/lanes.md         per engine: UCX's endpoint lanes, the protocol chosen for reads of
#                        GPU memory, and any line saying cuda_ipc could not export memory
#   bash lab/benchmarks/gpu/diagnose_serving_read.sh OUT MODEL_DIR [PREFILL_GPU [DECODE_GPU]]
# (a CUDA host with the stack installed: ../shared/gpu/README.md; MODEL_DIR from
# random_weights.py, e.g. /tmp/kvshare-weights/gemma4_e2b_shape-seed0)
set -uo pipefail
OUT="${1:?usage: diagnose_serving_read.sh OUT MODEL_DIR [PREFILL_GPU [DECODE_GPU]]}"
MODEL="${2:?usage: diagnose_serving_read.sh OUT MODEL_DIR [PREFILL_GPU [DECODE_GPU]]}"
PGPU="${3:-0}"
DGPU="${4:-$PGPU}"
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "SKIP: no CUDA GPU here; nothing was started"
  exit 0
fi
UCX_LOGS="UCX_LOG_LEVEL=info UCX_PROTO_INFO=y"

echo "== standalone NIXL READ, GPU $PGPU -> GPU $DGPU"
timeout 200 python3 -m lab.benchmarks.gpu.bench_nixl_read --mode gpu --ucx-info --total-mib 64 \
  --desc-kib 64 16384 --iters 3 --timeout 120 --json "$OUT/standalone.json" \
  --target-visible "$PGPU" --initiator-visible "$DGPU" > "$OUT/standalone.md" 2>&1
echo "rc=$?" >> "$OUT/standalone.md"
grep -E '^\|' "$OUT/standalone.md" | head -12

echo "== vllm serve: ours and NixlConnector, UCX lane logs on"
# shellcheck disable=SC2086
timeout 420 python3 -m lab.benchmarks.gpu.bench_serving --model-dir "$MODEL" --out "$OUT/serving" \
  --deployments ours nixl --ours-variants thread={} 'nothread={"nixl_progress_thread":false}' \
  --prefill-gpu "$PGPU" --decode-gpu "$DGPU" --gpu-mem 0.13 \
  --kv-cache-gib 5 --enforce-eager --input-len 2048 --concurrency 1 --num-prompts 8 \
  --output-len 16 --rounds 1 --warmup-requests 2 --time-budget 360 --grace 10 --keep-raw \
  --engine-env $UCX_LOGS > "$OUT/serving.log" 2>&1
echo "rc=$?" >> "$OUT/serving.log"

python3 -m lab.benchmarks.gpu.serving_lanes "$OUT/serving/raw" > "$OUT/lanes.md" 2>&1
cat "$OUT/lanes.md"
