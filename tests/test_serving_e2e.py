"""bench_serving.py end to end on CPU: fake vLLM servers, the bench worker with a stand-in
benchmark (vLLM's takes a minute to import on this host), the real vllm-router in front of
1 prefill x 2 decodes, and the fault mode (prefill SIGKILLed under load, restarted)."""

from __future__ import annotations

import json
import shlex
import tarfile
from pathlib import Path
from typing import Any

import pytest

from benchmarks.gpu import bench_serving as bs
from kvshare_connector.toolkit.launcher import vllm_router_available
from kvshare_connector.toolkit.procs import free_port_run, pick_free_port

ROOT = Path(__file__).resolve().parent.parent

FAKE = ROOT / "tests" / "support" / "fake_vllm_server.py"
FAKE_CMD = (
    f"{{python}} {shlex.quote(str(FAKE))} {{model}} --role {{role}} --host {{host}} --port {{port}}"
)
PACKAGED = ROOT / "kvshare_connector" / "devtools" / "models" / "g4tiny.json"

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


@pytest.mark.slow
def test_fault_mode_kills_and_restarts_prefill(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("FAKE_DECODE_LOCAL", "1")  # decode serves requests without KV params
    out = tmp_path / "out"
    rc = bs.main(
        ["--out", str(out), *_common(tmp_path, monkeypatch), "--mode", "faults",
         "--fault-rate", "5", "--load-seconds", "8", "--kill-after", "2", "--restart-after",
         "0.5", "--concurrency", "4", "--drain-timeout", "10", "--probe-timeout", "5",
         "--sample-interval", "0.3", "--rejoin-timeout", "30"]
    )  # fmt: skip
    summary = json.loads((out / "faults.json").read_text())
    assert rc == 0, summary["verdicts"]
    events = [e["event"] for e in summary["events"] if e["event"] != "stale load answered"]
    assert events[:4] == ["load start", "prefill killed", "prefill restarted", "prefill rejoined"]
    assert "kv usage zero on every engine" in events
    v = summary["verdicts"]
    kept = v["decode_kept_serving"]
    ok, n = map(int, kept["direct_decode_probes_ok"].split("/"))
    assert ok == n > 0
    assert kept["stale_load"]["status"] == 400  # the fake decode cannot pull from a dead prefill
    assert v["prefill_rejoined"]["checks_after"] == "8/8"
    assert v["connector_series_live"]["decode"]["read_seconds_count"] > 0
    # The outage shows: requests failed (503 from the proxy) while prefill was down.
    assert summary["bench"]["failed"] > 0 and any("503" in e for e in summary["bench_errors"])
    text = (out / "faults.md").read_text()
    assert "| prefill_rejoined | PASS |" in text and "prefill killed" in text
    with tarfile.open(out / "raw.tar.gz") as tar:
        assert "raw/logs/ours/prefill0-restarted.log" in tar.getnames()
