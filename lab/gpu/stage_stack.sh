#!/usr/bin/env bash
# Stage one vLLM stack for the GPU test host (no network there): the body of
# lab/gpu/stage_gpu_033.sh and lab/gpu/stage_gpu_034.sh, which set what differs:
#   TAG          033, 034: writes .gpu$TAG/ at the project root, caches in /tmp/gpu$TAG-stage
#   VLLM         the vLLM release, downloaded and slimmed (VLLM_DROP: the paths it loses)
#   TRITON       the Triton release torch pins, slimmed (TRITON_DROP)
#   LIST         the other wheels (lab/gpu/wheels-vllm-$VLLM.txt: why each is there)
#   SDISTS       source distributions a step builds on the host (kvcached 0.1.6: fast_lane.sh),
#                fetched with SDIST_PYTHON's pip (their metadata step imports torch)
# A run carries at most 64 MiB, the checkout included, so the wheels travel as one tar cut
# into PART_MIB parts, one part per run (.gpu$TAG/cNN/partNN), with .gpu$TAG/bin (the part
# count, checksums, a manifest, install$TAG.sh, env$TAG.sh). lab/gpu/recut.sh cuts them
# again to another size. Needs Python 3 with pip.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"
[ -d .git ] || { echo "not a project checkout: $ROOT" >&2; exit 2; }
: "${TAG:?}" "${VLLM:?}" "${TRITON:?}" "${LIST:?}" "${VLLM_DROP:?}" "${TRITON_DROP:?}"
OUTDIR="$ROOT/.gpu$TAG"
WORK="${STAGE_DIR:-/tmp/gpu$TAG-stage}"
PY="${PYTHON:-python3}"
PART_MIB=${PART_MIB:-24}
mkdir -p "$WORK/dl" "$WORK/raw" "$WORK/slim"
# Wheels for CPython 3.12 on manylinux x86_64 (the host: glibc 2.39), down to manylinux1 (some
# wheels the stack needs, e.g. nvidia-nccl-cu13, pyzmq, psutil, nvvm, are built for old tags).
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp"
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_25_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_18_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_12_x86_64 \
         manylinux2010_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  PLAT="$PLAT --platform $p"
done

slimmed() {  # NAME VERSION DROP: the slimmed wheel's path (made once, then cached)
  local name=$1 version=$2 drop=$3 raw out
  "$PY" -m pip download -q --no-deps $PLAT -d "$WORK/raw" "$name==$version"
  raw=$(ls "$WORK"/raw/"$name"-"$version"-*.whl | head -n 1)
  out="$WORK/slim/$(basename "$raw")"
  if [ ! -f "$out" ]; then
    # shellcheck disable=SC2086
    "$PY" lab/gpu/slim_wheel.py "$raw" "$out" $drop >&2
  fi
  echo "$out"
}
VLLM_SLIM=$(slimmed vllm "$VLLM" "$VLLM_DROP")
TRITON_SLIM=$(slimmed triton "$TRITON" "$TRITON_DROP")

# The listed wheels: downloaded into the cache $WORK/dl, then the best match of each taken from
# there (pip ranks the cached files by platform as it ranks the index's).
"$PY" -m pip download -q --no-deps $PLAT -d "$WORK/dl" -r "$LIST"
rm -rf "$WORK/wheels" && mkdir -p "$WORK/wheels"
"$PY" -m pip download -q --no-deps $PLAT --no-index --find-links "$WORK/dl" -d "$WORK/wheels" -r "$LIST"
cp "$VLLM_SLIM" "$TRITON_SLIM" "$WORK/wheels/"
for sdist in ${SDISTS:-}; do
  "${SDIST_PYTHON:?SDISTS need SDIST_PYTHON, a Python with torch}" -m pip download -q --no-deps \
    --no-binary :all: --no-build-isolation -d "$WORK/sdist" "$sdist"
done
[ -z "${SDISTS:-}" ] || cp "$WORK"/sdist/*.tar.gz "$WORK/wheels/"
want=$(( $(grep -cE '^[A-Za-z0-9]' "$LIST") + 2 + $(echo ${SDISTS:-} | wc -w) ))
have=$(ls "$WORK/wheels" | wc -l)
[ "$have" -eq "$want" ] || { echo "stage: $have wheels in $WORK/wheels, expected $want" >&2; exit 1; }

# One tar (sorted, owner-neutral), cut into PART_MIB parts: .gpu$TAG/cNN/partNN.
rm -rf "$OUTDIR" && mkdir -p "$OUTDIR/bin"
(cd "$WORK/wheels" && ls | LC_ALL=C sort > "$WORK/wheels.txt" \
   && tar cf "$WORK/stack.tar" --owner=0 --group=0 --numeric-owner -T "$WORK/wheels.txt")
# Two digits per part number up to 100 parts, three beyond (0.33's and 0.34's stacks are
# ~2.6 GB: ~110 parts of 24 MiB); names of one width keep the parts in order when joined.
bytes=$(stat -c %s "$WORK/stack.tar")
digits=$(( (bytes + PART_MIB * 1048576 - 1) / (PART_MIB * 1048576) > 100 ? 3 : 2 ))
(cd "$OUTDIR" && split -b "${PART_MIB}M" -d -a "$digits" "$WORK/stack.tar" part)
n=0
for f in "$OUTDIR"/part*; do
  c="$OUTDIR/c$(basename "$f" | sed 's/^part//')"
  mkdir -p "$c" && mv "$f" "$c/"
  n=$((n + 1))
done
echo "$n" > "$OUTDIR/bin/parts"
(cd "$OUTDIR" && sha256sum c*/part* | sed 's| c[0-9]*/| |' > bin/SHA256SUMS)
(cd "$WORK/wheels" && du -k $(cat "$WORK/wheels.txt") | awk '{printf "%8d KiB  %s\n", $1, $2}') \
  > "$OUTDIR/bin/MANIFEST"
cp "lab/gpu/install$TAG.sh" "lab/gpu/env$TAG.sh" "$OUTDIR/bin/"
rm -f "$WORK/stack.tar"
total=$(du -cb "$OUTDIR"/c*/part* | tail -1 | cut -f1)
last=$(ls "$OUTDIR" | grep '^c[0-9]' | tail -n 1)
echo "staged $(wc -l < "$WORK/wheels.txt") files, $((total / 1048576)) MiB, in $n parts of $PART_MIB MiB under .gpu$TAG/ (c$(printf "%0${digits}d" 0)..$last)"
echo "device time to bring them, warm host at ~5 s a part: ~$((n * 5 / 60)) min $((n * 5 % 60)) s, plus the install in the last run"
echo "next, on the host, one run per part back to back: carry .gpu$TAG/bin and .gpu$TAG/cNN, run: bash lab/gpu/install$TAG.sh"
