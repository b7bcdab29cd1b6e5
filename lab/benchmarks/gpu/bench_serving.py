#!/usr/bin/env python3
"""Real serving, measured: ``vllm serve`` deployments side by side under ``vllm bench serve``.

Deployments: ``ours`` (prefill ``kv_producer``, decode ``kv_consumer``, KVShareConnector;
``--ours-variants`` runs several connector configurations), ``nixl`` (the same with vLLM's
NixlConnector) and ``colocated`` (one plain ``vllm serve``). PD ones run N prefill x M decode
engines (``--num-prefill/--num-decode``) behind our proxy or vllm-router (``--router``).

Modes (``--mode``):

* ``rounds``: every (input length, concurrency) point once per deployment per round, the
  order rotated, >= 3 rounds, medians and spread; 64 prompts of 2048 in / 64 out at
  concurrency 16 by default (a run is 10-30 s).
* ``scaling``: 1k/4k/16k/32k prompts x concurrency 1/16/64, one round, few prompts per
  point, bounded by ``--time-budget``; points not reached are reported as such.
* ``faults``: one of our deployments under load, one engine (``--fault-victim prefill|decode``)
  hit and brought back: killed at a failpoint (``--fault-point source.claim_answered``: it
  starts with ``KVSHARE_FAILPOINTS=NAME=exit@K``, K = ``--fault-skip``) or by SIGKILL at
  ``--kill-after`` s, then restarted without the failpoint; or (``--fault-action stop``)
  SIGSTOPped for ``--stop-seconds``, then SIGCONT. faults.md: the survivor kept serving,
  nothing hung, the victim rejoined, KV usage back to zero, connector series live, no wrong
  KV; with requests completed/failed/computed locally and the time to the first good
  request. Several cases at once on one GPU: ``python -m lab.benchmarks.gpu.fault_matrix``.

Every deployment is warmed up by a handful of greedy requests whose answers are checked
(checks/); ``vllm bench serve`` runs in one long-lived process (serving/bench_worker.py).
Raw files (vLLM's result JSONs, read logs, engine metrics, server logs, the manifest) end in
OUT/raw.tar.gz; serving_report.py makes OUT/summary.md, results.json and scaling.png from
them (also later: ``--report OUT``). Without a CUDA GPU it says so and exits 0.

    . .gpu/bin/env.sh
    python -m lab.benchmarks.gpu.bench_serving --make-weights gemma4_e2b_shape --out OUT
    python -m lab.benchmarks.gpu.bench_serving --model-dir DIR --out OUT --mode faults \
        --fault-victim decode --fault-point sink.read_posted \
        --extra-config '{"kv_lease_duration": 15}' --prefill-gpu 0 --decode-gpu 0
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from kvshare_connector.common.failpoints import POINTS as FAILPOINTS
from kvshare_connector.toolkit.procs import signals_interrupt
from lab.benchmarks.gpu import serving_report
from lab.benchmarks.gpu.serving.client import BenchClient, bench_options  # noqa: F401
from lab.benchmarks.gpu.serving.deployments import (  # noqa: F401
    KINDS,
    KVCACHED_MODES,
    PORT_STRIDE,
    Planned,
    check_memory,
    describe,
    gpu_names,
    kvcached_env,
    model_vocab,
    parse_variants,
    plan,
    resolve_model,
    resolve_tokenizer,
    sampled_vocab,
    serve_args,
)
from lab.benchmarks.gpu.serving.runs import Runner

MODES = ("rounds", "scaling", "faults")
#: Per-mode defaults of the options left unset (None) on the command line.
MODE_DEFAULTS = {
    "rounds": dict(input_len=[2048], concurrency=[16], output_len=64, num_prompts=64,
                   time_budget=520.0),
    "scaling": dict(input_len=[1024, 4096, 16384, 32768], concurrency=[1, 16, 64],
                    output_len=32, num_prompts=0, time_budget=520.0),
    "faults": dict(input_len=[2048], concurrency=[16], output_len=32, num_prompts=0,
                   time_budget=0.0),
}  # fmt: skip


def apply_mode_defaults(args: argparse.Namespace) -> argparse.Namespace:
    if isinstance(args.extra_config, list):  # every --extra-config, one JSON object
        merged: dict = {}
        for text in args.extra_config:
            try:
                merged.update(json.loads(text))
            except (ValueError, TypeError, AttributeError):
                raise SystemExit(f"--extra-config {text!r}: not a JSON object") from None
        args.extra_config = json.dumps(merged)
    for key, value in MODE_DEFAULTS[args.mode].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.mode == "faults":
        args.deployments = ["ours"]
        args.ours_variants = args.ours_variants[:1] if args.ours_variants else None
    return args


def has_cuda() -> str | None:
    """None when a CUDA GPU is usable, else why not."""
    try:
        import torch
    except ImportError as exc:
        return f"torch not importable ({exc})"
    return None if torch.cuda.is_available() else "torch sees no CUDA device"


def run_benchmark(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    out = Path(args.out).resolve()
    raw = out / serving_report.RAW
    if (out / serving_report.TARBALL).exists() or raw.exists():
        raise SystemExit(f"{out} already holds a run; pick another --out")
    (raw / "reads").mkdir(parents=True)
    model_dir = resolve_model(args)
    tokenizer = resolve_tokenizer(model_dir, args)
    sampled = sampled_vocab(tokenizer)
    if sampled is not None and sampled > model_vocab(model_dir):
        raise SystemExit(
            f"{tokenizer}: {sampled} ids > the model's vocab_size; random prompts "
            "would hold ids the model has no embedding for"
        )
    planned = plan(args, model_dir, tokenizer, raw)
    if args.mode == "faults":
        from lab.benchmarks.gpu.serving.faults import arm

        arm(planned, args)  # before deployments.json: it shows the victim's failpoint
    check_memory(planned, args.one_at_a_time)
    meta = {k: v for k, v in vars(args).items() if k != "func"}
    meta.update(model_dir=str(model_dir), tokenizer=str(tokenizer), gpus=gpu_names(),
                started=time.strftime("%Y-%m-%d %H:%M:%S"), argv=sys.argv)  # fmt: skip
    (raw / "meta.json").write_text(json.dumps(meta, indent=1))
    (raw / "deployments.json").write_text(json.dumps(describe(planned), indent=1))

    client = BenchClient(raw, args.bench_cmd, args.bench_impl)
    vocab = sampled or model_vocab(model_dir)
    runner = Runner(args, planned, tokenizer, raw, client, vocab)
    runner.t0 = t_start  # the time budget counts from the command's start
    interrupted, rc = False, 0
    with signals_interrupt(signal.SIGTERM, signal.SIGHUP):
        try:
            client.start()  # its vLLM import overlaps the engines' startup
            if args.mode == "rounds":
                runner.run_rounds()
            elif args.mode == "scaling":
                from lab.benchmarks.gpu.serving.scaling import run_scaling

                run_scaling(runner)
            else:
                from lab.benchmarks.gpu.serving.faults import run_faults

                rc = run_faults(runner, out)
        except KeyboardInterrupt:
            interrupted = True
            print("[bench] interrupted: stopping everything", flush=True)
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup below must finish
            client.close()
            runner.stop_all()
            (raw / "broken.json").write_text(json.dumps(runner.broken, indent=1))
            if (raw / "runs.jsonl").exists():
                serving_report.write_report(out)
            serving_report.pack(out, args.keep_raw)
    for name in ("summary.md", "faults.md"):
        if (out / name).exists():
            print((out / name).read_text())
    print(f"[bench] done in {time.monotonic() - t_start:.0f}s; {out}", flush=True)
    if interrupted:
        return 130
    return 1 if rc or runner.failures or runner.broken else 0


def _gpus(text: str) -> list[str]:
    return [g.strip() for g in text.split(",") if g.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )  # fmt: skip
    add = p.add_argument
    add("--mode", choices=MODES, default="rounds")
    add("--report", metavar="OUT", help="only recompute the tables from OUT's raw files")
    add("--out", help="output directory (must not hold a run yet)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model-dir", help="config.json + safetensors weights")
    src.add_argument("--make-weights", metavar="MODEL", help="g4tiny|gemma4_e2b_shape|...: "
                     "random-init weights made by random_weights.py")  # fmt: skip
    add("--weights-root", default="/tmp/kvshare-weights", help="where --make-weights writes")
    add("--tokenizer", help="tokenizer dir (default: the model's, else a local BPE one)")
    add("--tokenizer-vocab", type=int, default=4096, help="local tokenizer size (0: model's)")
    add("--served-model-name", default="kvshare-bench")
    add("--deployments", nargs="+", choices=KINDS, default=list(KINDS))
    add("--ours-variants", nargs="+", metavar="NAME=JSON", help='e.g. direct={"staging_mib":0}')
    add("--sample-ids-below", type=int, default=0, metavar="N",
        help="every bench request samples only token ids below N (allowed_token_ids, past "
        "the local tokenizer's special ids): random-init weights otherwise sample ids the "
        "tokenizer cannot turn into text, and such a first token stays on decode")  # fmt: skip
    add("--first-token-from-decode", nargs="+", default=[], metavar="NAME",
        help="deployments whose proxy has decode sample the first token again (vLLM's toy "
        "proxy's way; default: our proxy streams prefill's, toolkit/first_token.py)")  # fmt: skip
    add("--side-down", choices=["alone", "fail"], default="alone",
        help="our proxy when every server of one side is down: the other side computes the "
        "request alone (default), or the client gets the 503/502 (proxy --side-down)")
    add("--extra-config", action="append", help="JSON merged into our "
        "kv_connector_extra_config; given again, merged in order (later keys win)")
    add("--engine-env", nargs="+", metavar="KEY=VALUE", help="env of every engine, e.g. "
        "UCX_LOG_LEVEL=info UCX_PROTO_INFO=y (which lane a READ takes)")  # fmt: skip
    add("--variant-env", nargs="+", metavar="NAME:KEY=VALUE", help="env of one deployment's "
        "engines, e.g. ours-before:PYTHONPATH=/old/tree:... (an earlier version of the "
        "connector side by side with this one)")  # fmt: skip
    add("--kvcached", choices=KVCACHED_MODES, default="none")
    add("--kvcached-on", nargs="+", default=["ours"], metavar="KIND|NAME[=MODE]",
        help="deployments under kvcached (kinds or names, e.g. ours-kvc=contiguous)")  # fmt: skip
    add("--router", choices=["kvshare", "vllm-router"], default="kvshare",
        help="front of the PD deployments: our proxy or vllm-router (PD mode)")  # fmt: skip
    add("--router-policy", default="round_robin", help="vllm-router's --policy")
    add("--num-prefill", type=int, default=1)
    add("--num-decode", type=int, default=1)
    add("--input-len", type=int, nargs="+", default=None, help="rounds: 2048; scaling: 1k-32k")
    add("--output-len", type=int, default=None, help="rounds: 64; scaling, faults: 32")
    add("--num-prompts", type=int, default=None,
        help="rounds: 64 per run (0: concurrency x --prompts-per-slot, at least "
             "--min-prompts, per point)")  # fmt: skip
    add("--concurrency", type=int, nargs="+", default=None, help="rounds: 16; scaling: 1 16 64")
    add("--rounds", type=int, default=3)
    add("--prompts-per-slot", type=int, default=1,
        help="scaling (rounds with --num-prompts 0): prompts = concurrency x this")
    add("--min-prompts", type=int, default=4,
        help="scaling (rounds with --num-prompts 0): at least this many per point")
    add("--time-budget", type=float, default=None,
        help="s from the start; runs that would pass it are skipped and reported "
             "(rounds, scaling: 520, so that a command with its shutdown fits 10 minutes; "
             "0: none)")  # fmt: skip
    add("--seed", type=int, default=0)
    add("--warmup-requests", type=int, default=8, help="checked greedy requests per deployment")
    add("--warmup-tokens", type=int, default=16, help="tokens each warmup request generates")
    add("--warmup-len", type=int, default=2048, help="warmup prompt length cap")
    add("--no-shape-warmup", dest="shape_warmup", action="store_false",
        help="rounds: skip the untimed wave per point and deployment before round 0")
    add("--shape-warmup-len", type=int, default=0,
        help="rounds: cap the untimed wave's prompt length (0: each point's own length)")
    add("--gpu-mem", type=float, default=0.3, help="gpu-memory-utilization per engine")
    add("--kv-cache-gib", type=float, default=None,
        help="fixed KV cache per engine (--kv-cache-memory-bytes): no memory profiling, so "
             "all engines and deployments start at once, also on one GPU")  # fmt: skip
    add("--decode-gpu-mem", type=float, default=None, help="per decode engine (default --gpu-mem)")
    add("--max-model-len", type=int, default=None, help="default: longest input + output + 128")
    add("--prefill-gpu", type=_gpus, default=["0"], help="GPU(s) of prefill engines, cycled")
    add("--decode-gpu", type=_gpus, default=["1"], help="GPU(s) of decode engines, cycled")
    add("--colocated-gpu", default="0")
    add("--attention-backend", default="auto", help="auto: TRITON_ATTN if hf_overrides needed")
    add("--no-prefix-caching", dest="prefix_caching", action="store_false",
        help="turn vLLM's prefix caching off in every engine (on by default, as vllm serve "
             "has it: each round and point draws its own random prompts, which share no "
             "prefix, so a run measures loads, not hits)")  # fmt: skip
    add("--random-prefix-len", type=int, default=0,
        help="tokens every prompt of a run starts with (vllm bench serve's own option: the "
             "prefix is drawn per run), before its --input-len random ones")  # fmt: skip
    add("--enforce-eager", action="store_true")
    add("--serve-args", help="more vllm serve arguments, in one string")
    add("--engine-flags", action="store_true", help="print, one per line, the flags an engine "
        "of --model-dir gets from these options (for a lone vllm serve) and exit")  # fmt: skip
    add("--one-at-a-time", action="store_true", help="start/stop each deployment per round")
    add("--base-port", type=int, default=18000, help=f"+{PORT_STRIDE} per deployment")
    add("--side-channel-port", type=int, default=15600)
    add("--ready-timeout", type=float, default=900.0, help="s, per deployment start")
    add("--bench-timeout", type=float, default=300.0, help="s, per vllm bench serve")
    add("--grace", type=float, default=20.0, help="s between SIGTERM and SIGKILL")
    add("--save-detailed", action="store_true", help="per-request data in the result JSONs")
    add("--keep-raw", action="store_true", help="keep OUT/raw next to raw.tar.gz")
    f = p.add_argument_group("faults mode")
    f.add_argument("--fault-rate", type=float, default=4.0, help="requests/s offered")
    f.add_argument("--load-seconds", type=float, default=60.0, help="length of the offered load")
    f.add_argument("--fault-victim", choices=["prefill", "decode"], default="prefill")
    f.add_argument("--fault-action", choices=["kill", "stop", "flood", "drop", "none"],
                   default="kill",
                   help="kill: the victim dies (at --fault-point, else SIGKILL at "
                        "--kill-after) and is restarted; stop: SIGSTOP at --kill-after, "
                        "SIGCONT --stop-seconds later; flood: a client without the secret "
                        "floods prefill's side channel for --stop-seconds; drop (decode): "
                        "our proxy never sends the decode leg of rate x --stop-seconds "
                        "requests, from the --fault-skip'th on; none: the same load and "
                        "checks without a fault (the reference for a fault's throughput; "
                        "with a small --kv-cache-gib, the small-pool case)")  # fmt: skip
    f.add_argument("--fault-point", choices=sorted(FAILPOINTS), default=None,
                   help="kill: the victim exits at this failpoint (KVSHARE_FAILPOINTS)")
    f.add_argument("--fault-skip", type=int, default=None,
                   help="failpoint hits let pass first (default: warmup requests + 18: the "
                        "warm-up and the reference checks, then 10 under load)")  # fmt: skip
    f.add_argument("--kill-after", type=float, default=15.0,
                   help="s after load start: SIGKILL or SIGSTOP (a failpoint not fired by "
                        "this + 30 s: SIGKILL, recorded as not fired)")  # fmt: skip
    f.add_argument("--restart-after", type=float, default=3.0, help="s after the kill")
    f.add_argument("--stop-seconds", type=float, default=25.0,
                   help="stop: s between SIGSTOP and SIGCONT (handshake timeout: 10)")
    f.add_argument("--rejoin-timeout", type=float, default=180.0, help="s for the victim to return")
    f.add_argument("--drain-timeout", type=float, default=None,
                   help="s for KV usage to hit 0 (default: max(60, kv_lease_duration + 30))")
    f.add_argument("--probe-timeout", type=float, default=30.0, help="s per probe request")
    f.add_argument("--sample-interval", type=float, default=0.5)
    t = p.add_argument_group("tests")
    t.add_argument("--server-cmd", help="replaces vllm serve (tests: the fake server)")
    t.add_argument("--bench-cmd", help="a command per run instead of the bench worker")
    t.add_argument("--bench-impl", help="MOD:FUNC the bench worker runs instead of vLLM's")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        serving_report.write_report(Path(args.report))
        print((Path(args.report) / "summary.md").read_text())
        return 0
    if args.engine_flags:
        if not args.model_dir:
            build_parser().error("--engine-flags needs --model-dir")
        model_dir = Path(args.model_dir)
        print("\n".join(serve_args(model_dir, resolve_tokenizer(model_dir, args), args)))
        return 0
    if not args.out or not (args.model_dir or args.make_weights):
        build_parser().error("--out and --model-dir (or --make-weights) are required")
    if args.fault_point and args.fault_action != "kill":
        build_parser().error("--fault-point goes with --fault-action kill (the point exits)")
    if args.fault_action == "flood" and args.fault_victim != "prefill":
        build_parser().error("--fault-action flood floods prefill's side channel")
    if args.fault_action == "drop" and (args.fault_victim != "decode"
                                        or args.router != "kvshare"):  # fmt: skip
        build_parser().error("--fault-action drop: the decode that never comes "
                             "(--fault-victim decode), through our proxy (--router kvshare)")
    apply_mode_defaults(args)
    if not args.server_cmd:
        why = has_cuda()
        if why:
            print(f"[bench] SKIP: no CUDA GPU here ({why}); nothing was started", flush=True)
            return 0
    return run_benchmark(args)


if __name__ == "__main__":
    sys.exit(main())
