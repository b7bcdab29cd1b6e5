"""The PD launcher: plans (pure) and real deployments of fake vLLM servers on 127.0.0.1."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import httpx
import pytest

from kvshare_connector.toolkit.launcher import (
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    LAYOUT_KEY,
    SIDE_CHANNEL_STRIDE,
    Deployment,
    ServeConfig,
    colocated_deployment,
    pd_deployment,
    plan_colocated,
    plan_pd,
)
from kvshare_connector.toolkit.procs import (
    LaunchError,
    ManagedProcess,
    free_port_run,
    pick_free_port,
    stop_processes,
)
from kvshare_connector.transfer.wire.side_channel import SECRET_ENV
from kvshare_connector.vllm import compat

# What kvcached's engines get for the model runner: V1 where vLLM still has it (not 0.34).
V1_RUNNER_ENV = "0" if compat.HAS_V1_MODEL_RUNNER else None

FAKE = Path(__file__).resolve().parent / "support" / "fake_vllm_server.py"
FAKE_CMD = (
    f"{{python}} {shlex.quote(str(FAKE))} {{model}} --role {{role}} --host {{host}} --port {{port}}"
)
ROOT = Path(__file__).resolve().parent.parent

@pytest.fixture(autouse=True)
def _no_side_channel_host(monkeypatch):
    """Plans read VLLM_NIXL_SIDE_CHANNEL_HOST; in-process engine tests set it (vLLM reads it
    from the environment): each test here starts without it, whatever ran before."""
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST", raising=False)



def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _ports() -> dict[str, int]:
    return {
        "port": pick_free_port(),
        "prefill_port": pick_free_port(),
        "decode_port": pick_free_port(),
        "side_channel_port": pick_free_port(),
    }


def _gone(pids: list[int], timeout: float = 5.0) -> bool:
    """True once none of the process groups led by ``pids`` exists any more."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.killpg(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


def test_plan_same_gpu_roles_ports_side_channels_and_memory_share() -> None:
    cfg = ServeConfig(
        model="google/gemma-4-E2B-it",
        prefill_port=9100,
        decode_port=9200,
        side_channel_port=6000,
        num_decode=2,
        block_size=16,
        max_model_len=2048,
        layout="cross_layer",
        env={"ENABLE_KVCACHED": "true", "KVCACHED_CONTIGUOUS_LAYOUT": "false"},
        vllm_args=["--enforce-eager"],
    )
    prefill, decode0, decode1 = plan_pd(cfg)
    assert [e.name for e in (prefill, decode0, decode1)] == ["prefill0", "decode0", "decode1"]
    assert [e.port for e in (prefill, decode0, decode1)] == [9100, 9200, 9201]
    # `vllm` beside the running Python (the virtualenv kvshare runs from), not PATH's.
    beside = Path(sys.executable).parent / "vllm"
    assert Path(prefill.argv[0]).name == "vllm"
    if beside.exists():
        assert prefill.argv[0] == str(beside)
    assert prefill.argv[1:3] == ["serve", "google/gemma-4-E2B-it"]
    assert _arg(prefill.argv, "--port") == "9100"
    kv = json.loads(_arg(prefill.argv, "--kv-transfer-config"))
    assert kv == {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {LAYOUT_KEY: True},
    }
    assert json.loads(_arg(decode1.argv, "--kv-transfer-config"))["kv_role"] == "kv_consumer"
    side = [e.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for e in (prefill, decode0, decode1)]
    assert side == ["6000", str(6000 + SIDE_CHANNEL_STRIDE), str(6000 + 2 * SIDE_CHANNEL_STRIDE)]
    # Three engines on GPU 0 split 0.85 of it.
    assert all(e.env["CUDA_VISIBLE_DEVICES"] == "0" for e in (prefill, decode0, decode1))
    assert _arg(prefill.argv, "--gpu-memory-utilization") == "0.28"
    assert _arg(prefill.argv, "--block-size") == "16"
    assert _arg(prefill.argv, "--max-model-len") == "2048"
    assert prefill.argv[-1] == "--enforce-eager"  # passthrough comes last
    # kvcached needs vLLM's V1 model runner (0.34 has none and refuses the variable); its
    # layout variable is passed through.
    assert prefill.env.get("VLLM_USE_V2_MODEL_RUNNER") == V1_RUNNER_ENV
    assert prefill.env["KVCACHED_CONTIGUOUS_LAYOUT"] == "false"


def test_plan_one_gpu_each_and_kv_both() -> None:
    cfg = ServeConfig(
        model="m",
        host="0.0.0.0",
        prefill_gpus=["0"],
        decode_gpus=["1"],
        kv_both=True,
        layout="per_layer",
        kv_extra_config={"kv_lease_duration": 60},
    )
    prefill, decode = plan_pd(cfg)
    assert _arg(prefill.argv, "--host") == "0.0.0.0"
    assert prefill.url == "http://127.0.0.1:8100"  # a wildcard bind is reached locally
    assert (prefill.env["CUDA_VISIBLE_DEVICES"], decode.env["CUDA_VISIBLE_DEVICES"]) == ("0", "1")
    assert _arg(prefill.argv, "--gpu-memory-utilization") == "0.84"
    for e in (prefill, decode):
        kv = json.loads(_arg(e.argv, "--kv-transfer-config"))
        assert kv["kv_role"] == "kv_both"
        assert kv["kv_connector_extra_config"] == {
            LAYOUT_KEY: False, "kv_lease_duration": 60,
            "allowed_prefills": ["localhost:5600", "localhost:5616"],  # kv_both: both serve
        }  # fmt: skip
    assert "VLLM_USE_V2_MODEL_RUNNER" not in prefill.env


def test_a_deployment_shares_a_fresh_secret_and_decode_reaches_only_its_prefills(
    monkeypatch,
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST", raising=False)
    prefill, decode = plan_pd(ServeConfig(model="m"))
    secret = prefill.env[SECRET_ENV]
    assert len(secret) == 64 and decode.env[SECRET_ENV] == secret
    assert secret not in " ".join(prefill.argv + decode.argv)  # not for `ps` to show
    other = plan_pd(ServeConfig(model="m"))[0].env[SECRET_ENV]
    assert other != secret  # one per deployment
    extra = json.loads(_arg(decode.argv, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert extra["allowed_prefills"] == ["localhost:5600"]  # host:port, never a host alone
    assert "allowed_prefills" not in json.loads(_arg(prefill.argv, "--kv-transfer-config")).get(
        "kv_connector_extra_config", {}
    )
    # The user's own secret (environment, --env or extra config) and host win.
    monkeypatch.setenv(SECRET_ENV, "mine")
    assert SECRET_ENV not in plan_pd(ServeConfig(model="m"))[0].env
    monkeypatch.delenv(SECRET_ENV)
    cfg = ServeConfig(model="m", env={SECRET_ENV: "env", "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.5"})
    prefill, decode = plan_pd(cfg)
    assert prefill.env[SECRET_ENV] == "env"
    kv = json.loads(_arg(decode.argv, "--kv-transfer-config"))
    assert kv["kv_connector_extra_config"]["allowed_prefills"] == ["10.0.0.5:5600"]
    cfg = ServeConfig(model="m", kv_extra_config={"side_channel_secret": "x"})
    assert SECRET_ENV not in plan_pd(cfg)[0].env
    assert SECRET_ENV not in plan_colocated(ServeConfig(model="m"))[0].env


def test_plan_colocated_has_no_connector() -> None:
    cfg = ServeConfig(model="m", port=8123, gpu_memory_utilization=0.3, layout="per_layer")
    (engine,) = plan_colocated(cfg)
    assert engine.role == "colocated" and engine.port == 8123
    assert "--kv-transfer-config" not in engine.argv
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in engine.env
    assert _arg(engine.argv, "--gpu-memory-utilization") == "0.3"


def test_server_cmd_template_and_bad_layout() -> None:
    cfg = ServeConfig(model="tiny", server_cmd="myserve {model} --port {port} --as {role}")
    prefill, _ = plan_pd(cfg)
    assert prefill.argv[:5] == ["myserve", "tiny", "--port", "8100", "--as"]
    with pytest.raises(ValueError, match="layout"):
        ServeConfig(model="m", layout="diagonal")


def test_pd_deployment_starts_serves_and_stops_cleanly(tmp_path: Path) -> None:
    cfg = ServeConfig(
        model="fake-model",
        server_cmd=FAKE_CMD,
        log_dir=tmp_path,
        env={"ENABLE_KVCACHED": "true", "FAKE_MARKER": "x1"},
        ready_timeout=20,
        grace=5,
        **_ports(),
    )
    deployment = pd_deployment(cfg)
    with deployment:
        names = [p.name for p in deployment.procs]
        assert names == ["prefill0", "decode0", "proxy"]
        health = httpx.get(deployment.endpoint + "/health", timeout=5)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        body = {"model": "fake-model", "prompt": "What is 2 + 5?", "max_tokens": 12}
        resp = httpx.post(deployment.endpoint + "/v1/completions", json=body, timeout=10)
        assert resp.status_code == 200, resp.text
        assert "#### 7" in resp.json()["choices"][0]["text"]
        launches = {
            e.role: httpx.get(e.url + "/debug/launch", timeout=5).json() for e in deployment.engines
        }
        pids = [p.pid for p in deployment.procs]
    assert launches["prefill"]["kv_transfer_config"]["kv_role"] == "kv_producer"
    assert launches["decode"]["kv_transfer_config"]["kv_role"] == "kv_consumer"
    assert launches["prefill"]["env"]["FAKE_MARKER"] == "x1"
    assert launches["decode"]["env"].get("VLLM_USE_V2_MODEL_RUNNER") == V1_RUNNER_ENV
    ports = {launches[r]["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] for r in ("prefill", "decode")}
    assert len(ports) == 2
    # Each server ran in its own process group, and every group is gone after stop().
    assert launches["prefill"]["pgid"] == launches["prefill"]["pid"]
    assert _gone(pids)
    assert (tmp_path / "prefill0.log").read_text().startswith("$ ")
    assert "PD proxy" in (tmp_path / "proxy.log").read_text()


def test_colocated_deployment(tmp_path: Path) -> None:
    cfg = ServeConfig(model="fake-model", server_cmd=FAKE_CMD, log_dir=tmp_path, **_ports())
    with colocated_deployment(cfg) as deployment:
        resp = httpx.post(
            deployment.endpoint + "/v1/completions",
            json={"prompt": "What is 2 + 5?", "max_tokens": 12},
            timeout=10,
        )
        launch = httpx.get(deployment.endpoint + "/debug/launch", timeout=5).json()
        pids = [p.pid for p in deployment.procs]
    assert resp.status_code == 200 and "#### 7" in resp.json()["choices"][0]["text"]
    assert launch["kv_transfer_config"] is None
    assert _gone(pids)


def test_server_exiting_during_startup_is_reported_with_its_log(tmp_path: Path) -> None:
    # A "colocated" fake refuses a kv-transfer-config and exits with code 2.
    bad = FAKE_CMD.replace("--role {role}", "--role colocated")
    cfg = ServeConfig(model="fake-model", server_cmd=bad, log_dir=tmp_path, **_ports())
    deployment = pd_deployment(cfg)
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="exited with code 2") as info:
        deployment.start()
    assert "cannot run with kv_role kv_producer" in str(info.value)
    assert time.monotonic() - t0 < 15
    assert _gone([p.pid for p in deployment.procs])


def test_readiness_is_bounded(tmp_path: Path) -> None:
    slow = FAKE_CMD + " --startup-delay 60"
    cfg = ServeConfig(
        model="fake-model",
        server_cmd=slow,
        log_dir=tmp_path,
        ready_timeout=1.5,
        grace=2,
        **_ports(),
    )
    deployment = pd_deployment(cfg)
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="not healthy after"):
        deployment.start()
    assert time.monotonic() - t0 < 10
    assert _gone([p.pid for p in deployment.procs])


def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    stubborn = ManagedProcess(
        "stubborn",
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('u' + 'p!', flush=True); time.sleep(60)",
        ],
        dict(os.environ),
        tmp_path / "stubborn.log",
    )
    stubborn.start()
    deadline = time.monotonic() + 10
    while "up!" not in stubborn.log_tail() and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    stop_processes([stubborn], grace=0.5)
    assert time.monotonic() - t0 < 5
    assert stubborn.proc is not None and stubborn.proc.returncode == -signal.SIGKILL
    assert _gone([stubborn.pid])


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _serve_pd_cli(
    tmp_path: Path, ready: Path, sigint_ignored: bool = False
) -> subprocess.Popen[bytes]:
    """``sigint_ignored``: start it as ``cmd &`` in a script would (SIGINT inherited ignored)."""
    ports = _ports()
    argv = [
        sys.executable,
        "-m",
        "kvshare_connector.toolkit.cli",
        "serve-pd",
        "fake-model",
        "--server-cmd",
        FAKE_CMD,
        "--port",
        str(ports["port"]),
        "--prefill-port",
        str(ports["prefill_port"]),
        "--decode-port",
        str(ports["decode_port"]),
        "--log-dir",
        str(tmp_path / "logs"),
        "--ready-file",
        str(ready),
        "--ready-timeout",
        "20",
        "--grace",
        "5",
        "--parallel-start",
        "--",
        "--enforce-eager",
    ]
    return subprocess.Popen(
        argv,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_ignore_sigint if sigint_ignored else None,
    )


def _log_tails(log_dir: str) -> str:
    logs = sorted(Path(log_dir).glob("*"))
    return "; ".join(f"{p.name}: {p.read_text(errors='replace')[-600:]!r}" for p in logs)


def _wait_ready(proc: subprocess.Popen[bytes], ready: Path) -> dict:
    deadline = time.monotonic() + 20
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"serve-pd not ready: {proc.communicate()[0].decode()}")
        time.sleep(0.1)
    return json.loads(ready.read_text())


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["foreground", "background"])
def test_cli_serve_pd_stops_everything_on_ctrl_c(tmp_path: Path, sigint_ignored: bool) -> None:
    """Also when started in the background (SIGINT inherited ignored): CI runs it so."""
    ready = tmp_path / "ready.json"
    proc = _serve_pd_cli(tmp_path, ready, sigint_ignored)
    try:
        info = _wait_ready(proc, ready)
        assert [p["name"] for p in info["processes"]] == ["prefill0", "decode0", "proxy"]
        resp = httpx.post(
            info["endpoint"] + "/v1/completions", json={"prompt": "3 + 4"}, timeout=10
        )
        assert resp.status_code == 200, resp.text
        decode_url = next(e["url"] for e in info["engines"] if e["role"] == "decode")
        launch = httpx.get(decode_url + "/debug/launch", timeout=5).json()
        assert launch["unknown_args"][-1] == "--enforce-eager"  # args after `--` reach vllm
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(
                "serve-pd did not stop on SIGINT within 15 s; "
                f"output: {(exc.output or b'').decode()}\nlogs: {_log_tails(info['log_dir'])}"
            ) from exc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out.decode()
    text = out.decode()
    assert "ready; OpenAI endpoint " + info["endpoint"] + "/v1" in text
    assert "kvshare: stopped" in text
    assert _gone([p["pid"] for p in info["processes"]])


def test_cli_serve_pd_exits_when_a_server_dies(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    proc = _serve_pd_cli(tmp_path, ready)
    try:
        info = _wait_ready(proc, ready)
        decode_pid = next(p["pid"] for p in info["processes"] if p["name"] == "decode0")
        os.killpg(decode_pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    assert "decode0 exited" in out.decode()
    assert _gone([p["pid"] for p in info["processes"]])


def test_cli_plugs_in_the_optional_demo_module(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvshare_connector.toolkit import cli

    demo = types.ModuleType("kvshare_connector.demo.run")

    def add_parser(sub) -> None:
        p = sub.add_parser("demo")
        p.add_argument("--n", type=int, default=1)
        p.set_defaults(func=lambda args: 40 + args.n)

    demo.add_parser = add_parser  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvshare_connector.demo.run", demo)
    assert cli.main(["demo", "--n", "2"]) == 42
    # Without the module, the other subcommands still work and `demo` is unknown.
    monkeypatch.setitem(sys.modules, "kvshare_connector.demo.run", None)
    parser = cli.build_parser()
    assert parser.parse_args(["sweep", "x.yaml"]).command == "sweep"
    with pytest.raises(SystemExit):
        parser.parse_args(["demo"])


def test_cli_rejects_vllm_args_for_the_proxy() -> None:
    from kvshare_connector.toolkit import cli

    with pytest.raises(SystemExit):
        cli.main(["proxy", "--prefill", "http://a", "--decode", "http://b", "--", "--x"])


def test_wait_for_port_returns_once_listening_and_names_a_dead_or_silent_server():
    import socket

    from kvshare_connector.common.child_process import wait_for_port

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        wait_for_port("127.0.0.1", port, 5)  # returns: something accepts
    with pytest.raises(TimeoutError, match=f"nothing listens on 127.0.0.1:{port} after 0.3 s"):
        wait_for_port("127.0.0.1", port, 0.3)
    with pytest.raises(RuntimeError, match="exited before listening"):
        wait_for_port("127.0.0.1", port, 30, alive=lambda: False)


def test_free_port_run_is_below_the_ephemeral_range_and_skips_a_taken_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import random
    import socket

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    base = free_port_run(8)
    assert base >= 10000 and base + 8 <= ephemeral_low
    # The single pick too: a port from bind(0) can be handed to the child's own sockets
    # before the child listens on it.
    assert 10000 <= pick_free_port() < ephemeral_low
    # Take the middle port of that run: a second pick starting there must move on.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", base + 4))
        taken.listen()
        starts = iter([base, base + 4, base + 100])
        monkeypatch.setattr(random, "randrange", lambda lo, hi: next(starts))
        assert free_port_run(8) == base + 100


def test_write_atomic_replaces_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    from kvshare_connector.common.files import write_atomic

    path = tmp_path / "ready.json"
    write_atomic(path, '{"a": 1}')
    write_atomic(path, '{"b": 2}')
    assert json.loads(path.read_text()) == {"b": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["ready.json"]


def test_a_child_environment_keeps_the_callers_pythonpath_first(monkeypatch, tmp_path):
    """A side-by-side "before" deployment puts an earlier tree first on PYTHONPATH; the
    launcher adds this checkout after it, never in front (it did, and "before" ran this
    code). Checked by importing the package in a child, as the engines do."""
    import subprocess
    import sys

    from kvshare_connector.toolkit.launcher import _child_env

    before = tmp_path / "before" / "kvshare_connector"
    before.mkdir(parents=True)
    (before / "__init__.py").write_text("TREE = 'before'\n")
    monkeypatch.setenv("PYTHONPATH", "")
    env = _child_env({"PYTHONPATH": str(tmp_path / "before"), "PYTHONSAFEPATH": "1"})
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "before")
    code = "import kvshare_connector as k; print(getattr(k, 'TREE', k.__file__))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=tmp_path, check=True)  # fmt: skip
    assert out.stdout.strip() == "before"
    plain = _child_env({})  # no PYTHONPATH given: this checkout is importable
    assert plain["PYTHONPATH"].split(os.pathsep)[-1] == str(ROOT)


@pytest.mark.parametrize(
    ("kvcached", "vllm", "named"),
    [
        (None, "0.26.0", "kvcached is not installed"),  # engines would run without it, silently
        ("0.1.6", "0.33.0", "kvcached 0.1.6 adapts vLLM up to 0.30 and this is vLLM 0.33.0"),
    ],
)
def test_kvcached_is_refused_before_start_where_it_cannot_serve(monkeypatch, kvcached, vllm, named):
    """Where kvcached is missing, or does not adapt the installed vLLM, ``check`` names it
    before any engine starts (an engine would otherwise run without it, or stop at start
    after a minute). Versions are stubbed: kvcached builds only against CUDA."""
    from kvshare_connector.toolkit import checks

    monkeypatch.setattr(checks, "installed_version", {"kvcached": kvcached, "vllm": vllm}.get)
    cfg = ServeConfig(model="m", env={"ENABLE_KVCACHED": "true"})
    deployment = Deployment(cfg, plan_pd(cfg), with_proxy=True)
    if checks.locate("vllm") is None:
        pytest.skip("no vllm executable beside this Python or on PATH")
    with pytest.raises(checks.UsageError, match=named):
        deployment.check()
    # The release kvcached adapts passes; with kvcached off nothing is asked.
    monkeypatch.setattr(checks, "installed_version", {"kvcached": "0.1.6", "vllm": "0.26.0"}.get)
    checks.check_kvcached()
    monkeypatch.setattr(checks, "installed_version", lambda dist: pytest.fail(f"asked {dist}"))
    plain = ServeConfig(model="m", env={"ENABLE_KVCACHED": "false"})
    try:
        Deployment(plain, plan_pd(plain), with_proxy=True).check()
    except checks.UsageError as other:  # this host's GPUs or ports, never kvcached
        assert "kvcached" not in str(other)
