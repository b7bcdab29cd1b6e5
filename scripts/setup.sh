#!/usr/bin/env bash
# Create .venv (Python 3.11 or 3.12) with kvshare-connector and its pinned stack (with the
# lmcache and eval extras): vLLM 0.26.0 (torch 2.11.0), NIXL 1.5.1 with its bundled UCX,
# LMCache 0.5.6, lm-eval 0.4.13, pytest and ruff.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test,eval,lmcache]'
echo "setup: $(.venv/bin/python -c 'import vllm, torch; print("vllm", vllm.__version__, "| torch", torch.__version__)' 2>/dev/null | tail -n 1)"
