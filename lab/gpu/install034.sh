#!/usr/bin/env bash
# On the GPU host, from the project root, on every run that uses vLLM 0.34 (issue 47):
#   bash lab/gpu/install034.sh        (or bash .gpu034/bin/install034.sh)
# Needs .gpu034/bin carried (the part count and checksums written by lab/gpu/stage_gpu_034.sh).
# Collects the carried part(s) .gpu034/cNN/partNN into /tmp/gpu034-parts (a part carried by an
# earlier run may be gone from the tree, but /tmp survives while the host stays warm), checking
# each against SHA256SUMS. Once every part is there, installs all wheels into /tmp/site034 with
# one `pip install --no-index --no-deps --target` and prints vLLM's and torch's versions and
# the GPU. Then does nothing on later runs. Never touches the 0.26 and 0.33 stacks (/tmp/site,
# /tmp/gpu-parts, .gpu/; /tmp/site033, .gpu033/), so all three can be used in one lease.
set -u
BIN=.gpu034/bin
PARTS=/tmp/gpu034-parts
SITE=/tmp/site034
if [ ! -f "$BIN/parts" ] || [ ! -f "$BIN/SHA256SUMS" ]; then
  echo "gpu034: no $BIN/parts: carry .gpu034/bin (written by lab/gpu/stage_gpu_034.sh) and run from the project root" >&2
  exit 2
fi
want=$(cat "$BIN/parts")
mkdir -p "$PARTS"
# A different staging (other checksums) starts over: its parts and its install.
if ! cmp -s "$BIN/SHA256SUMS" "$PARTS/SHA256SUMS"; then
  rm -f "$PARTS"/part* && cp "$BIN/SHA256SUMS" "$PARTS/SHA256SUMS"
  if [ -d "$SITE" ] && ! cmp -s "$BIN/SHA256SUMS" "$SITE/.kvshare-staged"; then rm -rf "$SITE"; fi
fi
if cmp -s "$BIN/SHA256SUMS" "$SITE/.kvshare-staged" 2>/dev/null; then
  echo "gpu034 stack: installed in $SITE"
  exit 0
fi
for f in .gpu034/c*/part*; do
  [ -f "$f" ] || continue
  p=$(basename "$f")
  [ -f "$PARTS/$p" ] && continue
  if [ "$(sha256sum < "$f" | cut -d' ' -f1)" = "$(awk -v p="$p" '$2 == p {print $1}' "$BIN/SHA256SUMS")" ]; then
    cp "$f" "$PARTS/$p.tmp" && mv "$PARTS/$p.tmp" "$PARTS/$p"
  else
    echo "gpu034: $f does not match SHA256SUMS: not kept" >&2
  fi
done
have=$(ls "$PARTS" | grep -c '^part[0-9]*$')
if [ "$have" -lt "$want" ]; then
  missing=$(awk '{print $2}' "$BIN/SHA256SUMS" | while read -r p; do [ -f "$PARTS/$p" ] || echo "$p"; done | sed 's/^part/c/')
  echo "gpu034 stack: have $have of $want parts; to bring: $(echo "$missing" | head -8 | tr '\n' ' ')$([ "$(echo "$missing" | wc -l)" -gt 8 ] && echo '...')"
  exit 0
fi
set -e
t0=$(date +%s)
rm -rf /tmp/gpu034-wheels "$SITE.tmp" && mkdir -p /tmp/gpu034-wheels
cat "$PARTS"/part* | tar xf - -C /tmp/gpu034-wheels
# Source distributions (kvcached 0.1.6) are built by the step that uses them (fast_lane.sh).
mkdir -p /tmp/gpu034-sdists && find /tmp/gpu034-wheels -maxdepth 1 -name '*.tar.gz' \
  -exec mv {} /tmp/gpu034-sdists/ \;
# One pip run for all wheels: pip --target replaces a top-level directory that a later run also
# writes (nvidia/, cuda/, bin/), so the wheels must go in together. Expect one warning, "Target
# directory /tmp/site034.tmp/include already exists": nvidia-cudnn-frontend ships include/ at
# its top level, so NIXL's C++ headers are not copied (nothing at run time reads them).
python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
  --no-cache-dir --target "$SITE.tmp" /tmp/gpu034-wheels/*.whl
rm -rf "$SITE" && mv "$SITE.tmp" "$SITE"
cp "$BIN/SHA256SUMS" "$SITE/.kvshare-staged"
rm -rf /tmp/gpu034-wheels "$PARTS"/part*
echo "gpu034: installed $(ls "$SITE" | grep -c 'dist-info$') distributions into $SITE in $(( $(date +%s) - t0 )) s"
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=/dev/null
. "$HERE/env034.sh"
python3 -c "import vllm, torch, triton, flashinfer, nixl, lmcache; print('gpu034 stack: vllm', vllm.__version__, '| torch', torch.__version__, '| triton', triton.__version__, '| flashinfer', flashinfer.__version__, '| nixl via', nixl._api.__name__.split('.')[0], '| torch from', torch.__file__.rsplit('/', 2)[0])"
# What the host provides for the stack: pip's check over /tmp/site034 first, then the host's
# site-packages, less what the list leaves out on purpose (lab/gpu/wheels-vllm-0.34.0.txt).
# Expected beside those: the three pins CI overrides too (vLLM's flashinfer-python==0.7.3,
# LMCache's opentelemetry-api<=1.40.0, its exporter's opentelemetry-sdk~=1.40.0).
python3 -m pip check --disable-pip-version-check 2>&1 \
  | grep -vE '^(vllm|flashinfer-python|nvidia-cutlass-dsl|nixl) [^ ]+ requires (humming-kernels|tilelang|tokenspeed-mla|pynvvideocodec|torchcodec|nccl-extensions|nvidia-cutlass-dsl-libs-cu12|nixl-cu12),' \
  | sed 's/^/gpu034 pip check: /' | head -40 || true
python3 - <<'EOF'
import torch
x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
(x @ x).sum().item()  # cuBLAS from the carried wheel
print("gpu034 stack:", torch.cuda.get_device_name(), "| cuDNN", torch.backends.cudnn.version(),
      "| NCCL", ".".join(map(str, torch.cuda.nccl.version())))
EOF
