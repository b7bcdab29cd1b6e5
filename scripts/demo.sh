#!/usr/bin/env bash
# Set up (first run only) and run the main job: a real NIXL transfer of a Gemma-4 E2B
# shaped KV layout between two processes on this machine, checked layer by layer.
# Extra arguments go to `kvshare demo` (e.g. --decode-layout kvcached_contiguous).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/kvshare ] || bash scripts/setup.sh
exec .venv/bin/kvshare demo "$@"
