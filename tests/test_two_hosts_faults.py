"""Failures between two hosts (issue 48 item 5), with the engines of the product path: vLLM's
scheduler and KVShareConnector over vLLM-made KV (``engine_sim``), prefill on one network
namespace host, decode on the other, NIXL agents in their own processes, UCX over the link.

The link is cut while decode's READs are in flight and brought back: those requests fail
with a named error and decode computes them itself (vLLM's ``recompute``), no KV that
differs from prefill's is ever used, prefill holds nothing once the lease is over, and a
request after the link is back loads through PD again. A decode host that restarts (killed
with a READ posted) with the same address is served again.
"""

from __future__ import annotations

import re
import secrets
import time
from typing import Any

import pytest

from .support.host_engine import DECODED, POSTED, PREFILLED, READY, STATE, HostEngine
from .support.two_hosts import two_hosts

PORT = 5600
LEASE_S = 6.0
TRANSFER_S = 4.0  # decode's bound on a READ
NAMED = re.compile(r"KV load failed: [A-Z]\w+: ")  # kv_load_error: the exception's name


@pytest.fixture(scope="module")
def pair():
    with two_hosts() as made:
        # A request (13 MB) is far more than the sockets hold (2 x 2 x 512 KiB): a READ cut
        # mid-way cannot finish on bytes already in flight.
        made.cap_tcp_buffers(512 << 10)
        yield made


def _engines(pair: Any) -> tuple[dict[str, str], dict, dict]:
    secret = secrets.token_hex(16)
    env = {"KVSHARE_SIDE_CHANNEL_SECRET": secret}
    prefill = {"kv_lease_duration": LEASE_S, "staging_mib": 64}
    decode = {
        "allowed_prefills": [f"{pair.prefill}:{PORT}"],
        "transfer_timeout_s": TRANSFER_S,
        "handshake_timeout_s": 3.0,
        "staging_mib": 64,
        "nixl_progress_thread": False,  # a paused decode moves no byte (host_engine.py)
    }
    return env, prefill, decode


def _decode(decode: HostEngine, prefill: HostEngine, ids: list[int], **kw: Any) -> dict:
    params = prefill.ask(PREFILLED, op="prefill", ids=ids)
    return decode.ask(DECODED, 120, op="decode", ids=ids, params=params, **kw)


def _held_until_empty(prefill: HostEngine, timeout_s: float) -> tuple[dict, float]:
    """Prefill's state once it holds nothing (or at ``timeout_s``), and when."""
    start = time.monotonic()
    while True:
        state = prefill.ask(STATE, op="state")
        if not state["held"] or time.monotonic() - start > timeout_s:
            return state, time.monotonic() - start
        time.sleep(0.5)


def test_link_cut_mid_read_and_decode_restart(pair):
    env, prefill_extra, decode_extra = _engines(pair)
    prefill_env = {**env, "VLLM_NIXL_SIDE_CHANNEL_HOST": pair.prefill}
    prefill = HostEngine(pair, "prefill", PORT, prefill_extra, prefill_env)
    decode = HostEngine(pair, "decode", PORT, decode_extra, env)
    restarted = None
    try:
        prefill.wait(READY, 300)
        decode.wait(READY, 300)
        # Through PD first: handshake, lane probe, byte-exact load.
        first = _decode(decode, prefill, [0])
        assert first["d0"]["loaded"] and first["d0"]["mismatches"] == [], first

        # READs posted, decode paused (its bytes wait in the sockets), then the link is cut.
        params = prefill.ask(PREFILLED, op="prefill", ids=[1, 2])
        decode.send(op="decode", ids=[1, 2], params=params, pause=True)
        decode.wait(POSTED, 60)
        pair.cut()
        cut_at = time.monotonic()
        decode.send(op="resume")
        cut = decode.wait(DECODED, 120)
        print("cut:", {r: (v["error"], round(v["seconds"], 2)) for r, v in cut.items()})
        for rid, result in cut.items():  # failed, saying why, and computed by decode itself
            assert NAMED.match(result["error"] or "") and result["computed"], (rid, result)
        pair.mend()
        mended_at = time.monotonic()
        print(f"link down {mended_at - cut_at:.1f} s")

        # The next requests after the link is back: through PD again.
        tries, through = 0, None
        while through is None and time.monotonic() - mended_at < 60:
            tries += 1
            result = _decode(decode, prefill, [10 + tries])[f"d{10 + tries}"]
            assert result["mismatches"] == [], result
            if result["loaded"]:
                through = time.monotonic() - mended_at
            else:
                print("after mend:", result["error"])
                time.sleep(0.2)
        assert through is not None, "no request went through PD within 60 s of the link's return"
        print(f"first request through PD {through:.2f} s after the link came back ({tries} tries)")

        state, waited = _held_until_empty(prefill, LEASE_S + TRANSFER_S + 30)
        assert state["held"] == [] and state["free_blocks"] == state["total_blocks"], state
        print(f"prefill held nothing {waited:.1f} s later")

        # Decode's host dies with a READ posted and comes back on the same address.
        params = prefill.ask(PREFILLED, op="prefill", ids=[30])
        decode.send(op="decode", ids=[30], params=params, pause=True)
        decode.wait(POSTED, 60)
        decode.kill()
        killed_at = time.monotonic()
        restarted = HostEngine(pair, "decode", PORT, decode_extra, env)
        restarted.wait(READY, 300)
        ready_at = time.monotonic()
        again = _decode(restarted, prefill, [31])
        assert again["d31"]["loaded"] and again["d31"]["mismatches"] == [], again
        print(f"restarted decode: first request through PD {time.monotonic() - ready_at:.2f} s "
              "after it was ready")  # fmt: skip
        state, _ = _held_until_empty(prefill, LEASE_S + TRANSFER_S + 30)
        assert state["held"] == [] and state["free_blocks"] == state["total_blocks"], state
        print(f"prefill held nothing {time.monotonic() - killed_at:.1f} s after decode died")
    finally:
        for engine in (restarted, decode, prefill):
            if engine is not None:
                engine.stop()
