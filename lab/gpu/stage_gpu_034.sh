#!/usr/bin/env bash
# Stage vLLM 0.34.0 for the GPU test host (issue 47): torch 2.14.0+cu130 and the CUDA 13 wheels it
# pins that the host has at other versions, NIXL 1.5.1, FlashInfer 0.7.4 and the rest of vLLM
# 0.34's runtime closure the host lacks (lab/gpu/wheels-vllm-0.34.0.txt says how that list
# was derived, and why LMCache 0.5.6 is in it although pip will not install it beside 0.34).
# The host runs Python 3.12 with torch 2.11.0+cu130 and has no network. The 0.26 stack (.gpu/,
# /tmp/site) and the 0.33 one (.gpu033/, /tmp/site033) are left alone: all install side by side.
#   bash lab/gpu/stage_gpu_034.sh         (from anywhere; writes .gpu034/ at the project root)
# It writes (ignored through .gitignore):
#   .gpu034/bin/        install034.sh, env034.sh, parts (the count), SHA256SUMS, MANIFEST
#   .gpu034/c00 .. cNN  one PART_MIB part each (partNN; default 24 MiB: a run carries 64 MiB
#                       with the checkout, 37 MiB on 2026-12-07; lab/gpu/recut.sh re-cuts)
# Then, on the host, one run per part, back to back, each carrying .gpu034/bin and one
# .gpu034/cNN and running `bash lab/gpu/install034.sh`; the run that brings the last part
# installs into /tmp/site034. Later runs: `bash lab/gpu/install034.sh && . lab/gpu/env034.sh`.
# Start a GPU step with `bash lab/gpu/bg.sh start` first and the parts come in meanwhile.
# kvcached 0.1.6's sdist travels too (fast_lane.sh's kvcached034 step builds it on the host), so
# the 0.26 stack is not needed for that step; fetching it takes the 0.34 venv's Python
# (VLLM_VERSION=0.34.0 bash scripts/setup.sh; SDIST_PYTHON names another with torch).
# Downloads are cached in $GPU034_STAGE_DIR (default /tmp/gpu034-stage).
set -euo pipefail
cd "$(dirname "$0")/../.."
# vLLM 0.34.0, slimmed as 0.33.0 was (lab/gpu/stage_gpu_033.sh says why each is safe to drop; in
# 0.34 FA2 is still chosen on Hopper only for ALiBi, batch invariance or hd256 on Blackwell):
# the FlashAttention 2 kernels, the Rust frontend, DeepGEMM and the SM100-only FMHA tree.
# Triton 3.8.0 (torch 2.14 pins ~=3.8.0), slimmed as for 0.33: Blackwell's ptxas and CUPTI.
TAG=034 VLLM=0.34.0 TRITON=3.8.0 LIST=lab/gpu/wheels-vllm-0.34.0.txt \
VLLM_DROP="vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/third_party/deep_gemm vllm/third_party/fmha_sm100" \
TRITON_DROP="triton/backends/nvidia/bin/ptxas-blackwell triton/backends/nvidia/lib/cupti-blackwell triton/backends/nvidia/lib/cupti/libcupti_static.a triton/backends/nvidia/lib/cupti/libnvperf_host_static.a" \
SDISTS=kvcached==0.1.6 SDIST_PYTHON="${SDIST_PYTHON:-$PWD/.venv-vllm034/bin/python}" \
STAGE_DIR="${GPU034_STAGE_DIR:-/tmp/gpu034-stage}" \
  exec bash lab/gpu/stage_stack.sh
