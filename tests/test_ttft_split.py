"""lab/benchmarks/gpu/ttft_split.py: a request's TTFT split by joining the proxy's log with
decode's read log, on files laid out as a serving run writes them."""

from __future__ import annotations

import datetime
import json
from typing import Any

import pytest

from lab.benchmarks.gpu import ttft_split

T0 = 1_796_323_300.0  # wall time of the run's start (UTC)


def _stamp(wall: float) -> str:
    when = datetime.datetime.fromtimestamp(wall, tz=datetime.UTC)
    return when.strftime("%Y-%m-%d %H:%M:%S,") + f"{int(when.microsecond / 1000):03d}"


def _files(skew_s: float = 0.0) -> dict[str, bytes]:
    """Two requests of one run: prefill answers at T0+0.1 and T0+0.2 (legs 60 and 80 ms);
    decode orders each 12 ms later, claims at 3 ms, lands at 5, reports at 50."""
    proxy, reads = [], []
    for i, (answered, leg) in enumerate([(T0 + 0.1, 0.06), (T0 + 0.2, 0.08)]):
        rid = f"bench-{i:04x}-0-abcdef"
        stream_ms = 9.0  # the log line is written once decode's stream opened
        line = (f"{_stamp(answered + stream_ms / 1e3 + skew_s)} INFO kvshare_connector.toolkit."
                f"proxy: req={rid} /v1/completions prefill=http://p decode=http://d "
                f"stream=True: prefill {leg * 1e3:.1f} ms, decode stream opened {stream_ms} ms")
        proxy.append(line if i else line.replace(" /v1/completions prefill=http://p decode="
                                                 "http://d stream=True:", ""))  # an older line
        order = answered + 0.012
        timeline = {"asked": 0.001, "claimed": 0.003, "landed": 0.005, "reported": 0.05}
        reads.append({"time": order + 0.05, "request_id": f"cmpl-{rid}-0-1f2e3d4c",
                      "bytes": 1, "timeline": timeline})
    reads.append({"time": T0 + 0.3, "request_id": "cmpl-unknown-0-00", "bytes": 1,
                  "timeline": {"claimed": 0.001, "reported": 0.002}})  # not in the proxy log
    runs = [{"deployment": "ours", "input_len": 2048, "concurrency": 16, "file": "bench/r0.json",
             "start": T0, "end": T0 + 1.0, "rc": 0, "warmup": False}]
    deployments = {"ours": {"kind": "ours", "read_logs": ["reads/ours-decode0.jsonl"]},
                   "colocated": {"kind": "colocated", "read_logs": []}}
    return {
        "runs.jsonl": "".join(json.dumps(r) + "\n" for r in runs).encode(),
        "deployments.json": json.dumps(deployments).encode(),
        "bench/r0.json": json.dumps({"median_ttft_ms": 200.0}).encode(),
        "logs/ours/proxy.log": ("\n".join(proxy) + "\nINFO: unrelated\n").encode(),
        "reads/ours-decode0.jsonl": ("".join(json.dumps(r) + "\n" for r in reads)
                                     + '{"cut').encode(),
    }  # fmt: skip


def _row(text: str) -> list[str]:
    (line,) = [x for x in text.splitlines() if x.startswith("| ours |")]
    return [c.strip() for c in line.strip("|").split("|")]


def test_each_request_is_split_across_both_sides() -> None:
    row = _row(ttft_split.table(_files()))
    assert row[:3] == ["ours", "2048 x 16", "2"]
    spans: dict[str, Any] = dict(zip(ttft_split.SPANS, row[3:8], strict=True))
    assert spans["prefill leg"] == "80.0 / 80.0"  # p50 of two is the upper one here
    assert spans["prefill answered -> decode order"] == "12.0 / 12.0"
    assert spans["order -> claimed"] == "3.0 / 3.0"
    assert spans["claimed -> in place"] == "2.0 / 2.0"
    assert spans["in place -> reported"] == "45.0 / 45.0"
    assert row[8] == "200.0" and float(row[9]) == pytest.approx(200 - 80 - 12 - 3 - 2 - 45)


def test_vllm_request_ids_lead_back_to_the_proxy_s() -> None:
    assert ttft_split.proxy_id("cmpl-bench-1a2b-0-abcdef-0-1f2e3d4c") == "bench-1a2b-0-abcdef"
    assert ttft_split.proxy_id("chatcmpl-pd-9f-0-0a1b2c3d") == "pd-9f"
    assert ttft_split.proxy_id("plain") == "plain"


def test_clocks_that_disagree_are_refused() -> None:
    """The control: the same requests with the proxy's clock an hour off are not reported."""
    with pytest.raises(SystemExit, match="disagree by more than a minute"):
        ttft_split.table(_files(skew_s=3600.0))


def test_nothing_to_join_says_so() -> None:
    files = _files()
    del files["logs/ours/proxy.log"]
    assert ttft_split.table(files).startswith("no request joined")


def test_a_first_token_from_prefill_is_logged_as_prefill_answers() -> None:
    """That line is written when prefill answered: no decode time to take off."""
    line = (f"{_stamp(T0)} INFO kvshare_connector.toolkit.proxy: req=pd-1 /v1/completions "
            "prefill=http://p decode=http://d: prefill 61.5 ms, first token from prefill; "
            "prompt as 7 token ids")  # fmt: skip
    assert ttft_split.proxy_requests(line) == {"pd-1": (pytest.approx(T0), 0.0615)}
