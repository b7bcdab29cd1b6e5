"""The 32k x 1 loads (207.6 MB) of 2026-12-06d against 2026-12-06e, from the read logs:
RAW06D = curve32768/raw of ../../2026-12-06d/raw/curve32768.tgz, RAWE = itl/raw of itl.tgz
(unpacked). Columns: reads, READ seconds (post -> in place) ms, GB/s from them, posted ->
landed ms, scatter and digests host launch ms, scatter and digest plan ms, scatter upload
ms, asked -> claimed ms, asked -> reported ms; median (min-max)."""
import json,statistics as st,sys
import os
RAW06D, RAWE = sys.argv[1], sys.argv[2]
def load(f, nbytes=2e8):
    rows=[json.loads(l) for l in open(f)]
    runs=[json.loads(l) for l in open(os.path.join(os.path.dirname(os.path.dirname(f)),'runs.jsonl'))]
    dep=os.path.basename(f).replace('-decode0.jsonl','')
    c1=[(r['start'],r['end']) for r in runs if r['deployment']==dep and r['concurrency']==1 and not r.get('warmup')]
    return [r for r in rows if r['bytes']>nbytes and any(a<=r['time']<=b+5 for a,b in c1)]
def q(v): 
    v=sorted(v); return f"{st.median(v):.2f} ({v[0]:.2f}-{v[-1]:.2f})"
for name,f in [("2026-12-06d ours-ftd",RAW06D+'/reads/ours-ftd-decode0.jsonl'),("2026-12-06d ours-ftp",'/tmp/c32x/curve32768/raw/reads/ours-ftp-decode0.jsonl'),("2026-12-06e ours-base",RAWE+'/reads/ours-base-decode0.jsonl'),("2026-12-06e ours-noprog",'/tmp/itl/out/x/itl/raw/reads/ours-noprog-decode0.jsonl')]:
    R=load(f)
    # concurrency 1 only: in 12-06d there were c16 too; keep reads whose claims didn't overlap -> use all, note
    t=lambda r,a,b: (r['timeline'][b]-r['timeline'][a])*1e3
    lh=lambda r,k: r['landing_host'].get(k,0)*1e3
    print(f"| {name} | {len(R)} | {q([r['seconds']*1e3 for r in R])} | {q([207.6/(r['seconds']*1e3) for r in R])} | {q([t(r,'posted','landed') for r in R])} | {q([lh(r,'scatter') for r in R])} | {q([lh(r,'digests') for r in R])} | {q([lh(r,'scatter_plan') for r in R])} | {q([lh(r,'digest_plan') for r in R])} | {q([lh(r,'scatter_upload') for r in R if 'scatter_upload' in r['landing_host']] or [0])} | {q([t(r,'asked','claimed') for r in R])} | {q([t(r,'asked','reported') for r in R])} |")
