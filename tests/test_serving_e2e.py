"""bench_serving.py end to end on CPU: fake vLLM servers, the bench worker with a stand-in
benchmark (vLLM's takes a minute to import on this host), the real vllm-router in front of
1 prefill x 2 decodes, and the fault mode through the real proxy: prefill SIGKILLed under
load and restarted, prefill exiting at a failpoint (and one that never fires), prefill
SIGSTOPped and resumed (and stopped past the probes' timeout), decode exiting at a failpoint
with prefill's lease freeing what it held (and, without a lease, the leak seen)."""

from __future__ import annotations

import json
import shlex
import tarfile
from pathlib import Path
from typing import Any

import pytest

from kvshare_connector.toolkit.launcher import vllm_router_available
from kvshare_connector.toolkit.procs import free_port_run, pick_free_port
from lab.benchmarks.gpu import bench_serving as bs
from lab.benchmarks.gpu.serving import faults

ROOT = Path(__file__).resolve().parent.parent

FAKE = ROOT / "tests" / "support" / "fake_vllm_server.py"
FAKE_CMD = (
    f"{{python}} {shlex.quote(str(FAKE))} {{model}} --role {{role}} --host {{host}} --port {{port}}"
)
PACKAGED = ROOT / "kvshare_connector" / "demo" / "models" / "g4tiny.json"

#: A stand-in for vLLM's bench: the same options, requests at --request-rate, a result JSON
#: with the fields the report and the fault timeline read (detailed ones included).
FAKE_IMPL = """
import json, math, time
from concurrent.futures import ThreadPoolExecutor
import httpx

def run(argv):
    o = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            o[a] = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ""
    n, rate = int(o["--num-prompts"]), float(o["--request-rate"])
    def one(i):
        st = time.perf_counter()
        try:
            r = httpx.post(o["--base-url"] + "/v1/completions", timeout=10, json={
                "model": o["--model"], "prompt": f"What is {i} + 1?", "max_tokens": 4})
            err = "" if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:80]}"
        except Exception as exc:
            err = repr(exc)
        return st, err, time.perf_counter() - st
    t0 = time.perf_counter()
    with ThreadPoolExecutor(int(o["--max-concurrency"])) as pool:
        futures = []
        for i in range(n):
            if not math.isinf(rate):
                time.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            futures.append(pool.submit(one, i))
        res = [f.result() for f in futures]
    dur = time.perf_counter() - t0
    ok = [r for r in res if not r[1]]
    ttft = 1e3 * sum(r[2] for r in ok) / max(1, len(ok))
    out = {"completed": len(ok), "failed": n - len(ok), "duration": dur,
           "request_throughput": len(ok) / dur, "output_throughput": 4 * len(ok) / dur,
           "mean_ttft_ms": ttft, "median_ttft_ms": ttft, "p99_ttft_ms": ttft,
           "median_itl_ms": 1.0, "p99_itl_ms": 2.0,
           "start_times": [r[0] for r in res], "errors": [r[1] for r in res],
           "ttfts": [r[2] for r in res]}
    with open(o["--result-dir"] + "/" + o["--result-filename"], "w") as f:
        json.dump(out, f)
"""


def _common(tmp_path: Path, monkeypatch: Any) -> list[str]:
    (tmp_path / "fake_bench_impl.py").write_text(FAKE_IMPL)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(PACKAGED.read_text())
    tok = tmp_path / "tok"
    tok.mkdir()
    return [
        "--model-dir", str(model), "--tokenizer", str(tok), "--server-cmd", FAKE_CMD,
        "--bench-impl", "fake_bench_impl:run",
        "--base-port", str(free_port_run(3 * bs.PORT_STRIDE)),  # deployments number up from it
        "--side-channel-port", str(pick_free_port()), "--ready-timeout", "60", "--grace", "5",
        "--warmup-requests", "2", "--warmup-tokens", "4",
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not vllm_router_available(), reason="vllm-router not installed")
def test_rounds_behind_the_real_router_1p2d(tmp_path: Path, monkeypatch: Any) -> None:
    out = tmp_path / "out"
    rc = bs.main(
        ["--out", str(out), *_common(tmp_path, monkeypatch), "--deployments", "ours",
         "colocated", "--router", "vllm-router", "--num-decode", "2", "--rounds", "2",
         "--num-prompts", "6", "--concurrency", "2", "--input-len", "16", "--output-len", "4"]
    )  # fmt: skip
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert len(results["runs"]) == 4 and all(r["ok"] for r in results["runs"])
    assert {r["router"] for r in results["runs"]} == {"vllm-router", "none"}
    # Both decodes served (round robin), and every warmup answer was right.
    assert results["engines"]["ours"] == {"prefill0": 12.0, "decode0": 6.0, "decode1": 6.0}
    assert results["checks"]["ours"]["ok"] == 2 and results["checks"]["ours"]["agreement"] == 1
    with tarfile.open(out / "raw.tar.gz") as tar:
        names = tar.getnames()
    assert "raw/logs/ours/router.log" in names and "raw/logs/bench/worker.log" in names
    assert "vllm-router" in (out / "summary.md").read_text()


FAULT_LOAD = ["--mode", "faults", "--fault-rate", "5", "--load-seconds", "8", "--kill-after",
              "2", "--restart-after", "0.5", "--concurrency", "4", "--drain-timeout", "10",
              "--probe-timeout", "5", "--sample-interval", "0.3", "--rejoin-timeout", "30"]


def _faults(tmp_path: Path, monkeypatch: Any, *argv: str) -> tuple[int, dict[str, Any], Path]:
    """One fault run with the fake servers (the survivor answers plain requests)."""
    monkeypatch.setenv("FAKE_DECODE_LOCAL", "1")  # decode serves requests without KV params
    monkeypatch.setenv("FAKE_PREFILL_LOCAL", "1")  # and so does prefill
    # A load from a prefill killed after it answered is computed locally (kv_load_error),
    # as the connector does: the fake's strict 400 would fail such a request in the bench.
    monkeypatch.setenv("FAKE_DECODE_RECOMPUTE", "1")
    out = tmp_path / "out"
    rc = bs.main(["--out", str(out), *_common(tmp_path, monkeypatch), *FAULT_LOAD, *argv])
    return rc, json.loads((out / "faults.json").read_text()), out


def _events(summary: dict[str, Any]) -> list[str]:
    return [e["event"] for e in summary["events"] if e["event"] != "stale load answered"]


def _failed(summary: dict[str, Any]) -> list[str]:
    return [k for k, v in summary["verdicts"].items() if not v["ok"]]


@pytest.mark.slow
@pytest.mark.parametrize("side_down", ["alone", "fail"])
def test_fault_mode_kills_and_restarts_prefill(tmp_path: Path, monkeypatch: Any,
                                               side_down: str) -> None:  # fmt: skip
    """Prefill killed under load and restarted. While it is down our proxy has decode serve
    requests alone (``--side-down alone``, the default); with ``fail`` (the control) they
    fail 503."""
    rc, summary, out = _faults(tmp_path, monkeypatch, "--side-down", side_down)
    assert rc == 0, summary["verdicts"]
    order = ["checks before the load", "load start", "fault", "victim restarted",
             "victim rejoined", "checks after recovery", "kv usage zero on every engine"]
    assert [e for e in _events(summary) if e in order] == order
    assert "kv usage zero on every engine" in _events(summary)
    assert summary["fault"]["how"] == "SIGKILL"
    v = summary["verdicts"]
    kept = v["survivor_kept_serving"]
    ok, n = map(int, kept["direct_probes_ok"].split("/"))
    assert ok == n > 0 and kept["survivor"] == "decode0"
    # Decode asked to load from the prefill just killed computes locally and says why.
    stale = kept["stale_load"]
    assert stale["status"] == 200 and "KV load failed" in stale["kv_load_error"], stale
    assert summary["measured"]["local_loads"] >= 1
    assert v["victim_rejoined"]["checks_after"] == "8/8"
    assert v["connector_series_live"]["decode"]["read_seconds_count"] > 0
    assert v["no_wrong_kv"]["verified_loads"] > 0
    alone = summary["measured"]["served_alone"]
    if side_down == "alone":  # the outage served around: nothing failed, decode took it
        assert summary["bench"]["failed"] == 0, summary["bench_errors"]
        assert alone["decode"] > 0 and alone["prefill"] == 0
    else:  # the outage shows: requests failed (503 from the proxy) while prefill was down
        assert summary["bench"]["failed"] > 0
        assert any("503" in e for e in summary["bench_errors"])
        assert alone == {"decode": 0, "prefill": 0}
    assert summary["measured"]["fault_to_first_good_s"] > 0
    # Probes go on after the victim is back until one is good: recovery is measured.
    recovery = summary["measured"]["healthy_to_first_good_s"]
    assert recovery is not None and recovery < faults.RECOVERY_WAIT_S
    text = (out / "faults.md").read_text()
    assert "| victim_rejoined | PASS |" in text and "victim restarted" in text
    with tarfile.open(out / "raw.tar.gz") as tar:
        assert "raw/logs/ours/prefill0-restarted.log" in tar.getnames()


@pytest.mark.slow
def test_fault_2p1d_the_proxy_sends_legs_to_the_prefill_left(tmp_path: Path, monkeypatch: Any):
    """The fault matrix's 2p1d variant: one of two prefills killed under load; our proxy
    passes it over, so requests after the fault go through the other (in the 1P1D run
    above decode serves them alone until the restart)."""
    rc, summary, _ = _faults(tmp_path, monkeypatch, "--num-prefill", "2")
    assert rc == 0, summary["verdicts"]
    assert summary["fault"]["engine"] == "prefill0"
    kept = summary["verdicts"]["survivor_kept_serving"]
    ok, n = map(int, kept["front_requests_after_fault_ok"].split("/"))
    assert n > 0 and ok == n, kept
    assert summary["bench"]["failed"] == 0, summary["bench_errors"]


@pytest.mark.slow
@pytest.mark.skipif(not vllm_router_available(), reason="vllm-router not installed")
def test_fault_behind_vllm_router_1p2d(tmp_path: Path, monkeypatch: Any) -> None:
    """The fault matrix's router-1p2d variant: prefill killed under load behind vllm-router
    with two decodes, restarted; every verdict passes and all three engines drain."""
    rc, summary, out = _faults(tmp_path, monkeypatch, "--router", "vllm-router",
                               "--num-decode", "2")  # fmt: skip
    assert rc == 0, summary["verdicts"]
    assert summary["setup"]["front"] == "vllm-router"
    assert summary["fault"]["roles"] == {"prefill0": "prefill", "decode0": "decode",
                                         "decode1": "decode"}  # fmt: skip
    assert summary["measured"]["usage_after_drain"] == {"prefill0": 0.0, "decode0": 0.0,
                                                        "decode1": 0.0}  # fmt: skip
    assert "victim restarted" in _events(summary)
    with tarfile.open(out / "raw.tar.gz") as tar:
        assert "raw/logs/ours/router.log" in tar.getnames()


@pytest.mark.slow
def test_fault_at_a_failpoint_prefill_exits_there(tmp_path: Path, monkeypatch: Any) -> None:
    """The victim starts with KVSHARE_FAILPOINTS and exits at its 21st KV pull (2 warmup + 8
    checks + 10 under load); the driver notices, restarts it without the failpoint."""
    rc, summary, out = _faults(tmp_path, monkeypatch, "--fault-point", "source.claim_answered",
                               "--kill-after", "30")  # fmt: skip
    assert rc == 0, summary["verdicts"]
    f = summary["fault"]
    assert (f["how"], f["fired"], f["skip"]) == ("failpoint source.claim_answered", True, 20)
    events = summary["events"]
    fault = next(e for e in events if e["event"] == "fault")
    assert fault["time"] - events[0]["time"] < 20  # it fired, long before --kill-after
    deps = json.loads(_member(out, "raw/deployments.json"))
    env = {e["name"]: e["env"] for e in deps["ours"]["engines"]}
    assert env["prefill0"]["KVSHARE_FAILPOINTS"] == "source.claim_answered=exit@20"
    assert "KVSHARE_FAILPOINTS" not in env["decode0"]
    marker = "failpoint source.claim_answered: exit"  # the failpoint's own log line
    assert marker in _member(out, "raw/logs/ours/prefill0.log")
    assert marker not in _member(out, "raw/logs/ours/prefill0-restarted.log")  # not armed
    assert summary["verdicts"]["victim_rejoined"]["checks_after"] == "8/8"


@pytest.mark.slow
def test_fault_failpoint_that_never_fires_is_recorded(tmp_path: Path, monkeypatch: Any) -> None:
    """Negative control: a failpoint past every hit of the run never fires; the victim is
    SIGKILLed after the grace and the run fails, saying so."""
    monkeypatch.setattr(faults, "FIRE_GRACE_S", 1.0)
    rc, summary, _ = _faults(tmp_path, monkeypatch, "--fault-point", "source.before_release",
                             "--fault-skip", "100000")  # fmt: skip
    assert rc == 1
    assert summary["fault"]["fired"] is False
    assert summary["fault"]["how"] == "SIGKILL (failpoint source.before_release did not fire)"


@pytest.mark.slow
@pytest.mark.parametrize("stop_s", [1.0, 9.0])
def test_fault_stop_prefill_then_resume(tmp_path: Path, monkeypatch: Any, stop_s: float) -> None:
    """Prefill SIGSTOPped, then SIGCONT: no restart, requests wait and are answered. The
    control: stopped past the probes' timeout (5 s), probes go unanswered: no_hang FAILs.
    (CI once saw a 2 s stop last 3 s, which pushed requests past 5 s. 9 s, not 7: a probe
    whose load decode gave up on after its 3 s pull timeout, then the next one sent at
    3 s, answered at 7 s, under 5 s: none went unanswered.)"""
    monkeypatch.setenv("FAKE_KV_LEASE", "2")  # the stale load's blocks, if never pulled
    rc, summary, out = _faults(tmp_path, monkeypatch, "--fault-action", "stop",
                               "--stop-seconds", str(stop_s))  # fmt: skip
    events = _events(summary)
    order = ["checks before the load", "load start", "fault", "victim resumed",
             "victim rejoined"]
    assert [e for e in events if e in order] == order
    assert summary["fault"]["how"] == "SIGSTOP" and "victim restarted" not in events
    at = {e["event"]: e["time"] for e in summary["events"]}
    # The stop lasts what was asked, not that plus the driver's blocked scrapes of the victim.
    assert stop_s - 0.2 < at["victim resumed"] - at["fault"] < stop_s + 1.0
    with tarfile.open(out / "raw.tar.gz") as tar:
        assert "raw/logs/ours/prefill0-restarted.log" not in tar.getnames()
    if stop_s < 5:
        assert rc == 0, summary["verdicts"]
        # Decode's pull waits out the stop, then loads (or recomputes if the record lapsed).
        assert summary["verdicts"]["survivor_kept_serving"]["stale_load"]["status"] == 200
    else:
        assert rc == 1 and _failed(summary) == ["no_hang"]
        assert summary["verdicts"]["no_hang"]["probes_without_answer"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("bad_kv", [False, True])
def test_fault_free_run_is_judged_as_a_fault_run(tmp_path: Path, monkeypatch: Any,
                                                 bad_kv: bool) -> None:  # fmt: skip
    """``--fault-action none`` (the fault matrix's throughput reference and small-pool case):
    the same load, checks and verdicts without a fault. The control: a decode reporting a
    verify_kv failure fails no_wrong_kv, and only it."""
    if bad_kv:
        monkeypatch.setenv("FAKE_VERIFY_FAILURES", "1")
    rc, summary, _ = _faults(tmp_path, monkeypatch, "--fault-action", "none")
    order = ["checks before the load", "load start", "fault", "victim resumed",
             "victim rejoined", "checks after recovery", "kv usage zero on every engine"]
    assert [e for e in _events(summary) if e in order] == order
    assert summary["fault"]["how"] == "none (fault-free run)"
    assert "victim restarted" not in _events(summary)
    if bad_kv:
        assert rc == 1 and _failed(summary) == ["no_wrong_kv"]
        return
    assert rc == 0, summary["verdicts"]
    m = summary["measured"]
    assert (m["completed"], m["failed"], m["local_loads"]) == (40, 0, 0)  # 5 req/s for 8 s
    assert m["output_throughput"] > 0
    assert summary["verdicts"]["no_wrong_kv"]["verified_loads"] >= 40


@pytest.mark.slow
def test_fault_flood_prefill_side_channel(tmp_path: Path, monkeypatch: Any) -> None:
    """A client without the secret floods prefill's side channel (the fake prefill has none:
    every flood request finds the port closed); no restart, the run goes on."""
    rc, summary, _ = _faults(tmp_path, monkeypatch, "--fault-action", "flood",
                             "--stop-seconds", "1")  # fmt: skip
    events = _events(summary)
    order = ["load start", "fault", "victim resumed"]
    assert [e for e in events if e in order] == order and "victim restarted" not in events
    assert summary["fault"]["how"].startswith("side-channel flood on port ")
    flood = next(e for e in summary["events"] if e["event"] == "flood ended")
    assert sum(flood["answers"].values()) > 0 and "ok" not in flood["answers"]
    assert rc == 0, summary["verdicts"]


@pytest.mark.slow
@pytest.mark.parametrize("lease", [True, False])
def test_fault_decode_exits_prefill_lease_frees(tmp_path: Path, monkeypatch: Any,
                                                lease: bool) -> None:  # fmt: skip
    """Decode exits at sink.read_posted (before its pull: prefill still holds the record);
    prefill's lease frees it. The control: no lease and a decode reporting a verify_kv
    failure: kv_usage_zero and no_wrong_kv FAIL."""
    if lease:
        monkeypatch.setenv("FAKE_KV_LEASE", "2")
    else:
        monkeypatch.setenv("FAKE_VERIFY_FAILURES", "1")
    rc, summary, _ = _faults(tmp_path, monkeypatch, "--fault-victim", "decode",
                             "--fault-point", "sink.read_posted", "--kill-after", "30",
                             "--drain-timeout", "4")  # fmt: skip
    events = _events(summary)
    order = ["fault", "victim restarted", "victim rejoined"]
    assert [e for e in events if e in order] == order
    f = summary["fault"]
    assert (f["victim"], f["engine"], f["survivor"]) == ("decode", "decode0", "prefill0")
    v = summary["verdicts"]
    assert v["survivor_kept_serving"]["direct_probes_ok"].split("/")[0] != "0"
    if lease:
        assert rc == 0, summary["verdicts"]
        assert summary["measured"]["usage_after_drain"] == {"prefill0": 0.0, "decode0": 0.0}
    else:
        assert rc == 1 and _failed(summary) == ["kv_usage_zero", "no_wrong_kv"]
        assert summary["measured"]["usage_after_drain"]["prefill0"] > 0  # leaked
        assert v["no_wrong_kv"]["verify_failures"] >= 1


@pytest.mark.slow
@pytest.mark.parametrize("lease", [True, False])
def test_fault_decode_never_comes_prefill_lease_frees(tmp_path: Path, monkeypatch: Any,
                                                      lease: bool) -> None:  # fmt: skip
    """Our proxy drops the decode leg of 4 requests under load (``--fault-action drop``):
    each fails 503 naming why, prefill holds their KV until its lease ends. The control:
    no lease, and kv_usage_zero FAILs (prefill leaked what it held)."""
    if lease:
        monkeypatch.setenv("FAKE_KV_LEASE", "2")
    rc, summary, out = _faults(tmp_path, monkeypatch, "--fault-victim", "decode",
                               "--fault-action", "drop", "--stop-seconds", "0.8",
                               "--drain-timeout", "4")  # fmt: skip
    events = _events(summary)
    order = ["checks before the load", "load start", "fault", "victim resumed",
             "victim rejoined"]
    assert [e for e in events if e in order] == order and "victim restarted" not in events
    f = summary["fault"]
    assert (f["victim"], f["survivor"], f["how"]) == (
        "decode", "prefill0", "proxy drops the decode leg of 4 requests")
    resumed = next(e for e in summary["events"] if e["event"] == "victim resumed")
    assert resumed["dropped"] == 4
    deps = json.loads(_member(out, "raw/deployments.json"))
    assert "KVSHARE_FAILPOINTS" not in str(deps)  # engines unarmed; the proxy is the front
    failed = summary["bench"]["failed"] + sum(
        p["status"] == 503 for p in json.loads(_member(out, "raw/faults.json"))["probes"])
    assert failed == 4 and summary["bench"]["failed"] > 0
    assert all("decode leg not sent" in e for e in summary["bench_errors"])
    if lease:
        assert rc == 0, summary["verdicts"]
        assert summary["measured"]["usage_after_drain"] == {"prefill0": 0.0, "decode0": 0.0}
    else:
        assert rc == 1 and _failed(summary) == ["kv_usage_zero"]
        assert summary["measured"]["usage_after_drain"]["prefill0"] > 0  # leaked


def _member(out: Path, name: str) -> str:
    with tarfile.open(out / "raw.tar.gz") as tar:
        return tar.extractfile(name).read().decode()
