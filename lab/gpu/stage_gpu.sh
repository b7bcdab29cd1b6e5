#!/usr/bin/env bash
# Stage everything the GPU runs need for ../shared/gpu/stage.sh: vLLM 0.26 + NIXL +
# kvcached (its own list), plus lm-eval (the accuracy sweep) and LMCache (the LMCache
# backend) with the dependencies the GPU host lacks. Three of lm-eval's dependencies ship
# as source only: their pure-Python wheels are built here first.
#   bash lab/gpu/stage_gpu.sh            (from the project root; writes .gpu/)
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK="${GPU_STAGE_DIR:-/tmp/gpu-stage}"
mkdir -p "$WORK/wheels"
.venv/bin/python -m pip wheel -q --no-deps -w "$WORK/wheels" \
  rouge-score==0.1.2 sqlitedict==2.1.0 word2number==1.1
EVAL="lm-eval==0.4.13 datasets==5.2.0 evaluate==0.4.6 pytablewriter==1.2.1 DataProperty==1.1.1
  mbstrdecoder==1.1.5 pathvalidate==3.3.1 tabledata==1.3.5 tcolorpy==0.1.7 typepy==1.3.5
  chardet==6.0.0.post1 multiprocess==0.70.19 more-itertools==11.2.1 nltk==3.10.4
  defusedxml==0.7.1 tenacity==9.2.1 pytz==2025.2"
# LMCache 0.5.6 and what the GPU host lacks of its dependencies (helper survey, 2026-11-29).
LMCACHE="lmcache==0.5.6 aiofile==3.12.3 caio==0.12.10 awscrt==0.38.1 cufile-python==0.2.0
  google-api-core==2.34.0 google-auth==2.63.0 google-cloud-bigtable==2.50.2
  google-cloud-core==2.8.0 google-cloud-monitoring==2.32.0 google-crc32c==1.9.0
  grpc-google-iam-v1==0.14.6 proto-plus==1.29.0 pyasn1==0.6.5 pyasn1-modules==0.4.2
  redis==8.1.0 sortedcontainers==2.4.0"
# vllm-router (PD router for `--router vllm-router`: a Rust extension, abi3 wheel, ~24 MB) and
# the one import of its Python launcher the GPU host lacks (the rest come with vLLM).
ROUTER="vllm-router==0.1.17 orjson==3.13.0"
PYTHON="$PWD/.venv/bin/python" GPU_STAGE_DIR="$WORK" EXTRA="$(echo $EVAL $LMCACHE $ROUTER)" \
  bash ../shared/gpu/stage.sh
# shared/gpu/stage.sh cuts 58 MiB parts; a run carries 64 MiB with the checkout (~22 MiB).
bash lab/gpu/recut.sh .gpu "${PART_MIB:-34}"
