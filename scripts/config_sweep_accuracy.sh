#!/usr/bin/env bash
# PD vs colocated accuracy over a list of configurations (lm-eval), with JSON/markdown/plot.
#   scripts/config_sweep_accuracy.sh [SWEEP_FILE] [options] [-- extra vllm serve args]
# SWEEP_FILE defaults to scripts/sweep_configs/tiny_local.yaml (offline, dummy weights).
# Options: `python -m kvshare_connector.toolkit.cli sweep --help`. PYTHON selects the interpreter.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
if [[ $# -eq 0 || "$1" == -* ]]; then
  set -- "${ROOT}/scripts/sweep_configs/tiny_local.yaml" "$@"
fi
exec "${PYTHON:-python}" -m kvshare_connector.toolkit.cli sweep "$@"
