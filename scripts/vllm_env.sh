# Sourced by setup.sh and test.sh: which vLLM release, and which virtual environment holds it.
#   VLLM_VERSION=0.26.0 (default) -> .venv        (the README's commands, the GPU host's release)
#   VLLM_VERSION=0.33.0           -> .venv-vllm033
#   VLLM_VERSION=0.34.0           -> .venv-vllm034
# Each release installs exactly as pinned in constraints/vllm-<release>.txt; VENV overrides
# the directory. A line of that file `# override: NAME==VERSION` replaces every requirement on
# NAME (a pin of vLLM's or LMCache's that PyPI cannot meet): setup.sh then installs through uv's
# --override, as pip has none.
VLLM_VERSION="${VLLM_VERSION:-0.26.0}"
if [ -z "${VENV:-}" ]; then
  if [ "$VLLM_VERSION" = "0.26.0" ]; then
    VENV=.venv
  else
    VENV=".venv-vllm$(echo "$VLLM_VERSION" | cut -d. -f1,2 | tr -d .)"
  fi
fi
CONSTRAINTS="constraints/vllm-$VLLM_VERSION.txt"
if [ ! -f "$CONSTRAINTS" ]; then
  echo "no $CONSTRAINTS: tested releases are $(ls constraints | sed -n 's/^vllm-\(.*\)\.txt$/\1/p' | tr '\n' ' ')" >&2
  exit 2
fi
OVERRIDES="$(sed -n 's/^# override: *//p' "$CONSTRAINTS")"
