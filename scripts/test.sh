#!/usr/bin/env bash
# The test command: lint, then every CPU test (GPU tests skip themselves without CUDA), on
# vLLM 0.26.0 (.venv); VLLM_VERSION=0.33.0 runs them on 0.33.0 (.venv-vllm033) instead.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/vllm_env.sh || exit 1
[ -x "$VENV/bin/python" ] || bash scripts/setup.sh || exit 1
"$VENV/bin/ruff" check kvshare_connector tests scripts benchmarks || exit 1
echo "tests on vLLM $VLLM_VERSION ($VENV)"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
rc=$?
# pytest exits 5 when it collected no test: nothing failed, but say so.
if [ "$rc" -eq 5 ]; then echo "no tests collected"; exit 0; fi
exit "$rc"
