#!/usr/bin/env bash
# The test command: lint, then every CPU test (GPU tests skip themselves without CUDA), on
# vLLM 0.26.0 (.venv); VLLM_VERSION=0.33.0 runs them on 0.33.0 (.venv-vllm033) instead.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/vllm_env.sh || exit 1
[ -x "$VENV/bin/python" ] || bash scripts/setup.sh || exit 1
"$VENV/bin/ruff" check kvshare_connector tests scripts lab || exit 1
# Random order (pytest-randomly: modules, then the tests inside each, shuffled), with the
# seed printed so that a failure can be replayed: KVSHARE_TEST_SEED=<seed> bash scripts/test.sh
SEED="${KVSHARE_TEST_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}"
echo "tests on vLLM $VLLM_VERSION ($VENV), random order, seed $SEED (replay: KVSHARE_TEST_SEED=$SEED)"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -p randomly --randomly-seed="$SEED" "$@"
rc=$?
# pytest exits 5 when it collected no test: nothing failed, but say so.
if [ "$rc" -eq 5 ]; then echo "no tests collected"; exit 0; fi
exit "$rc"
