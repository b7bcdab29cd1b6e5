"""bench_serving.py on CPU: each deployment's command line, the report from raw files shaped
like vLLM 0.26's ``vllm bench serve --save-result`` JSON and our read_log, and one whole run
of fake servers + the real proxy with a stand-in bench client (the real ``vllm bench serve``
takes 40-110 s to import and start on a CPU host, too slow here)."""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvshare_connector.vllm import compat
from lab.benchmarks.gpu import bench_serving as bs
from lab.benchmarks.gpu import serving_report as sr

# What kvcached's engines get for the model runner: V1 where vLLM still has it (not 0.34).
V1_RUNNER_ENV = "0" if compat.HAS_V1_MODEL_RUNNER else None

ROOT = Path(__file__).resolve().parent.parent

FAKE = ROOT / "tests" / "support" / "fake_vllm_server.py"
FAKE_CMD = (
    f"{{python}} {shlex.quote(str(FAKE))} {{model}} --role {{role}} --host {{host}} --port {{port}}"
)
PACKAGED = ROOT / "kvshare_connector" / "demo" / "models" / "g4tiny.json"


@pytest.fixture(autouse=True)
def _no_side_channel_host(monkeypatch):
    """Plans read VLLM_NIXL_SIDE_CHANNEL_HOST; in-process engine tests set it (vLLM reads it
    from the environment): each test here starts without it, whatever ran before."""
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST", raising=False)


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    shutil.copyfile(PACKAGED, d / "config.json")
    return d


def _plan(tmp_path: Path, model_dir: Path, *extra: str) -> tuple[Any, list[bs.Planned]]:
    tok = tmp_path / "tok"
    tok.mkdir(exist_ok=True)
    args = bs.build_parser().parse_args(
        ["--out", str(tmp_path / "out"), "--model-dir", str(model_dir), "--tokenizer", str(tok),
         *extra]
    )  # fmt: skip
    bs.apply_mode_defaults(args)
    return args, bs.plan(args, model_dir, tok, tmp_path / "raw")


def test_commands_of_each_deployment(tmp_path: Path, model_dir: Path) -> None:
    _, planned = _plan(
        tmp_path, model_dir, "--kvcached", "per_layer", "--extra-config",
        '{"kv_lease_duration": 60}', "--ours-variants", "packed={}", 'direct={"staging_mib": 0}',
        "--input-len", "1024", "2048",
    )  # fmt: skip
    assert [(p.name, p.kind) for p in planned] == [
        ("ours-packed", "ours"), ("ours-direct", "ours"), ("nixl", "nixl"),
        ("colocated", "colocated"),
    ]  # fmt: skip
    engines = {(p.name, e.role): e for p in planned for e in p.deployment.engines}
    kv = {k: json.loads(_arg(e.argv, "--kv-transfer-config")) for k, e in engines.items()
          if k[1] != "colocated"}  # fmt: skip
    ours = {"kv_connector": "KVShareConnector", "kv_connector_module_path": "kvshare_connector"}
    assert kv[("ours-packed", "prefill")] == {
        **ours, "kv_role": "kv_producer", "kv_connector_extra_config": {"kv_lease_duration": 60}
    }  # fmt: skip
    read_log = str(tmp_path / "raw" / "reads" / "ours-direct-decode0.jsonl")
    # decode admits its own prefill's side channel, host:port
    side = engines[("ours-direct", "prefill")].env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert kv[("ours-direct", "decode")] == {
        **ours,
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"kv_lease_duration": 60, "staging_mib": 0,
                                      "allowed_prefills": [f"localhost:{side}"],
                                      "read_log": read_log},
    }  # fmt: skip
    assert planned[1].read_logs == ["reads/ours-direct-decode0.jsonl"]
    assert kv[("nixl", "prefill")] == {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    assert kv[("nixl", "decode")] == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    # Lane against lane: NixlConnector's engines get the UCX settings ours picks itself.
    nixl_env = engines[("nixl", "decode")].env
    assert nixl_env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in engines[("ours-packed", "decode")].env
    colo = engines[("colocated", "colocated")]
    assert "--kv-transfer-config" not in colo.argv and planned[3].read_logs == []
    # Ports and side channels never collide; prefill on GPU 0, decode on 1, colocated on 0.
    ports = [e.port for e in engines.values()] + [p.deployment.cfg.port for p in planned]
    assert len(set(ports)) == len(ports) - 1  # colocated serves on its endpoint port
    side = [e.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for e in engines.values() if e.role != "colocated"]
    assert len(set(side)) == len(side) == 6
    gpus = {k: e.env["CUDA_VISIBLE_DEVICES"] for k, e in engines.items()}
    assert gpus[("nixl", "prefill")] == "0" and gpus[("nixl", "decode")] == "1"
    assert gpus[("colocated", "colocated")] == "0"
    # kvcached only for ours, V1 runner (where vLLM has one), one IPC segment per engine.
    for (name, _), e in engines.items():
        if name.startswith("ours"):
            assert e.env["ENABLE_KVCACHED"] == "true"
            assert e.env["KVCACHED_CONTIGUOUS_LAYOUT"] == "false"
            assert e.env.get("VLLM_USE_V2_MODEL_RUNNER") == V1_RUNNER_ENV
        else:
            assert e.env["ENABLE_KVCACHED"] == "false" and "KVCACHED_IPC_NAME" not in e.env
    ipc = [e.env["KVCACHED_IPC_NAME"] for (n, _), e in engines.items() if n.startswith("ours")]
    assert len(set(ipc)) == 4
    # Every engine: Gemma-4 overrides, Triton, prefix caching as vllm serve has it (on), the
    # share, the length.
    for e in engines.values():
        assert e.argv[:4] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
        assert json.loads(_arg(e.argv, "--hf-overrides")) == {"global_head_dim": 128}
        assert _arg(e.argv, "--attention-backend") == "TRITON_ATTN"
        assert "--no-enable-prefix-caching" not in e.argv
        assert _arg(e.argv, "--gpu-memory-utilization") == "0.3"
        assert _arg(e.argv, "--max-model-len") == "3072"  # 2048 + 64 + 128, rounded up
        assert _arg(e.argv, "--tokenizer") == str(tmp_path / "tok")
        assert _arg(e.argv, "--served-model-name") == "kvshare-bench"
    with pytest.raises(SystemExit, match="0.95"):  # four engines of 0.3 on GPU 0
        bs.check_memory(planned, one_at_a_time=False)
    bs.check_memory(planned, one_at_a_time=True)


def test_extra_configs_merge_in_order(tmp_path: Path, model_dir: Path) -> None:
    """A case's --extra-config and a variant's (the fault matrix gives both) merge."""
    _, planned = _plan(tmp_path, model_dir, "--deployments", "ours", "--extra-config",
                       '{"kv_lease_duration": 60, "staging_mib": 8}', "--extra-config",
                       '{"verify_kv": false, "kv_lease_duration": 15}')  # fmt: skip
    prefill = next(e for e in planned[0].deployment.engines if e.role == "prefill")
    extra = json.loads(_arg(prefill.argv, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert extra == {"kv_lease_duration": 15, "staging_mib": 8, "verify_kv": False}
    with pytest.raises(SystemExit, match="not a JSON object"):
        _plan(tmp_path, model_dir, "--extra-config", "[1]")


def test_first_token_from_decode_per_deployment(tmp_path: Path, model_dir: Path) -> None:
    """Our proxy streams prefill's first token unless a deployment (name or kind) is told to
    have decode sample it again: the before/after of the hand-off in one run."""
    from kvshare_connector.toolkit.launcher import proxy_argv

    _, planned = _plan(
        tmp_path, model_dir, "--ours-variants", "ftp={}", "ftd={}", "--deployments", "ours",
        "nixl", "--first-token-from-decode", "ours-ftd", "nixl",
    )  # fmt: skip
    first = {p.name: _arg(proxy_argv(p.deployment.cfg, p.deployment.engines), "--first-token")
             for p in planned}  # fmt: skip
    assert first == {"ours-ftp": "prefill", "ours-ftd": "decode", "nixl": "decode"}
    with pytest.raises(SystemExit, match="no such deployment"):
        _plan(tmp_path, model_dir, "--first-token-from-decode", "ours-ftx")


def test_kvcached_per_deployment_and_fixed_kv_size(tmp_path: Path, model_dir: Path) -> None:
    """One run can hold plain and kvcached variants of ours; a fixed KV size skips vLLM's
    memory profiling and starts every engine at once."""
    _, planned = _plan(
        tmp_path, model_dir, "--ours-variants", "plain={}", "kvc={}", "kvl={}",
        "--kvcached", "contiguous", "--kvcached-on", "ours-kvc", "ours-kvl=per_layer",
        "--kv-cache-gib", "1.5", "--deployments", "ours", "--engine-env", "UCX_LOG_LEVEL=info",
    )  # fmt: skip
    env = {p.name: p.deployment.engines[0].env for p in planned}
    assert all(e["UCX_LOG_LEVEL"] == "info" for e in env.values())
    assert env["ours-plain"]["ENABLE_KVCACHED"] == "false"
    assert env["ours-kvc"]["KVCACHED_CONTIGUOUS_LAYOUT"] == "true"
    assert env["ours-kvl"]["KVCACHED_CONTIGUOUS_LAYOUT"] == "false"
    for p in planned:
        assert p.deployment.cfg.parallel_start is True
        for e in p.deployment.engines:
            assert _arg(e.argv, "--kv-cache-memory-bytes") == str(int(1.5 * 2**30))
    _, mixed = _plan(
        tmp_path, model_dir, "--ours-variants", "a={}", "b={}", "--kvcached", "contiguous",
        "--kvcached-on", "ours", "ours-b=per_layer", "--deployments", "ours",
    )  # fmt: skip
    layouts = [p.deployment.engines[0].env["KVCACHED_CONTIGUOUS_LAYOUT"] for p in mixed]
    assert layouts == ["true", "false"]  # the name wins over the kind, in any order
    with pytest.raises(SystemExit, match="mode must be one of"):
        _plan(tmp_path, model_dir, "--kvcached-on", "ours=fast")
    with pytest.raises(SystemExit, match="no such deployment"):  # a typo is not "no kvcached"
        _plan(tmp_path, model_dir, "--kvcached-on", "ours-kvx")
    _, default = _plan(tmp_path, model_dir)
    assert all(p.deployment.cfg.parallel_start is None for p in default)
    # One deployment's own env (an earlier connector beside this one): only its engines.
    _, before = _plan(
        tmp_path, model_dir, "--ours-variants", "now={}", "before={}", "--deployments", "ours",
        "nixl", "--variant-env", "ours-before:PYTHONPATH=/old:/site",
    )  # fmt: skip
    paths = {p.name: {e.env.get("PYTHONPATH") for e in p.deployment.engines} for p in before}
    assert paths == {"ours-now": {None}, "ours-before": {"/old:/site"}, "nixl": {None}}
    # fast_lane.sh kvreserve: one kvcached variant keeps more pages mapped than the other
    _, reserve = _plan(
        tmp_path, model_dir, "--ours-variants", "kvc={}", "kvr={}", "--deployments", "ours",
        "--kvcached", "contiguous", "--kvcached-on", "ours-kvc", "ours-kvr", "--variant-env",
        "ours-kvr:KVCACHED_MIN_RESERVED_PAGES=50", "ours-kvr:KVCACHED_MAX_RESERVED_PAGES=200",
    )  # fmt: skip
    env = {p.name: p.deployment.engines[0].env for p in reserve}
    assert env["ours-kvc"]["ENABLE_KVCACHED"] == env["ours-kvr"]["ENABLE_KVCACHED"] == "true"
    assert "KVCACHED_MAX_RESERVED_PAGES" not in env["ours-kvc"]
    assert env["ours-kvr"]["KVCACHED_MIN_RESERVED_PAGES"] == "50"
    assert env["ours-kvr"]["KVCACHED_MAX_RESERVED_PAGES"] == "200"
    with pytest.raises(SystemExit, match="no such deployment"):
        _plan(tmp_path, model_dir, "--variant-env", "ours-bfore:A=1")
    with pytest.raises(SystemExit, match="NAME:KEY=VALUE"):
        _plan(tmp_path, model_dir, "--variant-env", "PYTHONPATH=/old")
    assert all("--kv-cache-memory-bytes" not in e.argv
               for p in default for e in p.deployment.engines)  # fmt: skip


def test_kvcached_modes_and_variants() -> None:
    assert bs.kvcached_env("none") == {"ENABLE_KVCACHED": "false"}
    assert bs.kvcached_env("contiguous")["KVCACHED_CONTIGUOUS_LAYOUT"] == "true"
    assert bs.parse_variants(None, {"a": 1}) == {"ours": {"a": 1}}
    assert bs.parse_variants(['x={"a": 2}'], {"a": 1, "b": 0}) == {"ours-x": {"a": 2, "b": 0}}
    with pytest.raises(ValueError):
        bs.parse_variants(["no-equals"], {})


def test_bench_command_and_seeds(tmp_path: Path, model_dir: Path) -> None:
    args, planned = _plan(tmp_path, model_dir, "--concurrency", "4", "16", "--rounds", "2")
    runner = bs.Runner(args, planned, tmp_path / "tok", tmp_path / "raw", None, 4096)
    runs = {p.name: runner.runs_for(p, 1) for p in planned}
    args.num_prompts, args.min_prompts, args.prompts_per_slot = 0, 6, 2  # per point
    assert [r["num_prompts"] for r in runner.runs_for(planned[0], 0)] == [8, 32]
    args.num_prompts = 64
    # The same prompts for every deployment at a point of a round, new ones per point/round.
    assert [r["seed"] for r in runs["ours"]] == [r["seed"] for r in runs["colocated"]]
    assert len({r["seed"] for r in runs["ours"] + runner.runs_for(planned[0], 0)}) == 4
    argv = bs.bench_options(
        args, planned[0].endpoint, "ours", tmp_path / "tok", runs["ours"][1], tmp_path / "raw"
    )
    assert _arg(argv, "--base-url") == planned[0].endpoint
    assert _arg(argv, "--dataset-name") == "random"
    assert _arg(argv, "--random-input-len") == "2048"
    assert _arg(argv, "--random-output-len") == "64"
    assert _arg(argv, "--max-concurrency") == "16"
    assert _arg(argv, "--num-prompts") == "64"
    assert _arg(argv, "--request-rate") == "inf"
    assert _arg(argv, "--result-dir") == str(tmp_path / "raw" / "bench")
    assert _arg(argv, "--result-filename") == "ours_r1_in2048_c16.json"
    assert "--save-result" in argv and "--ignore-eos" in argv
    assert _arg(argv, "--ready-check-timeout-sec") == "0"  # the checked warmup did that
    assert "--save-detailed" not in argv and "--extra-body" not in argv
    # Random-init weights sample ids the local tokenizer has no text for: keep them below it.
    args.sample_ids_below = 4096
    argv = bs.bench_options(
        args, planned[0].endpoint, "ours", tmp_path / "tok", runs["ours"][1], tmp_path / "raw"
    )
    allowed = json.loads(_arg(argv, "--extra-body"))["allowed_token_ids"]
    assert allowed == list(range(6, 4096))  # past <pad> <eos> <bos> <unk> and the turn marks
    assert "--random-prefix-len" not in argv


def test_prefix_caching_on_unless_asked_and_shared_prefixes(tmp_path: Path, model_dir: Path):
    """Issue 50: engines keep vLLM's prefix caching (on, as vllm serve has it) unless
    --no-prefix-caching; --random-prefix-len gives a run's prompts a common prefix (vllm
    bench serve's option) and the engines room for it."""
    args, planned = _plan(tmp_path, model_dir, "--random-prefix-len", "1536")
    engines = [e for p in planned for e in p.deployment.engines]
    assert engines and all("--no-enable-prefix-caching" not in e.argv for e in engines)
    assert {_arg(e.argv, "--max-model-len") for e in engines} == {"4096"}  # 1536 + 2048 + ...
    runner = bs.Runner(args, planned, tmp_path / "tok", tmp_path / "raw", None, 4096)
    run = runner.runs_for(planned[0], 0)[0]
    argv = bs.bench_options(args, planned[0].endpoint, "x", tmp_path / "tok", run, tmp_path)
    assert _arg(argv, "--random-prefix-len") == "1536"
    assert _arg(argv, "--random-input-len") == "2048"
    _, planned = _plan(tmp_path, model_dir, "--no-prefix-caching")
    engines = [e for p in planned for e in p.deployment.engines]
    assert all("--no-enable-prefix-caching" in e.argv for e in engines)


def test_mode_defaults_and_router_plan(tmp_path: Path, model_dir: Path) -> None:
    args, planned = _plan(
        tmp_path, model_dir, "--mode", "scaling", "--deployments", "ours", "nixl",
        "--router", "vllm-router", "--num-decode", "2", "--decode-gpu-mem", "0.2",
    )  # fmt: skip
    assert args.input_len == [1024, 4096, 16384, 32768] and args.concurrency == [1, 16, 64]
    assert (args.output_len, args.time_budget) == (32, 520.0)
    ours, nixl = planned
    assert ours.router == nixl.router == "vllm-router"
    assert ours.deployment.cfg.router == "vllm-router"
    assert [e.name for e in ours.deployment.engines] == ["prefill0", "decode0", "decode1"]
    gpus = [e.env["CUDA_VISIBLE_DEVICES"] for e in ours.deployment.engines]
    shares = [_arg(e.argv, "--gpu-memory-utilization") for e in ours.deployment.engines]
    assert gpus == ["0", "1", "1"] and shares == ["0.3", "0.2", "0.2"]
    assert ours.read_logs == ["reads/ours-decode0.jsonl", "reads/ours-decode1.jsonl"]
    logs = [json.loads(_arg(e.argv, "--kv-transfer-config")).get("kv_connector_extra_config")
            for e in ours.deployment.engines]  # fmt: skip
    assert logs[0] is None and logs[2]["read_log"].endswith("reads/ours-decode1.jsonl")
    # 32k prompts fit: 32768 + 32 out + 128, rounded up to 1024.
    assert _arg(ours.deployment.engines[0].argv, "--max-model-len") == "33792"
    ports = [e.port for p in planned for e in p.deployment.engines]
    ports += [p.deployment.cfg.port for p in planned]
    ports += [p.deployment.cfg.router_metrics_port for p in planned]
    assert len(set(ports)) == len(ports)
    bs.check_memory(planned, one_at_a_time=False)  # GPU 0: 0.6, GPU 1: 0.8
    args, planned = _plan(tmp_path, model_dir, "--mode", "faults")
    assert [p.name for p in planned] == ["ours"] and args.output_len == 32


# ---- the report ---------------------------------------------------------------------------


FAKE_BENCH = """
import argparse, json, sys, time, httpx
p = argparse.ArgumentParser()
for flag in ("--base-url", "--model", "--result-dir", "--result-filename", "--num-prompts",
             "--max-concurrency", "--random-input-len"):
    p.add_argument(flag)
args, _ = p.parse_known_args()
t0 = time.perf_counter()
r = httpx.post(args.base_url + "/v1/completions", timeout=30, json={
    "model": args.model, "prompt": "What is 3 + 4?", "max_tokens": 4})
r.raise_for_status()
dt = time.perf_counter() - t0
out = {"completed": 1, "failed": 0, "request_throughput": 1 / dt, "output_throughput": 4 / dt,
       "mean_ttft_ms": dt * 1e3, "median_ttft_ms": dt * 1e3, "p99_ttft_ms": dt * 1e3,
       "median_itl_ms": 1.0, "p99_itl_ms": 2.0, "text": r.json()["choices"][0]["text"]}
with open(args.result_dir + "/" + args.result_filename, "w") as f:
    json.dump(out, f)
"""


@pytest.mark.slow
def test_whole_run_with_fake_servers(tmp_path: Path, model_dir: Path) -> None:
    from kvshare_connector.toolkit.procs import free_port_run, pick_free_port

    script = tmp_path / "fake_bench.py"
    script.write_text(FAKE_BENCH)
    out = tmp_path / "out"
    tok = tmp_path / "tok"
    tok.mkdir()
    base = free_port_run(3 * bs.PORT_STRIDE)  # ours, nixl, colocated number ports up from it
    rc = bs.main(
        ["--out", str(out), "--model-dir", str(model_dir), "--tokenizer", str(tok),
         "--input-len", "16", "--output-len", "4", "--num-prompts", "1", "--concurrency", "1",
         "--rounds", "2", "--warmup-requests", "2", "--warmup-tokens", "4",
         "--server-cmd", FAKE_CMD,
         "--bench-cmd", f"{{python}} {script}", "--base-port", str(base),
         "--side-channel-port", str(pick_free_port()), "--ready-timeout", "60", "--grace", "5"]
    )  # fmt: skip
    assert rc == 0
    assert sorted(p.name for p in out.iterdir()) == ["raw.tar.gz", "results.json", "summary.md"]
    with tarfile.open(out / sr.TARBALL) as tar:
        names = tar.getnames()
        manifest = [json.loads(x) for x in tar.extractfile("raw/runs.jsonl").read().splitlines()]
    assert "raw/logs/ours/proxy.log" in names and "raw/runs.jsonl" in names
    # Before round 0, one untimed wave per deployment and point (the report leaves it out).
    warm = [r for r in manifest if r.get("warmup")]
    assert sorted(r["deployment"] for r in warm) == ["colocated", "nixl", "ours"]
    assert all(r["round"] == -1 and r["rc"] == 0 and f"raw/{r['file']}" in names for r in warm)
    assert max(r["end"] for r in warm) <= min(r["start"] for r in manifest if not r.get("warmup"))
    results = json.loads((out / "results.json").read_text())
    assert {r["deployment"] for r in results["runs"]} == {"ours", "nixl", "colocated"}
    assert all(r["ok"] for r in results["runs"]) and len(results["runs"]) == 6
    # Round 1 ran in rotated order.
    by_round = [[r["deployment"] for r in results["runs"] if r["round"] == k] for k in (0, 1)]
    assert by_round == [["ours", "nixl", "colocated"], ["nixl", "colocated", "ours"]]
    # The checked warmup: every answer right, PD texts equal to colocated's.
    assert {n: (c["ok"], c["requests"]) for n, c in results["checks"].items()} == {
        "ours": (2, 2), "nixl": (2, 2), "colocated": (2, 2)}  # fmt: skip
    assert results["checks"]["ours"]["agreement"] == 1.0
    # Each engine's served requests after the warmup, from its /metrics: one per round.
    assert results["engines"]["ours"] == {"prefill0": 2.0, "decode0": 2.0}
    # Everything stopped: no endpoint answers any more.
    for i in range(3):
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{base + bs.PORT_STRIDE * i}/health", timeout=1)


def _procs_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(
                errors="ignore"
            ):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.mark.slow
def test_sigterm_stops_servers_and_bench(tmp_path: Path, model_dir: Path) -> None:
    from kvshare_connector.toolkit.procs import free_port_run, pick_free_port

    out = tmp_path / "out"
    tok = tmp_path / "tok"
    tok.mkdir()
    base = free_port_run(bs.PORT_STRIDE)
    cmd = [
        sys.executable, "-m", "lab.benchmarks.gpu.bench_serving", "--out", str(out),
        "--model-dir", str(model_dir), "--tokenizer", str(tok), "--deployments", "ours",
        "--warmup-requests", "0", "--server-cmd", FAKE_CMD, "--base-port", str(base),
        "--bench-cmd", "{python} -c 'import time; time.sleep(300)'",
        "--side-channel-port", str(pick_free_port()), "--grace", "5",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not (out / "raw" / "logs" / "bench").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)
        time.sleep(1)
        # This runner, fake prefill and decode (model dir), the bench (tokenizer dir).
        assert len(_procs_mentioning(str(tmp_path))) >= 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _procs_mentioning(str(tmp_path)) == []
    assert (out / "raw.tar.gz").exists()
    with pytest.raises(httpx.HTTPError):  # the proxy
        httpx.get(f"http://127.0.0.1:{base}/health", timeout=1)
