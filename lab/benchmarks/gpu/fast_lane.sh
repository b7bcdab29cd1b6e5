#!/usr/bin/env bash
# The fast lane on one GPU host (issue 21): the UCX lane the connector picks by itself, KV
# byte-exact with it, and serving against NixlConnector (given the same UCX settings) and a
# colocated engine. No UCX_* variable is set here: what the product chooses is measured.
#
#   OUT=/path bash lab/benchmarks/gpu/fast_lane.sh STEP...      (after bash .gpu/bin/install.sh)
#
# Steps (each fits one device call of <= 600 s):
#   lane     kvshare lane with the connector's choice, and with UCX's defaults (the slow
#            control, exit 1); bench_nixl_read: whether UCX_RMA_PPLN_ENABLE=y costs plain
#            cudaMalloc memory anything next to cuda_ipc zero-copy, and what it gives VMM
#   kvx      kv_exact e2b/plain, prefill and decode on GPU 0, verify_kv on (byte-exact KV,
#            scrambled and tampered controls), with the lane the connector chose
#   gputests tests/gpu/test_gpu_streams.py and test_gpu_probe.py (pytest's wheels carried
#            in .gpu/pytest: pip download --no-deps -d .gpu/pytest pytest pluggy iniconfig
#            pygments msgspec)
#   loads    verify_kv's false-alarm count (issue 26): one PD deployment with verify_kv on
#            (its default), LOADS (default 1100) random 1k prompts at concurrency 32, 2
#            tokens out; loads/summary.md counts the loads verified and refused
#   serve2k  vllm serve + vllm bench serve: ours (packed), NixlConnector, colocated; 2k in,
#            concurrency SERVE_CONC (default 16; 64 prompts at 16, 8 at 1), 3 rounds rotated,
#            all up at once; read timelines kept; SERVE_KV_GIB of KV per engine (default 5, for
#            an H200: on an H100 the fifth engine ran out of memory at start, 2026-12-06: use 2);
#            --max-num-seqs 64 (vLLM's default 1024 warms the sampler up with 1024 rows of
#            logits, a GiB per engine: 2 GiB of KV still ran out on an H100, 2026-12-06b);
#            SERVE_EAGER=1: no CUDA graphs nor torch.compile (engines start in about half the
#            time; use it on both stacks when comparing them). TIME_BUDGET (default 330): on an
#            H100 eager, 3 rounds of one concurrency took 330 s, of "1 16" more than 450 s
#            (2026-12-06c)
#   serve8k  the same at 8k (48 prompts per round)
#   prefix   serve2k's deployments with shared prefixes (issue 50 item 3): each run's prompts
#            start with the same PREFIX_LEN (default 1536) random tokens, then PREFIX_TAIL
#            (default 512) of their own (vllm bench serve --random-prefix-len); every engine
#            keeps vLLM's prefix caching (on: bench_serving's default, as vllm serve has it),
#            so decode's loads read only past its hit: the read logs give tokens hit and
#            loaded per load
#   serve    one run for the latency and verify_kv changes (issues 21, 26): ours with
#            verify_kv (its default), ours without, ours as it was before them (the tree in
#            .before/, carried: git archive <commit> kvshare_connector | tar -x -C .before),
#            NixlConnector and colocated, all up at once; 2k and 8k x concurrency 1 and 16,
#            3 rotated rounds; eager engines (no CUDA graphs: no torch.compile in the lease)
#   curve    issue 21's curve at one prompt length per call (CURVE_LEN, default 1024; then
#            4096, 16384, 32768): ours packed, ours block by block, NixlConnector and
#            colocated, all up at once, concurrency CURVE_CONC (default 1 16 64),
#            CURVE_ROUNDS rotated rounds (default 3; what the time budget reaches); CURVE_KV_GIB
#            per engine (default: 4 on an H200, where 7 engines share it; 1 on an H100, which
#            holds 7 with 1 GiB each, not with 2: 2026-12-05); CURVE_FT=handoff: ours with the
#            first token from prefill (the proxy's default, ours-ftp) beside ours on the classic
#            legs (ours-ftd), both packed, in place of packed and block by block; every
#            deployment then samples ids the tokenizer has text for; 2 prompts per concurrency slot
#            up to 4k, 1 beyond; the untimed shape wave's prompts capped at 4k. What fits one
#            call (2026-12-04, ~115 s to start): 16k with CURVE_CONC="1 16", 16k x 64 with
#            CURVE_ROUNDS=2, 32k with CURVE_CONC="1 16"; a 32k x 64 run (2M prompt tokens)
#            takes ~110 s per deployment, so 3 rounds of it do not fit one call. curve and
#            firsttoken keep every request's ITLs (--save-detailed): ours' ITL p50 at 32k x 1
#            was 1.5x NixlConnector's on 2026-12-06d, and the bench's JSONs held aggregates only
#   firsttoken  concurrency 1 at 1k and 4k (ours packed, NixlConnector, colocated, 3 rounds)
#            with FT_MODE=sync (eager, every engine --no-async-scheduling) or graphs (CUDA
#            graphs and torch.compile, async scheduling as vLLM's default): whether PD's
#            two-step first token on the curve (decode's one-token step as slow as colocated's
#            whole prefill) is an eager engine under async scheduling (issue 21);
#            FT_MODE=handoff: the first token from prefill (ours-ftp, the proxy's default)
#            beside the classic legs (ours-ftd), NixlConnector and colocated, at 1k and 4k x
#            concurrency 1 and 16, eager, FT_KV_GIB (default 1) of KV per engine; handoff
#            and graphs sample only ids the tokenizer has text for (the hand-off needs a
#            first token with text); FT_LENS and FT_CONC replace the prompt lengths and
#            concurrencies
#   nudge    ITL (issue 21): ours' decode ITL p50 was 1.11x (0.26) and 1.22x (0.33)
#            NixlConnector's at 2k x 16, eager (2026-12-06c). Lead: eager forwards call the
#            per-layer hook, where decode advances its reads every layer_nudge_ms while any is
#            in flight; so ours with it (the default), ours without it (layer_nudge_ms 0: at
#            step boundaries only) and NixlConnector, 2k x 16, 3 rotated rounds, eager
#   itl      decode's ITL at a long prompt, concurrency 1 (issue 21: ours' ITL p50 was 55-57 ms
#            against NixlConnector's 37 at 32k x 1, 2026-12-06d): ours as it is, ours with
#            layer_nudge_ms 0 and ours without NIXL's progress thread, all on the classic
#            legs (decode samples the first token, as with NixlConnector), and NixlConnector
#            (on an H100 without the layer_nudge_ms 0 variant: 8 engines do not fit);
#            ITL_LEN (default 32768), ITL_PROMPTS per run (default 4), 48 tokens out, 3
#            rotated rounds, every request's ITLs
#   kvcurve  kvcached along the curve (issue 21: kvcached contiguous and per-layer <= 1.1x
#            plain TTFT at every point): ours plain, ours under kvcached contiguous and
#            per-layer, first token from prefill (the proxy's default); CURVE_LEN (default
#            16384) x CURVE_CONC (default 1 16), 3 rotated rounds
#   kvreserve  ours plain, and under kvcached contiguous with
#            50-200 pages kept mapped (KVCACHED_MIN/MAX_RESERVED_PAGES; 5-10 by default;
#            kvcurve's run has kvcached's default), CURVE_LEN (16384) x CURVE_CONC (1 16),
#            3 rotated rounds
#   landing  ours plain alone (2 engines, not 6-8 sharing the host's 16 cores), CURVE_LEN
#            (16384) x CURVE_CONC (1 16), 3 rounds: the READ's posted -> in place on a host
#            whose cores are not oversubscribed (in the 6-engine runs the host's landing took
#            0.54-0.77 ms at 16k x 1)
#   kvcached033, kvcached034  (STACK=033 / 034) kvcached 0.1.6 built against that stack's
#            torch and `vllm serve` with ENABLE_KVCACHED=true: whether the engine serves or
#            stops, and its message (the sdist: the 0.34 stack's /tmp/gpu034-sdists, else the
#            0.26 install's /tmp/gpu-wheels)
#   sizing   how vLLM sizes the KV cache at start (issue 47: 0.34 maps it with driver virtual
#            memory and sizes it after warm-up, unless --kv-cache-memory-bytes is given or a
#            connector's kv_cache_access rules it out): one engine with our connector (NIXL
#            backend), then one plain, each alone on the GPU with --gpu-memory-utilization 0.3
#            and no --kv-cache-memory-bytes; sizing.log keeps each engine's sizing lines
#   faults   the fault matrix (issue 25): FAULT_CASES (default c d e f: prefill hung,
#            prefill dies before a release, a side-channel flood, the decode that never
#            comes) in FAULT_VARIANTS (default 1p1d; also 1p2d 2p1d router router-1p2d noverify);
#            add 0 (the fault-free run: the throughput column's reference) and g (small pools)
#
# STACK=033 (or 034) runs the steps on vLLM 0.33.0 (0.34.0), after bash
# lab/gpu/install033.sh (install034.sh), with its model runner (V2; 0.34 has no other) and
# FlashInfer's sampler off (it JIT-builds on first use, minutes of device time, and samples
# nothing the KV depends on); KVX_CELLS names kv_exact's cells.
set -u
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
case "${STACK:-026}" in
  033|034) . "lab/gpu/env$STACK.sh"; export VLLM_USE_FLASHINFER_SAMPLER=0 ;;
  026) . .gpu/bin/env.sh ;;
  *) echo "STACK: 026, 033 or 034, not $STACK" >&2; exit 2 ;;
esac
python3 -c 'import vllm, torch; print("vLLM", vllm.__version__, "torch", torch.__version__)' \
  > "$OUT/stack.txt" 2>&1
unset UCX_CUDA_IPC_ENABLE_GET_ZCOPY UCX_RMA_PPLN_ENABLE
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
WEIGHTS=/tmp/kvshare-weights
E2B="$WEIGHTS/gemma4_e2b_shape-seed0"
nvidia-smi -L > "$OUT/gpu.txt" 2>&1

weights() {
  [ -f "$E2B/kvshare-weights.json" ] || python3 -m lab.gpu_checks.random_weights make \
    --model gemma4_e2b_shape --dest "$WEIGHTS" > "$OUT/weights.log" 2>&1
}

pack() {  # DIR: the device call returns a limited number of files: the whole of DIR goes
          # back as DIR.tgz, and DIR keeps only its top-level tables (md, json, png)
  [ -d "$OUT/$1" ] || return 0
  tar czf "$OUT/$1.tgz" -C "$OUT" "$1" &&
    find "$OUT/$1" -mindepth 1 -maxdepth 1 ! \( -type f \( -name '*.md' -o -name '*.json' \
      -o -name '*.png' \) \) -exec rm -rf {} +
}

serve() {  # LEN PROMPTS NAME [BENCH_SERVING_ARGS...] (PROMPTS at concurrency 16)
  weights
  local len=$1 prompts=$2 name=$3
  shift 3
  # shellcheck disable=SC2086
  python3 -m lab.benchmarks.gpu.bench_serving --model-dir "$E2B" --out "$OUT/$name" \
    --deployments ours nixl colocated --prefill-gpu 0 --decode-gpu 0 --colocated-gpu 0 \
    --gpu-mem 0.13 --kv-cache-gib "${SERVE_KV_GIB:-5}" ${SERVE_EAGER:+--enforce-eager} \
    --input-len "$len" --concurrency ${SERVE_CONC:-16} \
    --num-prompts 0 --prompts-per-slot $((prompts / 16)) --min-prompts 8 \
    --output-len 64 --rounds 3 --warmup-requests 4 --serve-args "--max-num-seqs 64" \
    --time-budget "${TIME_BUDGET:-330}" --grace 10 --keep-raw "$@" \
    > "$OUT/$name.log" 2>&1
  rc=$?; echo "$name: exit $rc"; pack "$name"
}

lone_engine() {  # LOG PORT VLLM-SERVE-ARGS...: start one `vllm serve`, wait until it serves
                 # or exits (240 s at most), stop it; prints the verdict, the log keeps the rest
  local log=$1 port=$2 pid verdict="still starting after 240 s"
  shift 2
  vllm serve "$E2B" --port "$port" "$@" >> "$log" 2>&1 &
  pid=$!
  for _ in $(seq 240); do
    if ! kill -0 "$pid" 2>/dev/null; then wait "$pid"; verdict="engine exited ($?)"; break; fi
    if python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" \
      2>/dev/null; then verdict="engine serving"; break; fi
    sleep 1
  done
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  echo "$verdict"
}

ours_curve() {  # NAME ARGS...: three variants of ours (6 engines), eager, 2 GiB of KV each
                # (4 on an H200), CURVE_LEN (16384) x CURVE_CONC (1 16), 3 rotated rounds
  weights
  local name=$1 len=${CURVE_LEN:-16384} kv
  shift
  kv=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits |
    awk 'NR == 1 { print ($1 > 100000 ? 4 : 2) }')
  # shellcheck disable=SC2086
  python3 -m lab.benchmarks.gpu.bench_serving --model-dir "$E2B" --out "$OUT/$name$len" \
    --deployments ours "$@" \
    --sample-ids-below 4096 --prefill-gpu 0 --decode-gpu 0 --gpu-mem 0.13 \
    --kv-cache-gib "$kv" --enforce-eager --input-len "$len" \
    --concurrency ${CURVE_CONC:-1 16} --num-prompts 0 --prompts-per-slot 1 \
    --min-prompts 4 --output-len 32 --rounds 3 --warmup-requests 4 \
    --shape-warmup-len 4096 --serve-args "--max-num-seqs 64" \
    --time-budget "${TIME_BUDGET:-540}" --grace 10 --keep-raw --save-detailed \
    > "$OUT/$name$len.log" 2>&1
  rc=$?; echo "$name $len: exit $rc"; pack "$name$len"
}

for step in "$@"; do
  case "$step" in
    lane)
      python3 -m kvshare_connector.toolkit.cli lane --json > "$OUT/lane.json" 2> "$OUT/lane.err"
      echo "lane (connector's choice): exit $?"
      python3 -m kvshare_connector.toolkit.cli lane --ucx-lane off --json > "$OUT/lane_off.json" \
        2> "$OUT/lane_off.err"
      echo "lane (UCX defaults, the control): exit $?"
      python3 -m lab.benchmarks.gpu.bench_nixl_read --mode gpu --target-visible 0 \
        --initiator-visible 0 --total-mib 256 --desc-kib 64 16384 --iters 3 \
        --json "$OUT/nixl_read.json" --sweep-env UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y \
        UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y+UCX_RMA_PPLN_ENABLE=y \
        alloc=vmm+UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y+UCX_RMA_PPLN_ENABLE=y \
        > "$OUT/nixl_read.log" 2>&1
      echo "nixl_read: exit $?"
      ;;
    kvx)
      weights
      # shellcheck disable=SC2086
      python3 -m lab.gpu_checks.kv_exact run --out "$OUT/kvx" --cells ${KVX_CELLS:-e2b/plain} \
        --gpus 1 --verify --timeout 420 > "$OUT/kvx.log" 2>&1
      rc=$?; echo "kvx: exit $rc"; pack kvx
      ;;
    serve)
      weights
      before=()
      if [ -d .before/kvshare_connector ]; then
        # PYTHONSAFEPATH: `python -m` would put the working directory (this tree) first on
        # sys.path, ahead of PYTHONPATH. The launcher appends this checkout after the given
        # PYTHONPATH (it put it first until 2026-12-03b: ours-before ran this tree twice);
        # each engine's start line names the directory its connector code came from.
        before=(before='{"verify_kv":false}' --variant-env
          "ours-before:PYTHONPATH=$PWD/.before:$PYTHONPATH" "ours-before:PYTHONSAFEPATH=1")
      fi
      python3 -m lab.benchmarks.gpu.bench_serving --model-dir "$E2B" --out "$OUT/serve" \
        --deployments ours nixl colocated --ours-variants verify='{}' \
        noverify='{"verify_kv":false}' "${before[@]}" \
        --prefill-gpu 0 --decode-gpu 0 --colocated-gpu 0 --gpu-mem 0.1 --kv-cache-gib 2 \
        --enforce-eager --input-len 2048 8192 --concurrency 1 16 --num-prompts 0 \
        --prompts-per-slot 2 --min-prompts 4 --output-len 32 --rounds 3 --warmup-requests 4 \
        --serve-args "--max-num-seqs 64" --time-budget "${TIME_BUDGET:-540}" --grace 10 --keep-raw \
        > "$OUT/serve.log" 2>&1
      rc=$?; echo "serve: exit $rc"
      python3 -m lab.benchmarks.gpu.ttft_split "$OUT/serve" > "$OUT/serve/ttft_split.md" 2>&1
      pack serve
      ;;
    curve)
      weights
      len=${CURVE_LEN:-1024}
      pps=2; [ "$len" -gt 4096 ] && pps=1
      ours=(--ours-variants packed='{}' direct='{"staging_mib": 0}')
      if [ "${CURVE_FT:-}" = handoff ]; then  # the proxy's default beside the classic legs
        ours=(--ours-variants ftp='{}' ftd='{}' --first-token-from-decode ours-ftd
              --sample-ids-below 4096)
      fi
      # 7 engines: 4 GiB of KV each on an H200, 1 GiB on an H100 (2 did not fit, 2026-12-05)
      kv=${CURVE_KV_GIB:-$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits |
        awk 'NR == 1 { print ($1 > 100000 ? 4 : 1) }')}
      # shellcheck disable=SC2086
      python3 -m lab.benchmarks.gpu.bench_serving --model-dir "$E2B" --out "$OUT/curve$len" \
        --deployments ours nixl colocated "${ours[@]}" \
        --prefill-gpu 0 --decode-gpu 0 --colocated-gpu 0 --gpu-mem 0.13 \
        --kv-cache-gib "$kv" --enforce-eager --input-len "$len" \
        --concurrency ${CURVE_CONC:-1 16 64} --num-prompts 0 --prompts-per-slot $pps \
        --min-prompts 4 --output-len 32 --rounds "${CURVE_ROUNDS:-3}" --warmup-requests 4 \
        --shape-warmup-len 4096 --serve-args "--max-num-seqs 64" \
        --time-budget "${TIME_BUDGET:-540}" --grace 10 --keep-raw --save-detailed \
        > "$OUT/curve$len.log" 2>&1
      rc=$?; echo "curve $len: exit $rc"; pack "curve$len"
      ;;
    firsttoken)
      weights
      mode=${FT_MODE:-sync}
      conc=(1); prompts=4; kv=4
      case $mode in
        sync) extra=(--enforce-eager); sargs="--max-num-seqs 64 --no-async-scheduling" ;;
        graphs) extra=(--sample-ids-below 4096); sargs="--max-num-seqs 64" ;;
        handoff) extra=(--enforce-eager --sample-ids-below 4096 --ours-variants ftp={} ftd={}
                        --first-token-from-decode ours-ftd)
                 sargs="--max-num-seqs 64"; conc=(1 16); prompts=0
                 kv=${FT_KV_GIB:-1} ;;  # 7 engines: 7.8 GiB of weights + 1 GiB of KV each fit an H100 (2 GiB did not: OOM)
        *) echo "FT_MODE: sync, graphs or handoff, not $mode" >&2; exit 2 ;;
      esac
      # shellcheck disable=SC2086
      python3 -m lab.benchmarks.gpu.bench_serving --model-dir "$E2B" --out "$OUT/firsttoken-$mode" \
        --deployments ours nixl colocated --prefill-gpu 0 --decode-gpu 0 --colocated-gpu 0 \
        --gpu-mem 0.13 --kv-cache-gib "$kv" "${extra[@]}" --input-len ${FT_LENS:-1024 4096} \
        --concurrency ${FT_CONC:-${conc[@]}} \
        --num-prompts "$prompts" --prompts-per-slot 2 --output-len 32 --rounds 3 \
        --warmup-requests 4 --serve-args "$sargs" \
        --time-budget "${TIME_BUDGET:-520}" --grace 10 --keep-raw --save-detailed \
        > "$OUT/firsttoken-$mode.log" 2>&1
      rc=$?; echo "firsttoken $mode: exit $rc"; pack "firsttoken-$mode"
      ;;
    faults)
      weights
      # shellcheck disable=SC2086
      python3 -m lab.benchmarks.gpu.fault_matrix --model-dir "$E2B" --out "$OUT/faults" \
        --cases ${FAULT_CASES:-c d e f} --variants ${FAULT_VARIANTS:-1p1d} \
        --time-limit "${TIME_BUDGET:-520}" > "$OUT/faults.log" 2>&1
      rc=$?; echo "faults: exit $rc"; pack faults
      ;;
    gputests)
      python3 -m pip install -q --no-index --no-deps --target /tmp/pytest-site .gpu/pytest/*.whl \
        > "$OUT/gputests.log" 2>&1
      PYTHONPATH="/tmp/pytest-site:$PYTHONPATH" python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_gpu_streams.py tests/gpu/test_gpu_probe.py \
        >> "$OUT/gputests.log" 2>&1
      echo "gputests: exit $?"
      ;;
    loads)
      weights
      python3 -m lab.benchmarks.gpu.bench_serving --model-dir "$E2B" --out "$OUT/loads" \
        --deployments ours --prefill-gpu 0 --decode-gpu 0 --gpu-mem 0.1 --kv-cache-gib 4 \
        --enforce-eager --input-len 1024 --concurrency 32 --num-prompts "${LOADS:-1100}" \
        --output-len 2 --rounds 1 --no-shape-warmup --warmup-requests 4 \
        --serve-args "--max-num-seqs 64" --time-budget "${TIME_BUDGET:-300}" --grace 10 \
        --bench-timeout 240 --keep-raw > "$OUT/loads.log" 2>&1
      rc=$?; echo "loads: exit $rc"; pack loads
      ;;
    kvcached033|kvcached034)
      # What a user of vLLM 0.33 / 0.34 gets with kvcached 0.1.6 (issues 24, 47): kvcached
      # built against the stack's torch, then `vllm serve` with ENABLE_KVCACHED=true;
      # kvcached$STACK.log tells whether the engine stopped (and why) or served.
      [ "${STACK:-026}" = "${step#kvcached}" ] || { echo "$step: run with STACK=${step#kvcached}" >&2; exit 2; }
      weights
      log="$OUT/$step.log" kvc="/tmp/$step"
      sdist="/tmp/gpu$STACK-sdists/kvcached-0.1.6.tar.gz"
      [ -f "$sdist" ] || sdist=/tmp/gpu-wheels/kvcached-0.1.6.tar.gz
      # Built once per lease (it may have been built ahead, niced, while another step ran).
      if [ -d "$kvc/kvcached" ]; then echo "kvcached: built before" > "$log"; else
        (cd /tmp && python3 -m pip install -q --no-build-isolation --no-deps --no-cache-dir \
          --target "$kvc" "$sdist") > "$log" 2>&1
        echo "kvcached build ($sdist): exit $?" >> "$log"
      fi
      # Its autopatch hook is a .pth, which only a site directory reads; the 0.26 install put
      # one in the host's; without that stack in the lease, this puts it there (inert unless
      # ENABLE_KVCACHED is on, and it finds kvcached on PYTHONPATH only).
      host_site=$(PYTHONPATH= python3 -c 'import site; print(site.getsitepackages()[0])')
      [ -f "$host_site/kvcached_autopatch.pth" ] || cp "$kvc/kvcached_autopatch.pth" "$host_site/"
      # The flags every bench_serving engine gets (tokenizer, Gemma-4 overrides, attention).
      mapfile -t flags < <(python3 -m lab.benchmarks.gpu.bench_serving --engine-flags \
        --model-dir "$E2B" --enforce-eager --kv-cache-gib 2)
      ENABLE_KVCACHED=true KVCACHED_AUTOPATCH=1 PYTHONPATH="$kvc:$PYTHONPATH" \
        vllm serve "$E2B" --port 8193 --gpu-memory-utilization 0.2 --max-model-len 4096 \
        "${flags[@]}" >> "$log" 2>&1 &
      pid=$!; verdict="still starting after 240 s"
      for _ in $(seq 240); do
        if ! kill -0 "$pid" 2>/dev/null; then wait "$pid"; verdict="engine exited ($?)"; break; fi
        if python3 -c 'import urllib.request as u; u.urlopen("http://127.0.0.1:8193/health", timeout=2)' \
          2>/dev/null; then verdict="engine serving"; break; fi
        sleep 1
      done
      if [ "$verdict" = "engine serving" ]; then  # and answers: one completion
        python3 -c 'import json, sys, urllib.request as u
body = json.dumps({"model": sys.argv[1], "prompt": "one two three", "max_tokens": 8}).encode()
req = u.Request("http://127.0.0.1:8193/v1/completions", body, {"Content-Type": "application/json"})
print("kvcached completion:", json.load(u.urlopen(req, timeout=60))["usage"])' "$E2B" \
          2>&1 | tail -n 1 | tee -a "$log"
      fi
      kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
      echo "$step: $verdict" | tee -a "$log"
      grep -m3 -E "KVCachedConfigError|runner adapter|kvcached" "$log"
      ;;
    sizing)
      weights
      log="$OUT/sizing.log"; : > "$log"
      mapfile -t flags < <(python3 -m lab.benchmarks.gpu.bench_serving --engine-flags \
        --model-dir "$E2B" --enforce-eager)
      flags+=(--gpu-memory-utilization 0.3 --max-model-len 4096)
      ours='{"kv_connector":"KVShareConnector","kv_connector_module_path":"kvshare_connector","kv_role":"kv_both"}'
      for engine in ours plain; do
        echo "=== $engine" >> "$log"
        if [ "$engine" = ours ]; then
          verdict=$(VLLM_NIXL_SIDE_CHANNEL_PORT=15990 lone_engine "$log" 8194 "${flags[@]}" \
            --kv-transfer-config "$ours")
        else
          verdict=$(lone_engine "$log" 8194 "${flags[@]}")
        fi
        echo "sizing $engine: $verdict" | tee -a "$log"
      done
      grep -E "^=== |^sizing |[Ee]xtensible KV cache|Extended KV cache|Memory after warmup|Available KV cache memory|GPU KV cache size|KVShareConnector .*registered" "$log" | cut -c1-300
      ;;
    nudge)
      weights
      python3 -m lab.benchmarks.gpu.bench_serving --model-dir "$E2B" --out "$OUT/nudge" \
        --deployments ours nixl --ours-variants nudge='{}' nonudge='{"layer_nudge_ms": 0}' \
        --prefill-gpu 0 --decode-gpu 0 --gpu-mem 0.13 --kv-cache-gib "${SERVE_KV_GIB:-2}" \
        --enforce-eager --input-len 2048 --concurrency 16 --num-prompts 0 \
        --prompts-per-slot 4 --min-prompts 8 --output-len 64 --rounds 3 --warmup-requests 4 \
        --serve-args "--max-num-seqs 64" --time-budget "${TIME_BUDGET:-360}" --grace 10 \
        --keep-raw > "$OUT/nudge.log" 2>&1
      rc=$?; echo "nudge: exit $rc"; pack nudge
      ;;
    itl)
      weights
      kv=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits |
        awk 'NR == 1 { print ($1 > 100000 ? 2 : 1) }')
      # 8 engines (7.8 GiB of weights each) do not fit an H100: there, 6 (no nonudge)
      ours=(base='{}' noprog='{"nixl_progress_thread": false}')
      [ "$kv" = 2 ] && ours+=(nonudge='{"layer_nudge_ms": 0}')
      classic=(); for o in "${ours[@]}"; do classic+=("ours-${o%%=*}"); done
      python3 -m lab.benchmarks.gpu.bench_serving --model-dir "$E2B" --out "$OUT/itl" \
        --deployments ours nixl --ours-variants "${ours[@]}" \
        --first-token-from-decode "${classic[@]}" \
        --prefill-gpu 0 --decode-gpu 0 --gpu-mem 0.11 --kv-cache-gib "$kv" --enforce-eager \
        --input-len "${ITL_LEN:-32768}" --concurrency 1 --num-prompts 0 \
        --prompts-per-slot "${ITL_PROMPTS:-4}" \
        --min-prompts 4 --output-len 48 --rounds 3 --warmup-requests 4 \
        --shape-warmup-len 4096 --serve-args "--max-num-seqs 64" \
        --time-budget "${TIME_BUDGET:-540}" --grace 10 --keep-raw --save-detailed \
        > "$OUT/itl.log" 2>&1
      rc=$?; echo "itl: exit $rc"; pack itl
      ;;
    kvcurve)
      ours_curve kvcurve --ours-variants plain='{}' kvc='{}' kvl='{}' \
        --kvcached contiguous --kvcached-on ours-kvc ours-kvl=per_layer
      ;;
    kvreserve)  # 16k x 16 under kvcached was 1.10-1.13x plain (2026-12-06f), its prefill
      # engine queueing longer: whether kvcached's page map/unmap on the engine's path is it
      ours_curve kvreserve --ours-variants plain='{}' \
        kvr='{}' --kvcached contiguous --kvcached-on ours-kvr \
        --variant-env ours-kvr:KVCACHED_MIN_RESERVED_PAGES=50 \
        ours-kvr:KVCACHED_MAX_RESERVED_PAGES=200
      ;;
    landing) ours_curve landing --ours-variants plain='{}' ;;
    serve2k) serve 2048 64 serve2k ;;
    serve8k) serve 8192 48 serve8k ;;
    prefix) serve "${PREFIX_TAIL:-512}" 64 prefix --random-prefix-len "${PREFIX_LEN:-1536}" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
