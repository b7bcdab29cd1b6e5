# Source on the GPU host after lab/gpu/install034.sh, to run vLLM 0.34.0:
#   . lab/gpu/env034.sh          (or . .gpu034/bin/env034.sh)
# Use one stack per shell: this drops the 0.26 and 0.33 stacks' /tmp/site and /tmp/site033 from
# PYTHONPATH and PATH.
SITE034=/tmp/site034
_kvs034_strip() {  # a colon list without /tmp/site, /tmp/site033, /tmp/site034 entries, no repeats
  printf '%s' "$1" | tr ':' '\n' | grep -vE '^/tmp/site(03[34])?(/.*)?$' | awk 'NF && !seen[$0]++' | paste -sd: -
}
_kvs034_pp=$(_kvs034_strip "${PYTHONPATH:-}")
# /tmp/site034 first, so torch 2.14 and the rest shadow the host's torch 2.11 stack. CuTe DSL
# (FlashAttention 4, FlashInfer) puts its `cutlass` package on sys.path through a .pth file,
# which only a site directory reads: name that directory here.
export PYTHONPATH="$SITE034:$SITE034/nvidia_cutlass_dsl/dsl_packages${_kvs034_pp:+:$_kvs034_pp}"
_kvs034_path=$(_kvs034_strip "$PATH")
export PATH="$SITE034/bin:$_kvs034_path"
# torch 2.14's libraries find the carried CUDA wheels (cuBLAS 13.1.1, cuDNN 9.24, NCCL 2.30.7,
# cuSPARSELt 0.8.1) through their RPATH into /tmp/site034/nvidia; the ones the host already has
# at the pinned versions live in the host's site-packages. Name both, carried first, for
# libraries opened by name at run time (vLLM's NCCL wrapper, NIXL/UCX, CuTe DSL, FlashInfer).
_kvs034_host=$(PYTHONPATH= python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null || true)
_kvs034_ld="$SITE034/nvidia/cu13/lib:$SITE034/nvidia/cudnn/lib:$SITE034/nvidia/nccl/lib:$SITE034/nvidia/cusparselt/lib"
if [ -n "$_kvs034_host" ]; then
  _kvs034_ld="$_kvs034_ld:$_kvs034_host/nvidia/cu13/lib:$_kvs034_host/nvidia/nvshmem/lib"
fi
_kvs034_ldold=$(_kvs034_strip "${LD_LIBRARY_PATH:-}")
LD_LIBRARY_PATH=$(printf '%s' "$_kvs034_ld${_kvs034_ldold:+:$_kvs034_ldold}" | tr ':' '\n' | awk 'NF && !seen[$0]++' | paste -sd: -)
export LD_LIBRARY_PATH
export PYTHONUNBUFFERED=1
# vLLM's compile cache for this release apart from the others', kept across one lease's runs.
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-/tmp/vllm-cache-034}"
# vLLM 0.34 has no V1 model runner and stops an engine started with VLLM_USE_V2_MODEL_RUNNER=0,
# which the 0.26 env sets (for kvcached): drop it. (=1 only draws a warning; dropped too.)
unset VLLM_USE_V2_MODEL_RUNNER
# kvcached is not in this stack (0.1.6 has no runner adapter past 0.30: fast_lane.sh's kvcached
# step builds it to see what 0.34 does); its autopatch .pth in the host's site-packages, put
# there by the 0.26 install, stays inert unless a step turns it on.
export ENABLE_KVCACHED=false KVCACHED_AUTOPATCH=0
# FlashInfer is staged, so vLLM's FlashInfer sampler is on by default (JIT-built with the host's
# nvcc on first use); VLLM_USE_FLASHINFER_SAMPLER=0 turns it off, as fast_lane.sh does.
unset _kvs034_pp _kvs034_path _kvs034_host _kvs034_ld _kvs034_ldold
unset -f _kvs034_strip
