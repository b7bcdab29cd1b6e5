"""The NIXL backend's worker side under TP, as the connector builds it per rank: a prefill
of two ranks (``WorkerContext`` tp_size 2, ports base + rank, packed transfer on) and a
decode of one, in this process, over NIXL. Covers what the per-rank workers add to the
transfer layer: the shard from the registered KV, the port per rank, ``ShardedSink``
behind ``NixlWorker``, and every prefill rank reporting the request sent."""

from __future__ import annotations

import time

import pytest

from kvshare_connector.backends.base import WorkerContext
from kvshare_connector.backends.nixl import NixlWorker, RecvRequest
from kvshare_connector.backends.options import ConnectorOptions
from kvshare_connector.demo.cpu_stack import build_cpu_stack, topology_of
from kvshare_connector.demo.parts import requests_block_ids
from kvshare_connector.toolkit.procs import free_port_run
from kvshare_connector.transfer.wire import kv_params
from lab.tools.headcheck import fill_heads, head_mismatches

TOKENS = 200
MODELS = {1: "gemma4_e2b_shape", 4: "gemma4_e2b_kv4"}


def worker(role: str, heads: int, tp: int, rank: int, port: int, kv_mib: int, **extra):
    count = max(heads // tp, 1)
    stack = build_cpu_stack(
        MODELS[heads], "per_layer", kv_bytes=(kv_mib << 20) * count, max_model_len=1024,
        kv_heads=count,
    )  # fmt: skip
    topology = topology_of(stack)
    options = ConnectorOptions.parse({
        "kv_lease_duration": 60, "handshake_timeout_s": 20, "transfer_timeout_s": 20,
        "staging_mib": 64, **extra,
    })  # fmt: skip
    context = WorkerContext(
        engine_id=f"{role}-tp", role=role, host="127.0.0.1", port=port + rank, model_name="m",
        options=options, tp_size=tp, tp_rank=rank, model_kv_heads=heads,
    )  # fmt: skip
    w = NixlWorker(context)
    w.start(topology, stack.kv_caches)
    return w, stack, topology


@pytest.mark.parametrize(("heads", "verify"), [(4, None), (1, None), (4, True)])
def test_prefill_tp2_to_decode_tp1_through_the_backend(heads, verify):
    """4 KV heads: decode reads head slices, which verify_kv (whole-block digests) cannot
    check: by default they are read unverified; asked for explicitly, the pairing fails.
    1 KV head: every rank holds the whole head, so the reads are verified."""
    base = free_port_run(2)
    prefill = [worker("kv_producer", heads, 2, r, base, 48) for r in range(2)]
    extra = {} if verify is None else {"verify_kv": verify}
    decode, stack, topology = worker("kv_consumer", heads, 1, 0, base + 10, 32, **extra)
    try:
        ids = requests_block_ids(prefill[0][2], TOKENS, 1, 3)[0]
        for w, s, t in prefill:
            fill_heads(s.kv_caches, t, _shard(w), ids, seed=1)
            w.hold({"req": ids})
        params = kv_params.remote_prefill_params(
            kv_params.kv_transfer_params(
                remote_block_ids=ids, remote_engine_id="kv_producer-tp", remote_request_id="req",
                remote_host="127.0.0.1", remote_port=base, remote_num_tokens=TOKENS, tp_size=2,
            )
        )  # fmt: skip
        local = requests_block_ids(topology, TOKENS, 1, 9)[0]
        assert decode.start_loads([RecvRequest("d-req", local, params, TOKENS, 0)]) == {}
        sent: list[set[str]] = [set(), set()]
        loaded, deadline, verified = set(), time.monotonic() + 60, 0
        while (not loaded or not all(sent)) and time.monotonic() < deadline:
            progress = decode.poll()
            if verify and progress.failed:  # the pairing refused, prefill freed
                assert "verify_kv digests whole blocks" in progress.failed["d-req"]
                return
            assert progress.failed == {}
            loaded |= progress.loaded
            verified += sum(r.verified for r in progress.records)
            for i, (w, _, _) in enumerate(prefill):
                sent[i] |= w.poll().sent
            time.sleep(0.002)
        assert not verify, "an explicit verify_kv let a head-sliced pairing through"
        assert loaded == {"d-req"} and sent == [{"req"}, {"req"}]
        assert (verified > 0) == (heads == 1)
        compared, problems = head_mismatches(stack.kv_caches, topology, _shard(decode), local, 1)
        assert compared > 0 and problems == []
    finally:
        for w, _, _ in [*prefill, (decode, None, None)]:
            w.close()


def _shard(w: NixlWorker):
    from kvshare_connector.transfer.decode.shards import rank_shard

    c = w.context
    topology = (w.source or w.sink).topology
    return rank_shard(topology, c.tp_size, c.tp_rank, c.model_kv_heads)
