#!/usr/bin/env bash
# Start prefill + decode `vllm serve` with KVShareConnector and the PD proxy (or
# `--router vllm-router`, N prefill x M decode with --num-prefill/--num-decode); Ctrl-C stops all.
#   scripts/serve_pd.sh MODEL [options] [-- extra vllm serve args]
# Options: `python -m kvshare_connector.toolkit.cli serve-pd --help`. PYTHON selects the interpreter.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
exec "${PYTHON:-python}" -m kvshare_connector.toolkit.cli serve-pd "$@"
