#!/usr/bin/env bash
# The test command: lint, then every CPU test (GPU tests skip themselves without CUDA).
set -uo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh || exit 1
.venv/bin/ruff check kvshare_connector tests scripts benchmarks || exit 1
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
# pytest exits 5 when it collected no test: nothing failed, but say so.
if [ "$rc" -eq 5 ]; then echo "no tests collected"; exit 0; fi
exit "$rc"
