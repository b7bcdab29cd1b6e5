# Source on the GPU host after lab/gpu/install033.sh, to run vLLM 0.33.0:
#   . lab/gpu/env033.sh          (or . .gpu033/bin/env033.sh)
# Use one stack per shell: this drops the 0.26 stack's /tmp/site from PYTHONPATH and PATH.
SITE033=/tmp/site033
_kvs033_strip() {  # a colon list without /tmp/site[033] entries and without repeats
  printf '%s' "$1" | tr ':' '\n' | grep -vE '^/tmp/site(03[34])?(/.*)?$' | awk 'NF && !seen[$0]++' | paste -sd: -
}
_kvs033_pp=$(_kvs033_strip "${PYTHONPATH:-}")
# /tmp/site033 first, so torch 2.14 and the rest shadow the host's torch 2.11 stack. CuTe DSL
# (FlashAttention 4) puts its `cutlass` package on sys.path through a .pth file, which only a
# site directory reads: name that directory here.
export PYTHONPATH="$SITE033:$SITE033/nvidia_cutlass_dsl/dsl_packages${_kvs033_pp:+:$_kvs033_pp}"
_kvs033_path=$(_kvs033_strip "$PATH")
export PATH="$SITE033/bin:$_kvs033_path"
# torch 2.14's libraries find the carried CUDA wheels (cuBLAS 13.1.1, cuDNN 9.24, NCCL 2.30.7,
# cuSPARSELt 0.8.1) through their RPATH into /tmp/site033/nvidia; the ones the host already has
# at the pinned versions (cudart, nvrtc, cufft, curand, cusolver, cusparse, cupti, nvjitlink,
# cufile, nvtx, nvshmem) live in the host's site-packages. Name both, carried first, for
# libraries opened by name at run time (vLLM's NCCL wrapper, NIXL/UCX, CuTe DSL, FlashInfer).
_kvs033_host=$(PYTHONPATH= python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null || true)
_kvs033_ld="$SITE033/nvidia/cu13/lib:$SITE033/nvidia/cudnn/lib:$SITE033/nvidia/nccl/lib:$SITE033/nvidia/cusparselt/lib"
if [ -n "$_kvs033_host" ]; then
  _kvs033_ld="$_kvs033_ld:$_kvs033_host/nvidia/cu13/lib:$_kvs033_host/nvidia/nvshmem/lib"
fi
_kvs033_ldold=$(_kvs033_strip "${LD_LIBRARY_PATH:-}")
LD_LIBRARY_PATH=$(printf '%s' "$_kvs033_ld${_kvs033_ldold:+:$_kvs033_ldold}" | tr ':' '\n' | awk 'NF && !seen[$0]++' | paste -sd: -)
export LD_LIBRARY_PATH
export PYTHONUNBUFFERED=1
# vLLM's compile cache for this release apart from 0.26's, kept across the runs of one lease.
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-/tmp/vllm-cache-033}"
# kvcached 0.1.6 stops vLLM >= 0.31 at start (docs/kvcached.md) and is not in this stack; its
# autopatch .pth, which the 0.26 install puts in the host's site-packages, stays inert.
export ENABLE_KVCACHED=false KVCACHED_AUTOPATCH=0
# The model runner is vLLM 0.33's default (the 0.26 env sets VLLM_USE_V2_MODEL_RUNNER=0 for
# kvcached; a value set before sourcing this is kept). FlashInfer is staged, so vLLM's
# FlashInfer sampler is on by default (JIT-built with the host's nvcc on first use);
# VLLM_USE_FLASHINFER_SAMPLER=0 turns it off as the 0.26 env does.
unset _kvs033_pp _kvs033_path _kvs033_host _kvs033_ld _kvs033_ldold
unset -f _kvs033_strip
