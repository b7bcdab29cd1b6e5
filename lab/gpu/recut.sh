#!/usr/bin/env bash
# Cut a staged GPU stack (.gpu/, .gpu033/ or .gpu034/) into parts of another size, in place.
#   bash lab/gpu/recut.sh .gpu 34        (DIR: .gpu, .gpu033 or .gpu034; MiB per part)
# A device run carries at most 64 MiB: the checkout (tracked and untracked files) plus what
# it carries. The checkout grows with every committed result (22 MiB on 2026-12-03, when a
# 45 MiB part no longer fitted beside it), so parts must shrink with it. The parts are one
# tar cut in order: they are joined in the order of their names, cut again, and laid out
# as DIR/cNN/partNN; DIR/bin/parts (the count) and, where there is one, DIR/bin/SHA256SUMS
# (.gpu033's and .gpu034's installs check every part) are rewritten. The joined tar's
# checksum is the same before and after (printed).
set -euo pipefail
DIR=${1:?DIR: .gpu, .gpu033 or .gpu034}
MIB=${2:?MiB per part}
[ -f "$DIR/bin/parts" ] || { echo "recut: no $DIR/bin/parts" >&2; exit 2; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mapfile -t parts < <(find "$DIR" -path "$DIR/c*/part*" -type f | awk -F/ '{print $NF "\t" $0}' \
  | LC_ALL=C sort | cut -f2)
[ "${#parts[@]}" -eq "$(cat "$DIR/bin/parts")" ] ||
  { echo "recut: ${#parts[@]} parts under $DIR, $DIR/bin/parts says $(cat "$DIR/bin/parts")" >&2; exit 1; }
cat "${parts[@]}" > "$WORK/stack.tar"
echo "stack tar: $(sha256sum < "$WORK/stack.tar" | cut -d' ' -f1)"
# Two digits per part number up to 100 parts, three beyond (one width, so they join in order).
bytes=$(stat -c %s "$WORK/stack.tar")
digits=$(( (bytes + MIB * 1048576 - 1) / (MIB * 1048576) > 100 ? 3 : 2 ))
(cd "$WORK" && split -b "${MIB}M" -d -a "$digits" stack.tar part && rm stack.tar)
n=$(ls "$WORK" | wc -l)
find "$DIR" -mindepth 1 -maxdepth 1 -name 'c*' -type d -exec rm -rf {} +
for f in "$WORK"/part*; do
  p=$(basename "$f")
  mkdir -p "$DIR/c${p#part}" && mv "$f" "$DIR/c${p#part}/"
done
echo "$n" > "$DIR/bin/parts"
if [ -f "$DIR/bin/SHA256SUMS" ]; then
  (cd "$DIR" && sha256sum c*/part* | sed 's| c[0-9]*/| |' > bin/SHA256SUMS)
fi
cat "$DIR"/c*/part* | sha256sum | sed 's/ .*//; s/^/stack tar after: /'
echo "$n parts of at most $MIB MiB under $DIR (c$(printf "%0${digits}d" 0)..c$(printf "%0${digits}d" $((n - 1))))"
