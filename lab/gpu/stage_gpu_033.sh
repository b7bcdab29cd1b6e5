#!/usr/bin/env bash
# Stage vLLM 0.33.0 for the GPU test host (issue 24): torch 2.14.0+cu130 and the CUDA 13 wheels
# it pins that the host has at other versions, NIXL 1.5.1, LMCache 0.5.6, FlashInfer and the
# rest of vLLM 0.33's runtime closure the host lacks (lab/gpu/wheels-vllm-0.33.0.txt says
# how that list was derived). The host runs Python 3.12 with torch 2.11.0+cu130 and has no
# network; a run carries at most 64 MiB, the checkout included, so the wheels travel as one tar
# cut into parts (PART_MIB, default 24), one part per run (lab/gpu/stage_stack.sh does the
# staging for this script and stage_gpu_034.sh). The 0.26 stack (lab/gpu/stage_gpu.sh, .gpu/,
# /tmp/site) is left alone: both install side by side on one host.
#   bash lab/gpu/stage_gpu_033.sh         (from anywhere; writes .gpu033/ at the project root)
# It writes (ignored through .gitignore):
#   .gpu033/bin/        install033.sh, env033.sh, parts (the count), SHA256SUMS, MANIFEST
#   .gpu033/c00 .. cNN  one PART_MIB part each (partNN)
# Then, on the host, one run per part, back to back, each carrying .gpu033/bin and one
# .gpu033/cNN and running `bash lab/gpu/install033.sh`; the run that brings the last part
# installs into /tmp/site033. Later runs: `bash lab/gpu/install033.sh && . lab/gpu/env033.sh`.
# The part-carrying runs can overlap GPU work: start a step with `bash lab/gpu/bg.sh start`
# first (2026-12-06b: the 0.26 serving run ran while the 45 parts of 58 MiB came in).
# Downloads are cached in $GPU033_STAGE_DIR (default /tmp/gpu033-stage); needs Python 3 with pip.
set -euo pipefail
cd "$(dirname "$0")/../.."
# vLLM 0.33.0, slimmed. Dropped: the FlashAttention 2 kernels (an H200 runs FA3, and FA4 for
# Gemma-4's head sizes; vLLM 0.33 falls back to FA2 only for ALiBi, batch invariance or
# Blackwell's hd256 limits), the Rust frontend vllm-rs (used only with
# VLLM_USE_RUST_FRONTEND/VLLM_USE_RUST_BENCH=1), DeepGEMM (FP8 GEMMs; vLLM finds it absent)
# and the SM100-only FMHA tree. Kept: FA3 (_vllm_fa3_C), FA4 (vllm_flash_attn/cute), the
# Triton kernels, FlashMLA and every other extension.
# Triton 3.8.0 (torch 2.14 pins ~=3.8.0), slimmed: the Blackwell ptxas and CUPTI (Triton takes
# them only for sm_100+) and CUPTI's static archives (link-time only).
TAG=033 VLLM=0.33.0 TRITON=3.8.0 LIST=lab/gpu/wheels-vllm-0.33.0.txt \
VLLM_DROP="vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/third_party/deep_gemm vllm/third_party/fmha_sm100" \
TRITON_DROP="triton/backends/nvidia/bin/ptxas-blackwell triton/backends/nvidia/lib/cupti-blackwell triton/backends/nvidia/lib/cupti/libcupti_static.a triton/backends/nvidia/lib/cupti/libnvperf_host_static.a" \
STAGE_DIR="${GPU033_STAGE_DIR:-/tmp/gpu033-stage}" \
  exec bash lab/gpu/stage_stack.sh
