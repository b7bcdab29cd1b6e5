#!/usr/bin/env bash
# Run every test id on its own (a fresh pytest per id), to find tests that pass only after
# their neighbours. Slow (hours on 2 cores: each id pays its module's fixtures): a dev tool,
# not part of CI, which runs the suite in random order instead.
#   bash scripts/test_each_alone.sh [OUT_DIR] [pytest selection...]
# Writes OUT_DIR/results.tsv (id, exit status, seconds) and OUT_DIR/<n>.log per failure.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/vllm_env.sh || exit 1
OUT="${1:-runs/alone}"
shift || true
mkdir -p "$OUT"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -p no:randomly --collect-only "${@:-tests}" \
  | grep '::' > "$OUT/ids.txt"
: > "$OUT/results.tsv"
n=0
while read -r id; do
  n=$((n + 1))
  start=$(date +%s)
  timeout 900 "$VENV/bin/python" -m pytest -q -p no:cacheprovider -p no:randomly "$id" \
    > "$OUT/$n.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$id" "$rc" "$(( $(date +%s) - start ))" >> "$OUT/results.tsv"
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] && rm -f "$OUT/$n.log"
done < "$OUT/ids.txt"
total=$(wc -l < "$OUT/results.tsv")
failed=$(awk -F'\t' '$2 != 0 && $2 != 5' "$OUT/results.tsv" | wc -l)
echo "alone: $total test ids, $failed failed (see $OUT/results.tsv)"
[ "$failed" -eq 0 ]
