"""docs/multi_host.md, run: the CPU serving stack on two hosts (scripts/two_hosts.sh: own
network, UTS, IPC and PID namespaces, a veth pair), each role started by its own
``kvshare serve-pd --role`` as the page says, the proxy in front.

Prefill host: ``serve-pd --role prefill --host 0.0.0.0 --secret-file S``; its side channel
listens on every interface and advertises the address of its default route's interface.
Decode host: ``serve-pd --role decode --allowed-prefills PREFILL:5600 --secret-file S``,
``kvshare proxy`` told both URLs and vllm-router (where installed), requests through each.
vLLM itself cannot serve here (no GPU): the per-role command starts
``lab/tools/serve_sim.py`` in its place (``--server-cmd``), vLLM's Scheduler and the
connector over vLLM-made KV tensors and NIXL, with the config and environment
serve-pd gives ``vllm serve``. Checked: every load byte for byte (every layer-block
against the pattern prefill wrote for that prompt; verify_kv's digests on top), the READs'
bytes crossed the link (the decode end's receive counter), and, the negative control that
must fail, a decode started with another secret: its request is refused by prefill's side
channel (a wrong MAC) and its KV is not prefill's.

The pair comes from tests/support/two_hosts.py, with namespace IDs 100-149 of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvshare_connector.toolkit.launcher import vllm_router_available

from .support.two_hosts import two_hosts

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "two_hosts.sh"
IDS = range(100, 150)
SIM = "{python} -m lab.tools.serve_sim {model} --host {host} --port {port}"
PROMPTS = [f"Request {i}: " + "the KV crosses the link " * (6 + 9 * i) for i in range(4)]


def _run(pair: int, role: str, argv: list[str]) -> list[str]:
    return ["bash", str(SCRIPT), "run", str(pair), role, *argv]


def _on(pair: int, role: str, argv: list[str], log: Path) -> subprocess.Popen:
    """``argv`` on ``role``'s host, in a process group of its own, with the environment a
    fresh shell there would have: no side-channel variables another test of this process
    set (in-process engine_sim engines set VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1, which
    serve-pd honours as the operator's)."""
    cmd = _run(pair, role, argv)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_NIXL_SIDE_CHANNEL")}
    with open(log, "w") as out:
        return subprocess.Popen(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env=env,
        )  # fmt: skip


def _serve_pd(pair: int, role: str, work: Path, name: str, *args: str) -> subprocess.Popen:
    """``kvshare serve-pd g4tiny --role ROLE ...`` as docs/multi_host.md writes it."""
    argv = [sys.executable, "-m", "kvshare_connector.toolkit.cli", "serve-pd", "g4tiny"]
    argv += ["--role", role, "--host", "0.0.0.0", *args, "--server-cmd", SIM]
    argv += ["--log-dir", str(work / name), "--ready-file", str(work / f"{name}.json")]
    return _on(pair, role, argv, work / f"{name}.out")


def _wait_ready(procs: dict[str, subprocess.Popen], work: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    waiting = set(procs)
    while waiting:
        for name in list(waiting):
            if (work / f"{name}.json").exists():
                waiting.discard(name)
            elif procs[name].poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{name} not ready:\n{(work / f'{name}.out').read_text()}")
        time.sleep(0.5)


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    for proc in procs.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs.values():
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


#: Runs on the decode host: waits for the fronts, sends the good requests (to the good
#: fronts in turn) and one to the other front, reads the link's receive counter around the
#: good ones. argv: the veth, then {"good": [urls], "other": url, "prompts": [...]}.
CLIENT = """
import json, sys, time
import httpx
veth, plan = sys.argv[1], json.loads(sys.argv[2])
for url in plan["good"] + [plan["other"]]:
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, url + " never healthy"
        time.sleep(0.3)
def rx():
    return int(open(f"/sys/class/net/{veth}/statistics/rx_bytes").read())
def ask(url, prompt):
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"model": "g4tiny", "prompt": prompt, "max_tokens": 4})
    return {"front": url, "status": r.status_code, "body": r.json() if r.content else None}
good = plan["good"]
before = rx()
answers = [ask(good[i % len(good)], p) for i, p in enumerate(plan["prompts"])]
after = rx()
refused = ask(plan["other"], "Not for this decode: " + plan["prompts"][0])
print(json.dumps({"answers": answers, "rx_bytes": after - before, "refused": refused}))
"""


def byte_exact(answer: dict[str, Any], prompt_tokens: int) -> bool:
    """A PD answer whose decode loaded the whole prompt's KV, every layer-block prefill's."""
    body = answer["body"] or {}
    sim = body.get("kvshare_sim") or {}
    return (
        answer["status"] == 200
        and body.get("kv_transfer_params") is None  # no kv_load_error
        and sim.get("loaded_tokens") == prompt_tokens
        and sim.get("kv_mismatches") == []
    )


@pytest.mark.slow
def test_prefill_and_decode_hosts_each_started_by_one_command(tmp_path):
    secret, wrong = tmp_path / "secret", tmp_path / "wrong-secret"
    for path, value in ((secret, "a1" * 32), (wrong, "b2" * 32)):
        path.write_text(value + "\n")
        path.chmod(0o600)
    procs: dict[str, subprocess.Popen] = {}
    with two_hosts(ids=IDS) as hosts:
        pair, prefill, decode = hosts.id, hosts.prefill, hosts.decode
        # A host has a default route: prefill's, through the link (as a real one's would be)
        route = ["ip", "route", "add", "default", "via", decode]
        subprocess.run(["bash", str(SCRIPT), "run", str(pair), "prefill", *route], check=True)
        try:
            procs["prefill"] = _serve_pd(
                pair, "prefill", tmp_path, "prefill", "--secret-file", str(secret)
            )
            reads = tmp_path / "reads.jsonl"
            allowed = ["--allowed-prefills", f"{prefill}:5600"]
            procs["decode"] = _serve_pd(
                pair, "decode", tmp_path, "decode", *allowed, "--secret-file", str(secret),
                "--kv-extra-config", json.dumps({"read_log": str(reads)}),
            )  # fmt: skip
            procs["other"] = _serve_pd(
                pair, "decode", tmp_path, "other", *allowed, "--secret-file", str(wrong),
                "--decode-port", "8201",
            )  # fmt: skip
            _wait_ready(procs, tmp_path)
            # The fronts, on the decode host: our proxy (and one for the other decode), and
            # vllm-router where installed (the optional extra), each told both URLs.
            fronts = {"proxy": [sys.executable, "-m", "kvshare_connector.toolkit.cli", "proxy"]}
            fronts["proxy-other"] = fronts["proxy"]
            if vllm_router_available():
                fronts["router"] = [sys.executable, "-m", "vllm_router.launch_router"]
                fronts["router"] += ["--vllm-pd-disaggregation", "--prometheus-port", "29100"]
            ports = {"proxy": (8000, 8200), "proxy-other": (8001, 8201), "router": (8002, 8200)}
            for name, argv in fronts.items():
                port, decode_port = ports[name]
                argv = [*argv, "--port", str(port), "--prefill", f"http://{prefill}:8100"]
                argv += ["--decode", f"http://{decode}:{decode_port}"]
                procs[name] = _on(pair, "decode", argv, tmp_path / f"{name}.out")
            good = [f"http://127.0.0.1:{ports[n][0]}" for n in fronts if n != "proxy-other"]
            plan = {"good": good, "other": "http://127.0.0.1:8001", "prompts": PROMPTS}
            client = [sys.executable, "-c", CLIENT, f"kvs{pair}d", json.dumps(plan)]
            done = subprocess.run(
                _run(pair, "decode", client),
                capture_output=True, text=True, timeout=600, cwd=ROOT,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr[-3000:]
            result = json.loads(done.stdout.strip().splitlines()[-1])
            (tmp_path / "client.json").write_text(json.dumps(result, indent=1))  # to look at
        finally:
            _stop(procs)
    prefill_log = (tmp_path / "prefill" / "prefill0.log").read_text()
    ready = json.loads((tmp_path / "prefill.json").read_text())

    # Prefill listened on every interface and advertised its routable address.
    assert ready["side_channels"] == [f"{prefill}:5600"]
    assert f"KV side channel listens on 0.0.0.0 and advertises {prefill} (the default" in (
        prefill_log
    )
    assert f"side channel {prefill}:5600" in prefill_log
    # Every load byte for byte, through the proxy, across the link.
    for prompt, answer in zip(PROMPTS, result["answers"], strict=True):
        assert byte_exact(answer, len(prompt.encode())), answer
    assert {a["front"] for a in result["answers"]} == set(good)  # through every front
    logged = [json.loads(line) for line in reads.read_text().splitlines()]
    assert len(logged) == len(PROMPTS)
    read_bytes = sum(r["bytes"] for r in logged)
    assert read_bytes > 0 and result["rx_bytes"] >= read_bytes, (result["rx_bytes"], read_bytes)
    # The negative control: another secret is refused by prefill, and fails the check.
    refused = result["refused"]
    assert not byte_exact(refused, len(("Not for this decode: " + PROMPTS[0]).encode()))
    # vLLM's kv_load_failure_policy decides the answer (0.26: computed locally, the error in
    # kv_transfer_params; from 0.30 "fail", its default: an error); its decode says why.
    why = f"peer at {prefill}:5600 refused (unauthenticated): request has a wrong MAC"
    assert why in (tmp_path / "other" / "decode0.log").read_text()
    assert refused["status"] != 200 or why in refused["body"]["kv_transfer_params"]["kv_load_error"]
    assert f"refused a request from {decode} (unauthenticated)" in prefill_log
