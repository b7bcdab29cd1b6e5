#!/usr/bin/env bash
# Stage vLLM 0.33.0 for the GPU test host (issue 24): torch 2.14.0+cu130 and the CUDA 13 wheels
# it pins that the host has at other versions, NIXL 1.5.1, LMCache 0.5.6, FlashInfer and the
# rest of vLLM 0.33's runtime closure the host lacks (scripts/gpu/wheels-vllm-0.33.0.txt says
# how that list was derived). The host runs Python 3.12 with torch 2.11.0+cu130 and has no
# network; a run carries at most 64 MiB, the checkout included, so the wheels travel as one tar
# cut into 34 MiB parts, one part per run. The 0.26 stack (scripts/stage_gpu.sh, .gpu/,
# /tmp/site) is left alone: both install side by side on one host.
#   bash scripts/stage_gpu_033.sh         (from anywhere; writes .gpu033/ at the project root)
# It writes (ignored through .gitignore):
#   .gpu033/bin/        install033.sh, env033.sh, parts (the count), SHA256SUMS, MANIFEST
#   .gpu033/c00 .. cNN  one 34 MiB part each (partNN)
# Then, on the host, one run per part, back to back, each carrying .gpu033/bin and one
# .gpu033/cNN and running `bash scripts/gpu/install033.sh`; the run that brings the last part
# installs into /tmp/site033. Later runs: `bash scripts/gpu/install033.sh && . scripts/gpu/env033.sh`.
# The part-carrying runs can overlap GPU work: start a step with `bash scripts/gpu/bg.sh start`
# first (2026-12-06b: the 0.26 serving run ran while the 45 parts of 58 MiB came in).
# Downloads are cached in $GPU033_STAGE_DIR (default /tmp/gpu033-stage); needs Python 3 with pip.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
[ -d .git ] || { echo "not a project checkout: $ROOT" >&2; exit 2; }
LIST="scripts/gpu/wheels-vllm-0.33.0.txt"
WORK="${GPU033_STAGE_DIR:-/tmp/gpu033-stage}"
PY="${PYTHON:-python3}"
PART_MIB=${PART_MIB:-34}  # beside a checkout of ~22 MiB (scripts/gpu/recut.sh re-cuts a staged stack)
mkdir -p "$WORK/dl" "$WORK/raw"
# Wheels for CPython 3.12 on manylinux x86_64 (the host: glibc 2.39). stage.sh's platforms plus
# 2_26/2_25/2_18/2_12/2010, which nvidia-nccl-cu13 2.30.7, pyzmq, psutil and nvvm need here.
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp"
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_25_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_18_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_12_x86_64 \
         manylinux2010_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  PLAT="$PLAT --platform $p"
done

# slim IN OUT PATH...: copy wheel IN to OUT without the named files/directories (each must be
# in the wheel: a name that is not stops the script, so a renamed kernel tree is noticed) and
# without their RECORD rows, so pip installs it as usual.
slim() {
  "$PY" - "$@" <<'EOF'
import csv, io, os, sys, zipfile
src, dst, drop = sys.argv[1], sys.argv[2], sys.argv[3:]
zin = zipfile.ZipFile(src)
names = zin.namelist()
def dropped(n):
    return any(n == d or n.startswith(d.rstrip("/") + "/") for d in drop)
for d in drop:
    if not any(n == d or n.startswith(d.rstrip("/") + "/") for n in names):
        sys.exit(f"slim: {d} is not in {src}")
record = next(n for n in names if n.endswith(".dist-info/RECORD"))
gone = sum(i.file_size for i in zin.infolist() if dropped(i.filename))
with zipfile.ZipFile(dst + ".tmp", "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zout:
    for info in zin.infolist():
        n = info.filename
        if dropped(n):
            continue
        if n == record:
            rows = [r for r in csv.reader(io.StringIO(zin.read(n).decode())) if r and not dropped(r[0])]
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerows(rows)
            zout.writestr(info, buf.getvalue(), compress_type=zipfile.ZIP_DEFLATED)
        else:
            with zin.open(info) as f:
                zout.writestr(info, f.read(), compress_type=zipfile.ZIP_DEFLATED, compresslevel=6)
os.replace(dst + ".tmp", dst)
print(f"  {os.path.basename(dst)}: dropped {gone / 2**20:.0f} MiB unpacked ({', '.join(drop)})")
EOF
}

# 1. vLLM 0.33.0, slimmed. Dropped: the FlashAttention 2 kernels (an H200 runs FA3, and FA4 for
#    Gemma-4's head sizes; vLLM 0.33 falls back to FA2 only for ALiBi, batch invariance or
#    Blackwell's hd256 limits), the Rust frontend vllm-rs (used only with
#    VLLM_USE_RUST_FRONTEND/VLLM_USE_RUST_BENCH=1), DeepGEMM (FP8 GEMMs; vLLM finds it absent)
#    and the SM100-only FMHA tree. Kept: FA3 (_vllm_fa3_C), FA4 (vllm_flash_attn/cute), the
#    Triton kernels, FlashMLA and every other extension.
VLLM_SLIM="$WORK/slim/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
if [ ! -f "$VLLM_SLIM" ]; then
  "$PY" -m pip download -q --no-deps $PLAT -d "$WORK/raw" vllm==0.33.0
  mkdir -p "$WORK/slim"
  slim "$WORK"/raw/vllm-0.33.0-*.whl "$VLLM_SLIM" \
    vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs \
    vllm/third_party/deep_gemm vllm/third_party/fmha_sm100
fi
# 2. Triton 3.8.0 (torch 2.14 pins ~=3.8.0), slimmed: the Blackwell ptxas and CUPTI (Triton
#    takes them only for sm_100+) and CUPTI's static archives (link-time only).
TRITON_SLIM="$WORK/slim/triton-3.8.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
if [ ! -f "$TRITON_SLIM" ]; then
  "$PY" -m pip download -q --no-deps $PLAT -d "$WORK/raw" triton==3.8.0
  mkdir -p "$WORK/slim"
  slim "$WORK"/raw/triton-3.8.0-*.whl "$TRITON_SLIM" \
    triton/backends/nvidia/bin/ptxas-blackwell triton/backends/nvidia/lib/cupti-blackwell \
    triton/backends/nvidia/lib/cupti/libcupti_static.a triton/backends/nvidia/lib/cupti/libnvperf_host_static.a
fi

# 3. The listed wheels: downloaded into the cache $WORK/dl, then the best match of each taken
#    from there (pip ranks the cached files by platform as it ranks the index's).
"$PY" -m pip download -q --no-deps $PLAT -d "$WORK/dl" -r "$LIST"
rm -rf "$WORK/wheels" && mkdir -p "$WORK/wheels"
"$PY" -m pip download -q --no-deps $PLAT --no-index --find-links "$WORK/dl" -d "$WORK/wheels" -r "$LIST"
cp "$VLLM_SLIM" "$TRITON_SLIM" "$WORK/wheels/"
want=$(( $(grep -cE '^[A-Za-z0-9]' "$LIST") + 2 ))
have=$(ls "$WORK/wheels" | wc -l)
[ "$have" -eq "$want" ] || { echo "stage: $have wheels in $WORK/wheels, expected $want" >&2; exit 1; }

# 4. One tar (sorted, owner-neutral), cut into PART_MIB parts: .gpu033/cNN/partNN.
rm -rf "$ROOT/.gpu033" && mkdir -p "$ROOT/.gpu033/bin"
(cd "$WORK/wheels" && ls | LC_ALL=C sort > "$WORK/wheels.txt" \
   && tar cf "$WORK/gpu033.tar" --owner=0 --group=0 --numeric-owner -T "$WORK/wheels.txt")
(cd "$ROOT/.gpu033" && split -b "${PART_MIB}M" -d -a 2 "$WORK/gpu033.tar" part)
n=0
for f in "$ROOT"/.gpu033/part*; do
  c="$ROOT/.gpu033/c$(basename "$f" | sed 's/^part//')"
  mkdir -p "$c" && mv "$f" "$c/"
  n=$((n + 1))
done
[ "$n" -le 100 ] || { echo "stage: $n parts: more than c00..c99" >&2; exit 1; }
echo "$n" > "$ROOT/.gpu033/bin/parts"
(cd "$ROOT/.gpu033" && sha256sum c*/part* | sed 's| c[0-9]*/| |' > bin/SHA256SUMS)
(cd "$WORK/wheels" && du -k $(cat "$WORK/wheels.txt") | awk '{printf "%8d KiB  %s\n", $1, $2}') \
  > "$ROOT/.gpu033/bin/MANIFEST"
cp scripts/gpu/install033.sh scripts/gpu/env033.sh "$ROOT/.gpu033/bin/"
rm -f "$WORK/gpu033.tar"
total=$(du -cb "$ROOT"/.gpu033/c*/part* | tail -1 | cut -f1)
echo "staged $(wc -l < "$WORK/wheels.txt") wheels, $((total / 1048576)) MiB, in $n parts under .gpu033/ (c00..c$(printf %02d $((n - 1))))"
echo "device time to bring them, warm host at ~5 s a part: ~$((n * 5 / 60)) min $((n * 5 % 60)) s, plus the install in the last run"
echo "next, on the host, one run per part back to back: carry .gpu033/bin and .gpu033/cNN, run: bash scripts/gpu/install033.sh"
