#!/usr/bin/env bash
# Create the virtual environment (Python 3.11 or 3.12) of one tested vLLM release with
# kvshare-connector and its pinned stack (the lmcache, eval and router extras): NIXL 1.5.1
# with its bundled UCX, LMCache 0.5.6, lm-eval 0.4.13, vllm-router 0.1.17, pytest and ruff.
#   bash scripts/setup.sh                       vLLM 0.26.0 (torch 2.11.0) in .venv
#   VLLM_VERSION=0.33.0 bash scripts/setup.sh   vLLM 0.33.0 (torch 2.14.0) in .venv-vllm033
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/vllm_env.sh
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
"$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" -e '.[test,eval,lmcache,router]'
echo "setup ($VENV): $("$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "| torch", torch.__version__)' 2>/dev/null | tail -n 1)"
