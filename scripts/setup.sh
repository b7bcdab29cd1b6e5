#!/usr/bin/env bash
# Create the virtual environment (Python 3.11 or 3.12) of one tested vLLM release with
# kvshare-connector and its pinned stack (the lmcache, eval and router extras): NIXL 1.5.1 with
# its bundled UCX, LMCache 0.5.6, lm-eval 0.4.13, vllm-router 0.1.17, pytest and ruff.
#   bash scripts/setup.sh                       vLLM 0.26.0 (torch 2.11.0) in .venv
#   VLLM_VERSION=0.33.0 bash scripts/setup.sh   vLLM 0.33.0 (torch 2.14.0) in .venv-vllm033
#   VLLM_VERSION=0.34.0 bash scripts/setup.sh   vLLM 0.34.0 (torch 2.14.0) in .venv-vllm034
# vLLM 0.34.0 pins flashinfer-python==0.7.3, which PyPI does not have, so pip cannot install it,
# nor LMCache 0.5.6 beside it (opentelemetry caps); its constraints file names the overrides and
# the install goes through uv, whose --override replaces those pins. Other releases use pip.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/vllm_env.sh
PYTHON="${PYTHON:-python3}"
UV_VERSION=0.13.10
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
if [ -z "$OVERRIDES" ]; then
  "$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" -e '.[test,eval,lmcache,router]'
else
  echo "setup: $CONSTRAINTS overrides pins PyPI's releases cannot meet: $(echo "$OVERRIDES" | tr '\n' ' ')(through uv $UV_VERSION)"
  "$VENV/bin/python" -m pip install -q "uv==$UV_VERSION"
  overrides="$(mktemp)"
  trap 'rm -f "$overrides"' EXIT
  echo "$OVERRIDES" > "$overrides"
  # uv caches wheels unless told not to; CI's PIP_NO_CACHE_DIR means the same for it.
  [ -n "${PIP_NO_CACHE_DIR:-}" ] && export UV_NO_CACHE=1
  "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" -c "$CONSTRAINTS" \
    --override "$overrides" -e '.[test,eval,lmcache,router]'
fi
echo "setup ($VENV): $("$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "| torch", torch.__version__)' 2>/dev/null | tail -n 1)"
