#!/usr/bin/env bash
# Which path does a NIXL READ between two GPUs of one host take, and how fast is it?
# Runs bench_nixl_read.py's variants (GPU visibility, memory kind, UCX transports) and keeps
# every log: OUT/topo.txt (nvidia-smi topology), OUT/<step>.md (tables), OUT/<step>.json (raw).
#   bash lab/benchmarks/gpu/diagnose_nvlink.sh OUT        (a host with 2 GPUs, NIXL importable)
set -uo pipefail
OUT="${1:?usage: diagnose_nvlink.sh OUT}"
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
B=lab/benchmarks/gpu/bench_nixl_read.py
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
nvidia-smi nvlink --status >> "$OUT/topo.txt" 2>&1
step() {  # step NAME ARGS...: one bench run, table to NAME.md, raw to NAME.json
  local name=$1; shift
  echo "== $name: $*"
  timeout 280 python3 "$B" --mode gpu --json "$OUT/$name.json" "$@" > "$OUT/$name.md" 2>&1
  echo "rc=$?" >> "$OUT/$name.md"
  grep -E '^\|' "$OUT/$name.md" | head -40
}
# 1. visibility: each engine sees only its GPU (as vLLM PD runs today) vs both GPUs, mutually
#    ordered; and both on one GPU as the reference.
step visibility --ucx-info --total-mib 1024 --desc-kib 16 64 256 1024 16384 --iters 5 \
  --sweep-env default vis=0,1/1,0 vis=0/0
# 2. memory kinds: cuMemCreate without a shareable handle (what kvcached 0.1.6 allocates),
#    torch's expandable segments, and with a POSIX fd handle.
step memory --ucx-info --total-mib 64 --desc-kib 64 1024 16384 --iters 2 --timeout 120 \
  --sweep-env vis=0,1/1,0+alloc=cumem vis=0,1/1,0+alloc=vmm vis=0,1/1,0+alloc=cumem+UCX_RMA_PPLN_ENABLE=y
# 3. forced transports with both GPUs visible.
step transports --total-mib 256 --desc-kib 64 1024 16384 --iters 3 --timeout 120 \
  --sweep-env "vis=0,1/1,0+tls=cuda_ipc,cuda_copy,tcp" "vis=0,1/1,0+UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y" "vis=0,1/1,0+tls=^cuda_ipc"
