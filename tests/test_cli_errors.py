"""Every bad input to ``kvshare`` ends in one line naming the problem and exit status 2,
checked before anything starts; a server failing at runtime keeps its log-tail report."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshare_connector.toolkit import checks, cli, launcher
from kvshare_connector.toolkit.procs import LaunchError, ManagedProcess, pick_free_port

ROOT = Path(__file__).resolve().parent.parent
FAKE = ROOT / "tests" / "support" / "fake_vllm_server.py"
FAKE_CMD = f"{{python}} {shlex.quote(str(FAKE))} {{model}} --role {{role}} --port {{port}}"
SMI_FAILS = 'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the driver"; exit 9'
HUB_ID = "google/gemma-4-E2B-it"


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def _tools(tmp_path: Path, smi: str | None) -> Path:
    """A bin/ with a stand-in `vllm` and, unless None, an `nvidia-smi` running ``smi``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    _script(bin_dir / "vllm", "exit 0")
    if smi is not None:
        _script(bin_dir / "nvidia-smi", smi)
    return bin_dir


def _env(path: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVSHARE_SERVER_CMD", "PATH")}
    return {**env, "PATH": path, **extra}


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real command: the console script beside this Python, else ``-m``."""
    script = Path(sys.executable).parent / "kvshare"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", cli.__name__]
    return subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
        env=env or _env(os.environ.get("PATH", "")),
    )  # fmt: skip


def assert_one_line(command: str, rc: int | str | None, err: str, *names: str) -> str:
    """Exit status 2, and stderr one line ``kvshare COMMAND: error: ...`` naming ``names``."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, (rc, err)
    assert lines[0].startswith(f"kvshare {command}: error: "), lines[0]
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def usage_error(capsys: pytest.CaptureFixture[str], argv: list[str], *names: str) -> str:
    """``cli.main(argv)`` in this process fails as ``assert_one_line`` wants."""
    try:
        rc: int | str | None = cli.main(argv)
    except SystemExit as exc:  # argparse's errors
        rc = exc.code
    return assert_one_line(argv[0], rc, capsys.readouterr().err, *names)


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture
def no_server_cmd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(launcher.SERVER_CMD_ENV, raising=False)


@pytest.fixture
def gpu_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_server_cmd: None) -> Path:
    """This process sees an `nvidia-smi` listing two GPUs and a stand-in `vllm` that exits at
    once (should a check pass that must not, no real engine starts)."""
    bin_dir = _tools(tmp_path, 'echo "GPU 0: H200 (UUID: GPU-a)"; echo "GPU 1: H200 (UUID: GPU-b)"')
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return bin_dir


# ---- the rows, through the real command -----------------------------------------


def test_serve_pd_missing_model_path_without_the_venv_on_path() -> None:
    r = run_cli("serve-pd", "/nonexistent/model", env=_env("/usr/bin:/bin"))
    assert_one_line("serve-pd", r.returncode, r.stderr, "'/nonexistent/model' does not exist")


def test_serve_pd_says_no_cuda_device_before_starting_engines(tmp_path: Path) -> None:
    bin_dir = _tools(tmp_path, SMI_FAILS)
    path = f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin"
    env = {k: v for k, v in _env(path).items() if k != "CUDA_VISIBLE_DEVICES"}
    r = run_cli("serve-pd", HUB_ID, "--log-dir", str(tmp_path / "logs"), env=env)
    assert_one_line("serve-pd", r.returncode, r.stderr, "no CUDA device visible", "nvidia-smi")
    assert not (tmp_path / "logs").exists()  # nothing was started
    r = run_cli("serve-pd", HUB_ID, env=_env(path, CUDA_VISIBLE_DEVICES=""))
    assert_one_line("serve-pd", r.returncode, r.stderr, "CUDA_VISIBLE_DEVICES is empty")


def test_proxy_refuses_urls_that_are_not_urls() -> None:
    r = run_cli("proxy", "--prefill", "notaurl", "--decode", "x")
    assert_one_line("proxy", r.returncode, r.stderr, "argument --prefill", "'notaurl'")


def test_sweep_missing_file() -> None:
    r = run_cli("sweep", "/nonexistent.yaml")
    assert_one_line("sweep", r.returncode, r.stderr, "'/nonexistent.yaml' does not exist")


def test_demo_refuses_negative_tokens() -> None:
    r = run_cli("demo", "--tokens", "-5")
    assert_one_line("demo", r.returncode, r.stderr, "argument --tokens", "[1, 2048]", "'-5'")
    assert r.stdout == ""  # no RESULT line: the demo never ran


def test_a_failing_server_keeps_its_log_tail_report(tmp_path: Path) -> None:
    """Runtime failures are not usage errors: exit 1 and the server's own words."""
    dies = "{python} -c " + shlex.quote("print('engine says boom'); raise SystemExit(3)")
    ports = [str(pick_free_port()) for _ in range(3)]
    r = run_cli(
        "serve-pd", "fake-model", "--server-cmd", dies, "--port", ports[0],
        "--prefill-port", ports[1], "--decode-port", ports[2], "--log-dir", str(tmp_path),
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "exited with code 3" in r.stderr and "engine says boom" in r.stderr


# ---- every other argument that can be wrong, in this process ----------------------------

URLS = ["--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200"]


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--prefill", "ftp://h:1", "--decode", "http://h:2"], ["--prefill", "http(s) URL"]),
        (["--prefill", "http://h:1", "--decode", "http://h:99999"], ["--decode", "1-65535"]),
        (["--prefill", "http://h:1", "--decode", "http://:2"], ["--decode", "with a host"]),
        (["--prefill", "http://h:1?x=1", "--decode", "http://h:2"], ["--prefill", "?query"]),
        ([*URLS, "--port", "0"], ["argument --port", "[1, 65535]", "'0'"]),
        ([*URLS, "--port", "65536"], ["argument --port", "'65536'"]),
        ([*URLS, "--port", "http"], ["argument --port", "'http'"]),
        ([*URLS, "--connect-timeout", "0"], ["--connect-timeout", "> 0"]),
        ([*URLS, "--read-timeout", "-1"], ["--read-timeout", "> 0"]),
        ([*URLS, "--read-timeout", "nan"], ["--read-timeout", "'nan'"]),
        ([*URLS, "--host", "192.0.2.1"], ["cannot listen on 192.0.2.1"]),
        ([*URLS, "--", "--enforce-eager"], ["after `--`", "takes none"]),
    ],
)
def test_proxy_arguments(
    capsys: pytest.CaptureFixture[str], argv: list[str], names: list[str]
) -> None:
    usage_error(capsys, ["proxy", *argv], *names)


def test_proxy_port_in_use(capsys: pytest.CaptureFixture[str], busy_port: int) -> None:
    usage_error(capsys, ["proxy", *URLS, "--port", str(busy_port)], f"port {busy_port}", "in use")


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["/nonexistent/model"], ["model path '/nonexistent/model' does not exist"]),
        (["./no/such/model"], ["'./no/such/model' does not exist"]),
        (["~/no-such-model-dir"], ["'~/no-such-model-dir' does not exist"]),
        (["org/name/extra"], ["'org/name/extra' does not exist"]),
        ([""], ["model is empty"]),
        (["m", "--num-prefill", "0"], ["--num-prefill", ">= 1"]),
        (["m", "--num-decode", "-1"], ["--num-decode", "'-1'"]),
        (["m", "--prefill-gpus", ","], ["--prefill-gpus", "GPU ids"]),
        (["m", "--decode-gpus", "one"], ["--decode-gpus", "'one'"]),
        (["m", "--gpu-memory-utilization", "0"], ["--gpu-memory-utilization", "(0, 1]"]),
        (["m", "--gpu-memory-utilization", "1.5"], ["--gpu-memory-utilization", "'1.5'"]),
        (["m", "--block-size", "0"], ["--block-size", ">= 1"]),
        (["m", "--max-model-len", "-8"], ["--max-model-len", ">= 1"]),
        (["m", "--kv-extra-config", "{bad"], ["--kv-extra-config", "not valid JSON"]),
        (["m", "--kv-extra-config", "[1]"], ["--kv-extra-config", "JSON object", "list"]),
        (["m", "--env", "NOVALUE"], ["--env", "KEY=VALUE"]),
        (["m", "--ready-timeout", "0"], ["--ready-timeout", "> 0"]),
        (["m", "--grace", "-1"], ["--grace", ">= 0"]),
        (["m", "--connect-timeout", "inf"], ["--connect-timeout", "'inf'"]),
        (["m", "--port", "0"], ["argument --port", "[1, 65535]"]),
        (["m", "--prefill-port", "65536"], ["--prefill-port", "'65536'"]),
        (["m", "--side-channel-port", "-5"], ["--side-channel-port"]),
        (["m", "--router-metrics-port", "70000"], ["--router-metrics-port"]),
        (["m", "--router-args", "'unclosed"], ["--router-args", "No closing quotation"]),
        (["m", "--layout", "diagonal"], ["--layout", "invalid choice"]),
        (["m", "--router", "nginx"], ["--router", "invalid choice"]),
        (["m", "--server-cmd", "{python} {modle}"], ["unknown field {modle}"]),
        (["m", "--server-cmd", "{python} 'x"], ["No closing quotation"]),
        (["m", "--server-cmd", "no-such-server {model}"], ["'no-such-server' is not an exec"]),
        (["m", "--server-cmd", FAKE_CMD, "--decode-port", "65535", "--num-decode", "2"],
         ["--decode-port (decode1)", "65536"]),
    ],
)  # fmt: skip
def test_serve_pd_arguments(
    capsys: pytest.CaptureFixture[str], no_server_cmd: None, argv: list[str], names: list[str]
) -> None:
    usage_error(capsys, ["serve-pd", *argv], *names)


def test_serve_pd_ports_twice_or_in_use(
    capsys: pytest.CaptureFixture[str], busy_port: int, tmp_path: Path
) -> None:
    fake = ["serve-pd", "m", "--server-cmd", FAKE_CMD, "--log-dir", str(tmp_path)]
    usage_error(capsys, [*fake, "--port", "18100", "--prefill-port", "18100"], "both use port")
    free = ["--port", str(pick_free_port()), "--prefill-port", str(pick_free_port())]
    busy = [*fake, *free, "--decode-port", str(busy_port)]
    usage_error(capsys, busy, f"--decode-port (decode0): port {busy_port}", "in use")
    assert list(tmp_path.iterdir()) == []  # no server was started


def test_serve_pd_log_dir_and_ready_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    fake = ["serve-pd", "m", "--server-cmd", FAKE_CMD]
    usage_error(capsys, [*fake, "--log-dir", str(a_file)], "--log-dir", "not a directory")
    missing = tmp_path / "no" / "ready.json"
    usage_error(capsys, [*fake, "--ready-file", str(missing)], "--ready-file", "does not exist")
    usage_error(capsys, [*fake, "--ready-file", str(tmp_path)], "--ready-file", "is a directory")


def test_serve_pd_finds_no_vllm_and_says_where_it_looked(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    no_server_cmd: None,
) -> None:  # fmt: skip
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    line = usage_error(capsys, ["serve-pd", HUB_ID], "`vllm` not found", str(tmp_path), "PATH")
    assert "pip install vllm" in line


def test_serve_pd_gpu_checks(
    capsys: pytest.CaptureFixture[str], gpu_host: Path, busy_port: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    usage_error(capsys, ["serve-pd", HUB_ID, "--decode-gpus", "3"], "GPU 3", "has 2 (0-1)")
    # Two GPUs pass the check: what fails next is the port, so nothing started.
    busy = ["serve-pd", HUB_ID, "--decode-gpus", "1", "--port", str(busy_port)]
    usage_error(capsys, busy, f"port {busy_port}", "in use")
    _script(gpu_host / "nvidia-smi", SMI_FAILS)
    usage_error(capsys, ["serve-pd", HUB_ID], "no CUDA device visible", "couldn't communicate")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    usage_error(capsys, ["serve-pd", HUB_ID], "CUDA_VISIBLE_DEVICES is empty")


def test_serve_pd_vllm_router_not_installed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launcher, "vllm_router_available", lambda: False)
    argv = ["serve-pd", "m", "--server-cmd", FAKE_CMD, "--router", "vllm-router"]
    usage_error(capsys, argv, "--router vllm-router", "not installed")


def _sweep_file(tmp_path: Path, text: str, name: str = "s.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("configs: [a, {b: 1}", ["not valid YAML"]),
        ("configs: 3\n", ["expected a mapping with a `configs` list"]),
        ("configs: []\n", ["list is empty"]),
        ("configs: [3]\n", ["configs[0] must be a mapping"]),
        ("defaults: 3\nconfigs: [{name: a, model: m}]\n", ["`defaults` must be a mapping"]),
        ("configs: [{name: a, model: m, kv_cached: true}]\n", ["unknown keys ['kv_cached']"]),
        ("configs: [{name: a}]\n", ["exactly one of model and tiny_model_config"]),
        ("configs: [{name: a, tiny_model_config: no.json}]\n", ["tiny_model_config", "no.json"]),
        ("configs: [{name: a, model: /no/model}]\n", ["model path '/no/model' does not exist"]),
        ("configs: [{name: a, model: m, block_size: 0}]\n", ["block_size must be an integer"]),
        ("configs: [{name: a, model: m, block_size: '16'}]\n", ["block_size", "'16'"]),
        ("configs: [{name: a, model: m, gpu_memory_utilization: 2}]\n", ["(0, 1]"]),
        ("configs: [{name: a, model: m, min_agreement: -1}]\n", ["min_agreement"]),
        ("configs: [{name: a, model: m, ready_timeout: 0}]\n", ["ready_timeout", "> 0"]),
        ("configs: [{name: a, model: m, prefill_gpus: 0}]\n", ["prefill_gpus must be a list"]),
        ("configs: [{name: a, model: m, eval: {limit: -1}}]\n", ["eval limit", "> 0"]),
        ("configs: [{name: a, model: m, eval: {num_concurrent: 0}}]\n", ["num_concurrent"]),
        ("configs: [{name: a, model: m, eval: {include_path: nodir}}]\n", ["include_path"]),
        ("configs: [{name: a, model: m, eval: {api: rest}}]\n", ["eval api must be"]),
        ("configs: [{name: a, model: m, eval: [1]}]\n", ["config 'a'"]),
    ],
)
def test_sweep_file_contents(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, names: list[str]
) -> None:
    usage_error(capsys, ["sweep", _sweep_file(tmp_path, text)], *names)


GOOD = "configs: [{name: a, model: fake-model}]\n"


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--only", "b"], ["--only: no configuration named ['b']"]),
        (["--limit", "0"], ["argument --limit", "> 0"]),
        (["--ready-timeout", "-3"], ["argument --ready-timeout"]),
        (["--server-cmd", "no-such-server {model}"], ["'no-such-server' is not an exec"]),
    ],
)
def test_sweep_arguments(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], names: list[str]
) -> None:
    usage_error(capsys, ["sweep", _sweep_file(tmp_path, GOOD), *argv], *names)


def test_sweep_paths_and_gpus(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, gpu_host: Path
) -> None:
    usage_error(capsys, ["sweep", str(tmp_path)], "is not a file")
    usage_error(capsys, ["sweep", _sweep_file(tmp_path, "{", "s.json")], "not valid JSON")
    good = _sweep_file(tmp_path, GOOD)
    a_file = _sweep_file(tmp_path, "", "out")
    usage_error(capsys, ["sweep", good, "--output-dir", a_file], "--output-dir", "not a director")
    out = ["--output-dir", str(tmp_path / "out_dir")]  # kept out of the checkout, were it to run
    gpu5 = _sweep_file(tmp_path, "configs: [{name: a, model: fake-model, decode_gpus: [5]}]\n")
    usage_error(capsys, ["sweep", gpu5, *out], "GPU 5", "has 2")
    _script(gpu_host / "nvidia-smi", SMI_FAILS)
    usage_error(capsys, ["sweep", good, *out], "no CUDA device visible")


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--tokens", "0"], ["--tokens", "[1, 2048]"]),
        (["--tokens", "5000"], ["--tokens", "'5000'"]),
        (["--tokens", "many"], ["--tokens", "'many'"]),
        (["--lease-s", "0"], ["--lease-s", "> 0"]),
        (["--packed-mib", "-1"], ["--packed-mib", ">= 0"]),
        (["--model", "llama"], ["--model", "invalid choice"]),
        (["--", "--x"], ["takes none"]),
        (["--role", "prefill"], ["--role prefill needs --listen HOST:PORT and --secret-file"]),
        (["--role", "decode", "--secret-file", "f"], ["needs --prefill HOST:PORT"]),
        (["--secret-file", "f"], ["--secret-file needs --role prefill or decode"]),
        (["--role", "host"], ["--role", "invalid choice"]),
        (["--listen", "10.0.0.1"], ["--listen", "is not HOST:PORT"]),
        (["--listen", "0.0.0.0:5600"], ["--listen", "unspecified address"]),
        (["--prefill", "10.0.0.1:65535"], ["--prefill", "not in 1-65534"]),
        (
            ["--role", "decode", "--prefill", "10.0.0.1:5600", "--listen", "10.0.0.2:5600"],
            ["--listen is not an option of --role decode"],
        ),
        (
            ["--role", "decode", "--prefill", "10.0.0.1:5600", "--secret-file", "/no/such"],
            ["--secret-file /no/such", "No such file"],
        ),
    ],
)
def test_demo_arguments(
    capsys: pytest.CaptureFixture[str], argv: list[str], names: list[str]
) -> None:
    usage_error(capsys, ["demo", *argv], *names)


def test_demo_without_nixl(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if "nixl" in name else real(name, *a)
    )
    usage_error(capsys, ["demo"], "nixl or nixl_cu13 is not installed", "pip install")


def test_an_unexpected_error_while_checking_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(model: str) -> str:
        raise RuntimeError("check broke\nover two lines")

    monkeypatch.setattr(checks, "check_model", broken)
    usage_error(capsys, ["serve-pd", "m"], "cannot check the arguments", "check broke over two")


# ---- the checks themselves: what they accept ------------------------------------------------


def test_what_the_checks_accept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert checks.http_url("http://127.0.0.1:8100") == "http://127.0.0.1:8100"
    assert checks.http_url("https://prefill.example/base/") == "https://prefill.example/base/"
    assert checks.json_object('{"kv_lease_duration": 60}') == {"kv_lease_duration": 60}
    assert checks.gpu_list("0, 1,GPU-abc") == ["0", "1", "GPU-abc"]
    assert checks.fraction("1") == 1.0 and checks.port_number("65535") == 65535
    assert checks.shell_words("--a 'b c'") == ["--a", "b c"]
    # Hub ids pass through; paths must exist, `~` expanded.
    for hub in (HUB_ID, "fake-model", "org/name"):
        assert not checks.looks_like_path(hub) and checks.check_model(hub) == hub
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    assert checks.looks_like_path("models/absent")  # exists in part: a path, not a hub id
    assert checks.check_model("models/tiny") == "models/tiny"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert checks.check_model("~/models/tiny") == str(tmp_path / "models" / "tiny")
    checks.check_ports("127.0.0.1", [("a", 18001), ("b", 18002)], free=False)


def test_vllm_is_found_beside_python_before_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_server_cmd: None
) -> None:
    beside, on_path = tmp_path / "venv", tmp_path / "path"
    for where in (beside, on_path):
        where.mkdir()
        _script(where / "vllm", "exit 0")
    monkeypatch.setattr(sys, "executable", str(beside / "python"))
    monkeypatch.setenv("PATH", str(on_path))
    assert checks.locate("vllm") == str(beside / "vllm")
    (beside / "vllm").unlink()
    assert checks.locate("vllm") == str(on_path / "vllm")
    (engine, *_) = launcher.plan_pd(launcher.ServeConfig(model=HUB_ID))
    assert engine.argv[:2] == [str(on_path / "vllm"), "serve"]


def test_gpu_count_reads_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    smi = 'echo "GPU 0: H200 (UUID: GPU-a)"; echo "  MIG 1g.18gb Device 0: (UUID: MIG-b)"'
    monkeypatch.setenv("PATH", str(_tools(tmp_path, smi)))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert checks.gpu_count()[0] == 1
    checks.check_gpus(["0", "GPU-a"], "why")  # passes


def test_a_program_that_is_not_there_is_a_launch_error(tmp_path: Path) -> None:
    proc = ManagedProcess("ghost", [str(tmp_path / "nothing")], {}, tmp_path / "ghost.log")
    with pytest.raises(LaunchError, match="cannot start ghost"):
        proc.start()


def test_sweep_file_is_read_once_and_entries_kept(tmp_path: Path) -> None:
    """The checked entries are what the sweep runs (``_check`` keeps them)."""
    from kvshare_connector.toolkit import sweep

    path = _sweep_file(tmp_path, json.dumps({"configs": [{"name": "a", "model": "m"}]}), "s.json")
    args = cli.build_parser().parse_args(["sweep", path, "--server-cmd", FAKE_CMD])
    sweep._check(args)
    assert [e.name for e in args.entries] == ["a"]
