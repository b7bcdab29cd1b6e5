"""The NIXL backend advancing reads from inside the forward (``NixlWorker.nudge``, called by
vLLM's per-layer hook through ``KVShareConnector.wait_for_layer_load``): nudges alone take
a read from its order through handshake, claim, READ and landing, at most every
``layer_nudge_ms``, and not at all with 0. Real workers, real NIXL, in this process."""

from __future__ import annotations

import time

import pytest

from kvshare_connector.backends.nixl import RecvRequest
from kvshare_connector.demo.parts import requests_block_ids
from kvshare_connector.toolkit.procs import free_port_run
from kvshare_connector.transfer.wire import kv_params
from lab.tools.headcheck import fill_heads, head_mismatches

from .test_tp_backend import TOKENS, _shard, worker


def _order(prefill, base: int, topology, request_id: str):
    w, s, t = prefill
    ids = requests_block_ids(t, TOKENS, 1, 3)[0]
    fill_heads(s.kv_caches, t, _shard(w), ids, seed=5)
    w.hold({"req": ids})
    params = kv_params.remote_prefill_params(
        kv_params.kv_transfer_params(
            remote_block_ids=ids, remote_engine_id="kv_producer-tp", remote_request_id="req",
            remote_host="127.0.0.1", remote_port=base, remote_num_tokens=TOKENS,
        )
    )  # fmt: skip
    local = requests_block_ids(topology, TOKENS, 1, 9)[0]
    return RecvRequest(request_id, local, params, TOKENS, 0), local


@pytest.mark.parametrize("every_ms", [2.0, 0.0])
def test_nudges_alone_carry_a_read_to_its_end(every_ms, monkeypatch):
    base = free_port_run(2)
    prefill = worker("kv_producer", 1, 1, 0, base, 48)
    decode, stack, topology = worker("kv_consumer", 1, 1, 0, base + 10, 32,
                                     layer_nudge_ms=every_ms)  # fmt: skip
    try:
        order, local = _order(prefill, base, topology, "d-req")
        # the order only: ``start_loads`` advances once, as at a step's start
        assert decode.start_loads([order]) == {}
        advances = []
        advance = decode.sink.advance
        monkeypatch.setattr(decode.sink, "advance", lambda *a: (advances.append(1), advance(*a)))
        started = time.monotonic()
        limit = 30.0 if every_ms else 1.0  # the control: a second of nudges moves nothing
        while decode.sink.reading and time.monotonic() - started < limit:
            decode.nudge()  # what every attention layer of the forward does
            prefill[0].poll()  # prefill's engine steps meanwhile
        elapsed = time.monotonic() - started
        if not every_ms:  # the control: nothing moves between step boundaries
            assert advances == [] and decode.sink.reading
            return
        assert not decode.sink.reading, "nudges did not finish the read"
        assert 0 < len(advances) <= elapsed / (every_ms / 1e3) + 1  # throttled
        progress = decode.poll()  # the step's end reports it
        assert progress.loaded == {"d-req"} and progress.failed == {}
        compared, problems = head_mismatches(stack.kv_caches, topology, _shard(decode), local, 5)
        assert compared > 0 and problems == []
    finally:
        decode.close()
        prefill[0].close()
