#!/usr/bin/env python3
"""The GPU fault matrix (issue #25) in one command: several fault cases of
``bench_serving --mode faults`` at once on one GPU (in waves where their engines do not fit
it: ``--engines-at-once``), each its own process with its own ports and OUT subfolder, and
one table, OUT/fault_matrix.md (and .json), out of the run.

Cases (``--cases`` picks some; default all):

* ``prefill_claim``: prefill exits at ``source.claim_answered`` (a READ's blocks just
  handed out), restarted;
* ``decode_read``: decode exits at ``sink.read_posted`` (its READ in flight), restarted;
  prefill's lease (``kv_lease_duration`` 15) must free the blocks it held for it;
* ``prefill_stop``: prefill hung, SIGSTOP 25 s (past the 10 s handshake timeout), SIGCONT;
* ``prefill_release``: prefill exits at ``source.before_release``, restarted;
* ``prefill_flood``: a client without the secret floods prefill's side channel for 15 s;
* ``decode_never_comes``: our proxy drops the decode leg of 16 requests (4 s at 4 req/s);
  prefill's lease (``kv_lease_duration`` 15) must free what it held for them;
* ``small_pools``: no fault, 0.125 GiB of KV per engine (1/16 of the others) at twice the
  rate (sized from 2026-12-03d's peaks at 2 GiB: prefill 5 %, decode 15 %): prefill's holds
  fill its pool and decode's fills (2026-12-04: 85 % and 87 %, up to 8 requests waiting
  for room, no preemption logged); its throughput is another load's, so it gets no ratio;
* ``fault_free`` (``0``): the same load without a fault, the others' throughput reference.

Per case, decode's output throughput over the load is set against ``fault_free`` of the
same deployment. The target (>= 90 %, issue #25: requests not tied to the faulty peer) is
judged where no request has to be tied to it: the victim killed with a second engine of its
role to take its legs, or flooded (it keeps serving). Elsewhere the ratio is reported: in
1P1D every request needs the victim, a stopped engine holds the requests it took, dropped
decode legs are the fault itself, and small pools are another deployment.

``--variants`` runs each case in several deployments (default ``1p1d``): ``1p2d`` (two
decodes), ``2p1d`` (two prefills: with one down, our proxy sends its legs to the other),
``router`` (vllm-router in front instead of our proxy), ``router-1p2d``, and
``noverify`` (``verify_kv`` off); the table names them ``case@variant``. The decode that
never comes needs our proxy: with a router it is left out, and the table says so.

Sized for one device call of 10 minutes with the engines' start (eager): 20 s of load at
4 req/s, the fault 8 s in (a failpoint: its 10th hit under load), restart 2 s later; a
total ``--time-limit`` after which every case is stopped (SIGTERM: each stops its engines).

    python -m lab.benchmarks.gpu.fault_matrix --model-dir DIR --out OUT [--cases a b ...]
Options it does not know go to every case (e.g. ``--input-len 1024``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.benchmarks.gpu.bench_serving import build_parser
from lab.benchmarks.gpu.serving.fault_report import VERDICTS, verdict_text

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Case:
    name: str
    victim: str
    how: str  # what the table says when the run gave no answer
    argv: list[str] = field(default_factory=list)
    variant: str = "1p1d"


CASES = {
    "a": Case("prefill_claim", "prefill", "failpoint source.claim_answered",
              ["--fault-victim", "prefill", "--fault-point", "source.claim_answered"]),
    "b": Case("decode_read", "decode", "failpoint sink.read_posted",
              ["--fault-victim", "decode", "--fault-point", "sink.read_posted",
               "--extra-config", '{"kv_lease_duration": 15}']),
    "c": Case("prefill_stop", "prefill", "SIGSTOP",
              ["--fault-victim", "prefill", "--fault-action", "stop", "--stop-seconds", "25"]),
    "d": Case("prefill_release", "prefill", "failpoint source.before_release",
              ["--fault-victim", "prefill", "--fault-point", "source.before_release"]),
    "e": Case("prefill_flood", "prefill", "side-channel flood without the secret",
              ["--fault-victim", "prefill", "--fault-action", "flood", "--stop-seconds", "15"]),
    "f": Case("decode_never_comes", "decode", "proxy drops the decode leg",
              ["--fault-victim", "decode", "--fault-action", "drop", "--stop-seconds", "4",
               "--extra-config", '{"kv_lease_duration": 15}']),
    "g": Case("small_pools", "prefill", "none: 0.125 GiB KV per engine, 8 req/s",
              ["--fault-action", "none", "--kv-cache-gib", "0.125", "--fault-rate", "8"]),
    "0": Case("fault_free", "prefill", "none",
              ["--fault-action", "none"]),
}  # fmt: skip
REFERENCE = "fault_free"
ENGINE_GIB = 12.0  # E2B shape: 7.8 GiB of weights + 2 GiB of KV + activations each
# (11.4 GiB measured on an H100, 2026-12-05: 7 such engines did not fit its 79 GiB)
ENGINES_PER_H200 = 10  # when the GPU's memory cannot be read
THROUGHPUT_TARGET = 0.9
RECOVERY_TARGET_S = 5.0  # issue 25: the victim healthy again -> first good PD request
VARIANTS = {
    "1p1d": [],
    "1p2d": ["--num-decode", "2"],
    "2p1d": ["--num-prefill", "2"],
    "router": ["--router", "vllm-router"],
    "router-1p2d": ["--router", "vllm-router", "--num-decode", "2"],
    "noverify": ["--extra-config", '{"verify_kv": false}'],
}  # fmt: skip
#: Every case: one GPU, engines started at once (fixed KV size), eager, a short load;
#: 64 sequences at most (vLLM's default 1,024 makes its sampler warm-up take ~17 GiB per
#: engine, and 9 engines on one H200 ran out of memory at start on 2026-12-03).
COMMON = ["--mode", "faults", "--enforce-eager", "--kv-cache-gib", "2", "--gpu-mem", "0.1",
          "--serve-args", "--max-num-seqs 64",
          "--prefill-gpu", "0", "--decode-gpu", "0", "--load-seconds", "20", "--fault-rate", "4",
          "--kill-after", "8", "--restart-after", "2", "--ready-timeout", "300",
          "--rejoin-timeout", "150", "--bench-timeout", "120", "--grace", "10",
          # which UCX protocol each READ took (case b's decode got tcp on 2026-12-03, and
          # after its restart read other bytes than prefill's pattern: cause not found)
          "--engine-env", "UCX_LOG_LEVEL=info", "UCX_PROTO_INFO=y"]  # fmt: skip
BASE_PORT, PORT_STEP = 18000, 100
SIDE_PORT, SIDE_STEP = 22000, 200  # above the engines' ports of 40 cases, below 32768


def pick(names: list[str] | None, variants: list[str] | None = None) -> list[Case]:
    """Cases by letter or name (None: all), each in every variant (None: ``1p1d``); a
    case a variant cannot run (the proxy's failpoint behind vllm-router) is left out."""
    by_name = {c.name: c for c in CASES.values()}
    base = []
    for n in names or list(CASES):
        case = CASES.get(n) or by_name.get(n)
        if case is None:
            raise SystemExit(f"--cases {n!r}: one of {sorted(CASES)} or {sorted(by_name)}")
        base.append(case)
    out = []
    for v in variants or ["1p1d"]:
        if v not in VARIANTS:
            raise SystemExit(f"--variants {v!r}: one of {sorted(VARIANTS)}")
        for case in base:
            if "vllm-router" in VARIANTS[v] and "drop" in case.argv:
                print(f"[matrix] {case.name}@{v}: left out (the proxy drops the decode leg; "
                      "vllm-router has no failpoint)", flush=True)  # fmt: skip
                continue
            name = case.name if v == "1p1d" else f"{case.name}@{v}"
            out.append(Case(name, case.victim, case.how, [*case.argv, *VARIANTS[v]], v))
    return out


def case_argv(case: Case, index: int, model_dir: str, out: Path, extra: list[str]) -> list[str]:
    """One case's bench_serving command: its own ports and OUT subfolder."""
    return [sys.executable, "-m", "lab.benchmarks.gpu.bench_serving", "--model-dir", model_dir,
            "--out", str(out / case.name), *COMMON,
            "--base-port", str(BASE_PORT + PORT_STEP * index),
            "--side-channel-port", str(SIDE_PORT + SIDE_STEP * index),
            *case.argv, *extra]  # fmt: skip


def run_cases(cases: list[Case], argvs: list[list[str]], out: Path,
              time_limit: float) -> dict[str, int | None]:  # fmt: skip
    """Every case at once; past ``time_limit`` s each is SIGTERMed (it stops its engines),
    then SIGKILLed 45 s later. Exit codes by case (None: killed)."""
    procs = {}
    for case, argv in zip(cases, argvs, strict=True):
        log = open(out / f"{case.name}.log", "wb")  # noqa: SIM115 (closed below)
        procs[case.name] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, cwd=ROOT,
                                             start_new_session=True), log)  # fmt: skip
        print(f"[matrix] {case.name}: pid {procs[case.name][0].pid}", flush=True)
    deadline = time.monotonic() + time_limit
    try:
        while any(p.poll() is None for p, _ in procs.values()):
            if time.monotonic() > deadline:
                print(f"[matrix] time limit {time_limit:.0f}s: stopping every case", flush=True)
                break
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("[matrix] interrupted: stopping every case", flush=True)
    finally:
        _stop([p for p, _ in procs.values()])
    codes: dict[str, int | None] = {}
    for name, (p, log) in procs.items():
        log.close()
        codes[name] = p.returncode
        print(f"[matrix] {name}: exit {p.returncode}", flush=True)
    return codes


def engines_at_once() -> int:
    """How many case engines the GPU holds at once: its memory over ``ENGINE_GIB`` (an H100
    6, an H200 11), from nvidia-smi; ``ENGINES_PER_H200`` where that cannot be read."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,"
                               "nounits", "-i", "0"], capture_output=True, text=True,
                              timeout=30, check=True).stdout  # fmt: skip
        return max(1, int(float(text.split()[0]) / 1024 / ENGINE_GIB))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return ENGINES_PER_H200


def waves(cases: list[Case], capacity: int) -> list[list[int]]:
    """Indices of ``cases`` in waves of at most ``capacity`` engines, in the given order (a
    case larger than the GPU still runs, alone)."""
    out: list[list[int]] = []
    used = capacity
    for i, case in enumerate(cases):
        need = engines(case)
        if used + need > capacity:
            out.append([])
            used = 0
        out[-1].append(i)
        used += need
    return out


def run_waves(cases: list[Case], argvs: list[list[str]], out: Path, time_limit: float,
              capacity: int) -> tuple[dict[str, int | None], dict[str, str]]:  # fmt: skip
    """The cases wave after wave (``waves``) within ``time_limit`` s in all: a wave starts
    only while the time left is at least the longest wave's so far. Exit codes by case, and
    a note for each case that did not run."""
    t0 = time.monotonic()
    codes: dict[str, int | None] = {}
    skipped: dict[str, str] = {}
    longest = 0.0
    for wave in waves(cases, capacity):
        left = time_limit - (time.monotonic() - t0)
        if left < max(longest, 30.0):
            for i in wave:
                skipped[cases[i].name] = f"not run: {left:.0f} s of the time limit left"
            continue
        start = time.monotonic()
        if len(wave) < len(cases):
            print(f"[matrix] wave of {[cases[i].name for i in wave]}", flush=True)
        codes.update(run_cases([cases[i] for i in wave], [argvs[i] for i in wave], out, left))
        longest = max(longest, time.monotonic() - start)
    return codes, skipped


def _stop(procs: list[subprocess.Popen[bytes]], grace: float = 45.0) -> None:
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace
    while any(p.poll() is None for p in live) and time.monotonic() < end:
        time.sleep(0.5)
    for p in live:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)


def options(case: Case) -> argparse.Namespace:
    """The case's options as its bench_serving run reads them (defaults included)."""
    return build_parser().parse_known_args([*COMMON, *case.argv])[0]


def load_of(case: Case) -> tuple[Any, ...]:
    """What the engines are asked to do in a case: rate, length of the load, KV per engine,
    prompt and output length. Throughputs compare only between equal loads."""
    o = options(case)
    return (o.fault_rate, o.load_seconds, o.kv_cache_gib, tuple(o.input_len or ()), o.output_len)


def _load_text(case: Case) -> str:
    o = options(case)
    kv = "vLLM's share" if o.kv_cache_gib is None else f"{o.kv_cache_gib:g} GiB"
    return f"{o.fault_rate:g} req/s, {kv} of KV per engine"


def throughput_judged(case: Case) -> bool:
    """Whether the >= 90 % throughput target applies to this case (see the docstring): a
    killed victim with a second engine of its role, or a flood."""
    o = options(case)
    if o.fault_action == "flood":
        return True
    spare = o.num_prefill if case.victim == "prefill" else o.num_decode
    return o.fault_action == "kill" and spare > 1


def engines(case: Case) -> int:
    """vLLM engines the case starts (a router or proxy aside)."""
    o = options(case)
    return o.num_prefill + o.num_decode


def add_throughput(cases: list[Case], rows: list[dict[str, Any]]) -> None:
    """Each row's output throughput as a fraction of the fault-free run of its variant
    under the same load (small pools at twice the rate get none: on 2026-12-04 the table
    showed them at 81 % of a run asked for half as much), and (where judged) whether it
    meets the target."""
    reference = {c.variant: (load_of(c), r.get("output_throughput"))
                 for c, r in zip(cases, rows, strict=True)
                 if c.name.split("@")[0] == REFERENCE}  # fmt: skip
    for case, r in zip(cases, rows, strict=True):
        load, ref = reference.get(case.variant, (None, None))
        got = r.get("output_throughput")
        ratio = round(got / ref, 3) if ref and got is not None and load == load_of(case) else None
        if ref and got is not None and ratio is None:
            r["throughput_load"] = _load_text(case)
        r["throughput_vs_fault_free"] = ratio
        r["throughput_ok"] = (
            None if not throughput_judged(case) or ratio is None else ratio >= THROUGHPUT_TARGET
        )


def _leaked(usage: dict[str, float | None]) -> str:
    return ", ".join(f"{k} {'?' if u is None else f'{100 * u:.1f}%'}" for k, u in usage.items())


def row(case: Case, summary: dict[str, Any] | None, code: int | None) -> dict[str, Any]:
    """One case's table row from its OUT/<case>/faults.json (None: none written)."""
    if not summary or "verdicts" not in summary:
        why = (summary or {}).get("error") or f"no result (exit {code}, see {case.name}.log)"
        return {"case": case.name, "victim": case.victim, "how": case.how, "note": why,
                **{v: None for v in VERDICTS}}  # fmt: skip
    m, v, f = summary["measured"], summary["verdicts"], summary["fault"]
    return {"case": case.name, "victim": f["victim"], "how": f.get("how") or case.how,
            **{k: v.get(k) for k in VERDICTS},
            "completed_failed_local": f"{m['completed']}/{m['failed']}/{m['local_loads']}",
            "first_good_s": m.get("fault_to_first_good_s"),
            "recovery_s": m.get("healthy_to_first_good_s"),
            "recovery_ok": (None if m.get("healthy_to_first_good_s") is None
                            else m["healthy_to_first_good_s"] <= RECOVERY_TARGET_S),
            "leaked": _leaked(m.get("usage_after_drain") or {}),
            "verified_loads": v["no_wrong_kv"].get("verified_loads"),
            "output_throughput": m.get("output_throughput"),
            "errors": m.get("errors", [])[:3],
            "preemptions": m.get("preemptions") or {},
            "served_alone": m.get("served_alone") or {},
            "note": "" if f.get("fired", True) else "failpoint did not fire"}  # fmt: skip


def _note(r: dict[str, Any]) -> str:
    """The row's note, the engines' preemptions where there were any (small pools: whether
    decode had to preempt requests it loaded), and the requests our proxy had one side
    serve alone while the other was down."""
    pre = {k: int(v) for k, v in (r.get("preemptions") or {}).items() if v}
    parts = [r.get("note") or ""] + (
        ["preemptions: " + ", ".join(f"{k} {v}" for k, v in sorted(pre.items()))] if pre else []
    )
    parts += [f"{n} served by {side} alone (no {'prefill' if side == 'decode' else 'decode'} up)"
              for side, n in sorted((r.get("served_alone") or {}).items()) if n]
    return "; ".join(p for p in parts if p)


def _throughput(r: dict[str, Any]) -> str:
    tput, ratio = r.get("output_throughput"), r.get("throughput_vs_fault_free")
    ok = r.get("throughput_ok")
    if tput is None:
        return "—"
    text = f"{tput:.0f}" + (f" ({100 * ratio:.0f} %)" if ratio is not None else "")
    if r.get("throughput_load"):
        text += f" (another load: {r['throughput_load']})"
    return text + ("" if ok is None else " PASS" if ok else " FAIL")


def _recovery(r: dict[str, Any]) -> str:
    """Seconds from the victim healthy again to the first good request through the front;
    "before" where one came earlier (another engine of the victim's role took the legs)."""
    s = r.get("recovery_s")
    if s is None:
        return "—"
    verdict = " PASS" if r.get("recovery_ok") else " FAIL"
    return ("before" if s < 0 else f"{s:.2f}") + verdict


def table(rows: list[dict[str, Any]]) -> str:
    """The matrix as markdown: one row per case."""
    head = ["case", "victim", "how", *VERDICTS, "completed/failed/local",
            "first good request (s after fault)",
            f"victim healthy -> first good request (s, target <= {RECOVERY_TARGET_S:g})",
            "leaked (KV usage after drain)",
            "verified loads", "output tok/s (vs fault-free)", "note"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["case"], r["victim"], r["how"], *(verdict_text(r[k]) for k in VERDICTS),
                 r.get("completed_failed_local", "—"), r.get("first_good_s") or "—",
                 _recovery(r),
                 r.get("leaked") or "—", r.get("verified_loads", "—"), _throughput(r),
                 _note(r)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def write_table(out: Path, cases: list[Case], codes: dict[str, int | None],
                skipped: dict[str, str] | None = None) -> list[dict]:  # fmt: skip
    rows, skipped = [], skipped or {}
    for case in cases:
        path = out / case.name / "faults.json"
        summary = json.loads(path.read_text()) if path.exists() else None
        if case.name in skipped:
            summary = {"error": skipped[case.name]}
        rows.append(row(case, summary, codes.get(case.name)))
    add_throughput(cases, rows)
    errors = [f"- {r['case']}: {r['errors']}" for r in rows if r.get("errors")]
    text = "# Fault matrix\n\n" + table(rows)
    if errors:
        text += "\nDistinct errors of failed requests (first 3):\n\n" + "\n".join(errors) + "\n"
    (out / "fault_matrix.md").write_text(text)
    (out / "fault_matrix.json").write_text(json.dumps(rows, indent=1, default=str))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))  # fmt: skip
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--cases", nargs="+", help=f"letters or names, of {sorted(CASES)}")
    p.add_argument("--variants", nargs="+", help=f"deployments, of {sorted(VARIANTS)}")
    p.add_argument("--time-limit", type=float, default=520.0,
                   help="s for the whole matrix; then every case is stopped")
    p.add_argument("--engines-at-once", type=int, default=None,
                   help="engines the GPU holds at once (default: its memory over "
                        f"{ENGINE_GIB:g} GiB); cases beyond run in later waves")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    args, extra = p.parse_known_args(argv)
    out = Path(args.out).resolve()
    cases = pick(args.cases, args.variants)
    argvs = [case_argv(c, i, args.model_dir, out, extra) for i, c in enumerate(cases)]
    total = sum(engines(c) for c in cases)
    capacity = args.engines_at_once or engines_at_once()
    print(f"[matrix] {len(cases)} cases, {total} engines, at most {capacity} at once (each "
          f"~{ENGINE_GIB:g} GiB with 2 GiB of KV): {len(waves(cases, capacity))} wave(s)",
          flush=True)  # fmt: skip
    if args.dry_run:
        print("\n".join(" ".join(a) for a in argvs))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    codes, skipped = run_waves(cases, argvs, out, args.time_limit, capacity)
    rows = write_table(out, cases, codes, skipped)
    print((out / "fault_matrix.md").read_text())
    print(f"[matrix] done in {time.monotonic() - t0:.0f}s; {out}", flush=True)
    ok = all(all(r.get(k) and r[k]["ok"] is not False for k in VERDICTS) and not r["note"]
             and r.get("throughput_ok") is not False and r.get("recovery_ok") is not False
             for r in rows)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
