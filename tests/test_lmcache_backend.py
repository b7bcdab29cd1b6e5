"""The LMCache backend with LMCache 0.5.6's real engine, storage backends and ``lm://`` server.

Prefill and decode engines hold vLLM's own KV objects (``cpu_stack``) in different memory
layouts and block ids; KV goes prefill blocks -> LMCache (an ``lm://`` server on
127.0.0.1, started here) -> decode blocks, and is checked through memory with
``kvcheck`` on every layer, sharers through their alias.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvshare_connector.toolkit.procs import pick_free_port

from .support.lmcache_util import (
    QUIET_ENV,
    build,
    config,
    drop_outside_windows,
    full_tables,
    held,
    prompt,
    quiet_lmcache,
    running_lm_server,
    token_bytes,
    window_first_block,
)

quiet_lmcache()
pytest.importorskip("lmcache", reason="LMCache is an optional extra: pip install .[lmcache]")

from kvshare_connector.backends.lmcache.config import LMCacheBackendConfig  # noqa: E402
from kvshare_connector.backends.lmcache.errors import (  # noqa: E402
    HashSeedMismatch,
    LMCacheConfigError,
    LMCacheLoadError,
    LMCacheStoreError,
)
from kvshare_connector.backends.lmcache.rows import (  # noqa: E402
    lmcache_v1_bytes_per_token,
    owner_bytes_per_token,
    streams_of,
)
from kvshare_connector.backends.lmcache.store import LMCacheStore  # noqa: E402
from kvshare_connector.common.child_process import Child  # noqa: E402
from kvshare_connector.demo import kvcheck  # noqa: E402
from kvshare_connector.layout.matching import LayoutMismatch  # noqa: E402

from .support.blockutil import zero_regions  # noqa: E402
from .support.lmcache_peer import STORED  # noqa: E402

MODELS = ("g4tiny", "g4uniform", "gemma4_e2b_shape")
REPO = str(Path(__file__).resolve().parents[1])


@pytest.fixture(scope="module", autouse=True)
def hash_seed():
    """LMCache's hash chain starts from PYTHONHASHSEED: both sides share it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONHASHSEED", "0")
        yield


@pytest.fixture(scope="module")
def lm_server():
    """LMCache's own ``lm://`` server on 127.0.0.1, stopped when the module ends."""
    with running_lm_server() as url:
        yield url


@pytest.fixture(scope="module", autouse=True)
def peer(lm_server):
    """A prefill *process* that stores one g4tiny request (starts with the module and runs
    while the other tests do)."""
    child = Child(
        [
            "-m",
            "tests.support.lmcache_peer",
            "--url",
            lm_server,
            "--tokens",
            "608",
            "--first",
            "90001",
            "--seed",
            "11",
        ],
        env={**QUIET_ENV, "PYTHONHASHSEED": "0"},
        cwd=REPO,
    )
    try:
        yield child
    finally:
        child.kill()


@pytest.fixture
def backends():
    """Backends made by a test, closed after it."""
    made: list[LMCacheStore] = []

    def make(cfg, model: str, layout: str, kv_mib: int = 32, tag: str | None = None):
        _, topology, tensors = build(model, layout, kv_mib)
        backend = LMCacheStore(cfg, topology, tensors, tag or model, engine_id=layout)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def decode_tables(topology, n: int, seed: int) -> list[list[int]]:
    """Decode's tables after allocation: sliding groups hold only the window's blocks."""
    return drop_outside_windows(topology, full_tables(topology, n, seed), n)


# ---- configuration ------------------------------------------------------------------------


def test_config_is_parsed_and_passed_to_lmcache():
    cfg = LMCacheBackendConfig.from_extra_config(
        {
            "backend": "lmcache",
            "lmcache": {
                "remote_url": "lm://127.0.0.1:65432",
                "chunk_size": 128,
                "max_local_cpu_size_gb": 1,
                "min_retrieve_tokens": 4,  # any other LMCache option passes through
            },
        }
    )
    assert (cfg.remote_url, cfg.chunk_size, cfg.max_local_cpu_size_gb) == (
        "lm://127.0.0.1:65432",
        128,
        1.0,
    )
    engine_cfg = cfg.engine_config(0.25)
    assert engine_cfg.chunk_size == 128 and engine_cfg.save_unfull_chunk is True
    assert engine_cfg.max_local_cpu_size == 0.25 and engine_cfg.min_retrieve_tokens == 4
    assert engine_cfg.remote_url == "lm://127.0.0.1:65432"
    assert engine_cfg.pre_caching_hash_algorithm == "sha256_cbor"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, 'expected "lmcache"'),
        ({"backend": "lmcache", "lmcache": [1]}, "must be an object"),
        ({"backend": "lmcache", "lmcache": {"chunksize": 256}}, "did you mean chunk_size"),
        ({"backend": "lmcache", "lmcache": {"use_layerwise": True}}, "lmcache.use_layerwise"),
        ({"backend": "lmcache", "lmcache": {"enable_pd": True}}, "lmcache.enable_pd"),
        ({"backend": "lmcache", "lmcache": {"max_local_cpu_size": 2}}, "max_local_cpu_size_gb"),
        ({"backend": "lmcache", "lmcache": {"chunk_size": "256"}}, "lmcache.chunk_size: expected"),
        ({"backend": "lmcache", "lmcache": {"chunk_size": 0}}, "lmcache.chunk_size"),
        ({"backend": "lmcache", "lmcache": {"local_cpu": "yes"}}, "lmcache.local_cpu"),
        ({"backend": "lmcache", "lmcache": {"remote_url": "127.0.0.1:1"}}, "scheme://host:port"),
        ({"backend": "lmcache", "lmcache": {"remote_url": "lm://host"}}, "needs a host and a port"),
        ({"backend": "lmcache", "lmcache": {"local_cpu": False}}, "nowhere to store"),
        ({"backend": "lmcache", "lmcache": {"model_tag": "a@b"}}, "lmcache.model_tag"),
        ({"backend": "lmcache", "lmcache": {"remote_serde": "cachegen"}}, "only 'naive'"),
        ({"backend": "lmcache", "lmcache": {"max_local_cpu_size_gb": 0}}, "must be > 0"),
    ],
)
def test_config_errors_name_the_option(extra, message):
    with pytest.raises(LMCacheConfigError, match=message):
        LMCacheBackendConfig.from_extra_config(extra)


def test_remote_needs_hash_seed_and_a_reachable_server(backends, monkeypatch):
    url = f"lm://127.0.0.1:{pick_free_port()}"  # nothing listens there
    monkeypatch.delenv("PYTHONHASHSEED")
    with pytest.raises(LMCacheConfigError, match="PYTHONHASHSEED is not set"):
        backends(config(url), "g4uniform", "per_layer")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    with pytest.raises(LMCacheConfigError, match="cannot connect"):
        backends(config(url), "g4uniform", "per_layer")


# ---- owner selection ----------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_only_owner_layers_are_stored_per_token(model):
    stack, topology, _ = build(model, "per_layer")
    owners = {
        name
        for group in stack.kv_cache_config.kv_cache_groups
        for name in group.layer_names
        if name not in stack.sharing
    }
    specs = {
        name: group.kv_cache_spec
        for group in stack.kv_cache_config.kv_cache_groups
        for name in group.layer_names
    }
    expected = sum(
        2 * specs[n].num_kv_heads * specs[n].head_size * specs[n].dtype.itemsize for n in owners
    )
    streams = streams_of(topology)
    columns = [o.name for s in streams for o in s.owners]
    assert sorted(columns) == sorted(owners) and not set(columns) & set(stack.sharing)
    assert owner_bytes_per_token(topology) == expected
    # LMCache's own connector: 2 x all layers x heads x one head size x dtype size.
    model_config = stack.vllm_config.model_config
    theirs = lmcache_v1_bytes_per_token(model_config, stack.vllm_config.parallel_config)
    layers = model_config.get_num_layers(stack.vllm_config.parallel_config)
    assert layers == len(owners) + len(stack.sharing)
    assert expected < theirs
    if len({s.head_size for s in specs.values()}) == 1:  # one head size: only the sharers
        assert theirs * len(owners) == expected * layers


def test_stored_rows_are_the_owners_token_bytes(backends):
    """What LMCache holds, read back from its store, equals each owner's token bytes."""
    n = 600
    stack, topology, _ = build("g4tiny", "per_layer")
    backend = backends(config(), "g4tiny", "per_layer")  # local CPU only
    tables = full_tables(topology, n, seed=3)
    kvcheck.fill(stack.kv_caches, topology, tables, seed=5)
    tokens = prompt(n, 17)
    receipt = backend.store("rows", tokens, drop_outside_windows(topology, tables, n))
    assert backend.is_stored(receipt)
    stored_bytes = 0
    for stream in backend.streams:
        engine = backend.engines[stream.name]
        chunk = backend.config.chunk_size
        begin = min(receipt.stored_from[g] for g in stream.groups) // chunk * chunk
        for start, end, key in engine.token_database.process_tokens(tokens):
            if start < begin:
                continue
            obj = engine.storage_manager.get(key)
            assert obj is not None, (stream.name, start)
            try:
                rows = obj.tensor.view(-1, stream.width)[: end - start]
                assert rows.shape == (end - start, stream.width)
                stored_bytes += obj.get_size()
                positions = np.arange(start, end)
                for owner in stream.owners:
                    got = rows[:, owner.offset : owner.offset + owner.width]
                    keep = positions >= receipt.stored_from[owner.group]
                    want = token_bytes(
                        stack.kv_caches, topology, owner.name, tables[owner.group], positions[keep]
                    )
                    assert bool((got[keep] == want).all()), (owner.name, start)
                    assert not bool(got[~keep].any())  # positions no longer needed: zeros
            finally:
                obj.ref_count_down()
    assert stored_bytes == receipt.nbytes
    # Full attention is stored for every token, sliding windows only from their window.
    full = next(s for s in backend.streams if s.window is None)
    assert receipt.nbytes < owner_bytes_per_token(topology) * n
    assert receipt.nbytes >= full.width * n

    # Local CPU only (one engine, kv_both): the same KV loads back into other blocks.
    used = {b for t in tables for b in t}
    free = iter(b for b in range(1, topology.num_blocks) if b not in used)
    other = [[next(free) for _ in t] for t in tables]
    other = drop_outside_windows(topology, other, n)
    backend.load("rows-back", tokens, other)
    ids, firsts = held(other)
    last = [len(t) - 1 for t in ids]  # the prompt ends inside these blocks: compare tokens
    assert (
        kvcheck.mismatches(
            stack.kv_caches, topology, [t[:-1] for t in ids], first_positions=firsts, seed=5
        )
        == []
    )
    for name, owner in topology.owners.items():
        g = owner.group
        tail = np.arange((firsts[g] + last[g]) * owner.spec.block_size, n)
        got = token_bytes(stack.kv_caches, topology, name, other[g], tail)
        want = token_bytes(stack.kv_caches, topology, name, tables[g], tail)
        assert bool((got == want).all()), name


# ---- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "prefill_layout", "decode_layout"),
    [
        ("g4tiny", "per_layer", "kvcached_contiguous"),
        ("g4uniform", "cross_layer", "per_layer"),
        ("gemma4_e2b_shape", "kvcached_contiguous", "per_layer"),
    ],
)
def test_round_trip_between_engines(lm_server, backends, model, prefill_layout, decode_layout):
    n = 608  # whole blocks, so kvcheck can compare whole blocks
    p_stack, p_topo, _ = build(model, prefill_layout)
    d_stack, d_topo, _ = build(model, decode_layout, kv_mib=40)
    prefill = backends(config(lm_server), model, prefill_layout)
    decode = backends(config(lm_server), model, decode_layout, kv_mib=40)
    zero_regions(d_topo)

    p_tables = full_tables(p_topo, n, seed=21)
    kvcheck.fill(p_stack.kv_caches, p_topo, p_tables)
    tokens = prompt(n, 1000 * MODELS.index(model) + 1)
    receipt = prefill.store("p", tokens, drop_outside_windows(p_topo, p_tables, n))
    prefill.wait_stored(receipt, timeout_s=20)

    d_tables = decode_tables(d_topo, n, seed=22)
    assert d_tables != p_tables
    loaded = decode.load("d", tokens, d_tables)
    assert loaded.num_tokens == n and loaded.nbytes == receipt.nbytes

    ids, firsts = held(d_tables)
    assert firsts == [window_first_block(d_topo, g, n) for g in range(len(d_tables))]
    # Every layer, sharers through their alias, holds prefill's KV; nothing else changed.
    assert set(d_stack.kv_caches) == set(d_topo.owners) | set(d_topo.sharers)
    assert kvcheck.mismatches(d_stack.kv_caches, d_topo, ids, first_positions=firsts) == []
    assert kvcheck.nonzero_blocks_outside(d_stack.kv_caches, d_topo, ids) == []

    # Negative control: the same check catches KV loaded into the wrong blocks.
    zero_regions(d_topo)
    swapped = [t[:f] + t[f:][::-1] for t, f in zip(d_tables, firsts, strict=True)]
    decode.load("d-wrong", tokens, swapped)
    assert kvcheck.mismatches(d_stack.kv_caches, d_topo, ids, first_positions=firsts)


def test_partial_block_and_local_prefix(lm_server, backends):
    """A prompt ending inside a block, loaded after a 48-token local prefix-cache hit:
    exactly positions [48, n) change, in every group that still needs them."""
    n, local = 600, 48
    p_stack, p_topo, _ = build("g4tiny", "per_layer")
    d_stack, d_topo, _ = build("g4tiny", "kvcached_contiguous", kv_mib=40)
    prefill = backends(config(lm_server), "g4tiny", "per_layer")
    decode = backends(config(lm_server), "g4tiny", "kvcached_contiguous", kv_mib=40)
    zero_regions(d_topo)
    p_tables = full_tables(p_topo, n, seed=31)
    kvcheck.fill(p_stack.kv_caches, p_topo, p_tables, seed=9)
    tokens = prompt(n, 4242)
    receipt = prefill.store("pp", tokens, p_tables)  # all blocks still held
    prefill.wait_stored(receipt, timeout_s=20)
    d_tables = decode_tables(d_topo, n, seed=32)
    decode.load("dp", tokens, d_tables, num_computed_tokens=local)

    positions = np.arange(n)
    for name, owner in d_topo.owners.items():
        group = owner.group
        start = max(local, receipt.stored_from[group])
        bs = owner.spec.block_size
        held_from = window_first_block(d_topo, group, n) * bs
        mine = positions[positions >= held_from]
        got = token_bytes(d_stack.kv_caches, d_topo, name, d_tables[group], mine)
        want = token_bytes(p_stack.kv_caches, p_topo, name, p_tables[group], mine)
        loaded = mine >= start
        assert bool((got[loaded] == want[loaded]).all()), name
        assert not bool(got[~loaded].any()), name  # the local prefix was left alone
        tail = np.arange(n, -(-n // bs) * bs)  # rest of the last block: untouched
        if tail.size:
            assert not bool(
                token_bytes(d_stack.kv_caches, d_topo, name, d_tables[group], tail).any()
            )


# ---- checks and errors --------------------------------------------------------------------


def test_layout_mismatch_names_the_differences(lm_server, backends):
    n = 320
    _, p_topo, _ = build("g4tiny", "per_layer")
    d_stack, d_topo, _ = build("g4uniform", "per_layer")
    prefill = backends(config(lm_server), "g4tiny", "per_layer")
    # Same model tag, different model: the header is found and explains the difference.
    decode = backends(config(lm_server), "g4uniform", "per_layer", tag="g4tiny")
    tokens = prompt(n, 777)
    p_tables = full_tables(p_topo, n, seed=41)
    receipt = prefill.store("lm", tokens, p_tables)
    prefill.wait_stored(receipt, timeout_s=20)
    zero_regions(d_topo)
    with pytest.raises(LayoutMismatch) as caught:
        decode.load("lm-d", tokens, full_tables(d_topo, n, seed=42))
    text = str(caught.value)
    assert f"KV cache group count: local {len(d_topo.groups)}, remote {len(p_topo.groups)}" in text
    assert any("sliding_window" in d or "kind" in d for d in caught.value.differences)
    assert not any(region_has_data(r) for r in d_topo.regions)  # nothing was written

    # Once an engine with decode's layout stored the same prompt, decode loads its KV.
    other = backends(config(lm_server), "g4uniform", "cross_layer", tag="g4tiny")
    o_stack, o_topo, _ = build("g4uniform", "cross_layer")
    o_tables = full_tables(o_topo, n, seed=43)
    kvcheck.fill(o_stack.kv_caches, o_topo, o_tables)
    other.wait_stored(other.store("lm2", tokens, o_tables), timeout_s=20)
    d_tables = full_tables(d_topo, n, seed=42)
    decode.load("lm-d2", tokens, d_tables)
    assert kvcheck.mismatches(d_stack.kv_caches, d_topo, d_tables) == []


def region_has_data(region) -> bool:
    import ctypes

    data = (ctypes.c_ubyte * region.nbytes).from_address(region.addr)
    return bool(np.frombuffer(data, dtype=np.uint8).any())


def test_hash_seed_mismatch_is_reported(lm_server, backends, monkeypatch):
    n = 300
    _, p_topo, _ = build("g4uniform", "per_layer")
    prefill = backends(config(lm_server), "g4uniform", "per_layer")
    tokens = prompt(n, 31337)
    receipt = prefill.store("hs", tokens, full_tables(p_topo, n, seed=51))
    prefill.wait_stored(receipt, timeout_s=20)
    prefill.close()
    # A decode engine started with another PYTHONHASHSEED hashes the same tokens to other
    # LMCache keys: without the check every lookup would silently miss.
    monkeypatch.setenv("PYTHONHASHSEED", "1")
    _, d_topo, _ = build("g4uniform", "cross_layer")
    decode = backends(config(lm_server), "g4uniform", "cross_layer")
    with pytest.raises(HashSeedMismatch, match="PYTHONHASHSEED"):
        decode.load("hs-d", tokens, full_tables(d_topo, n, seed=52), timeout_s=1)


def test_load_and_store_errors(lm_server, backends):
    n = 400
    _, p_topo, _ = build("g4tiny", "per_layer")
    prefill = backends(config(lm_server), "g4tiny", "per_layer")
    decode = backends(config(lm_server), "g4tiny", "kvcached_contiguous", kv_mib=40)
    _, d_topo, _ = build("g4tiny", "kvcached_contiguous", kv_mib=40)
    tokens = prompt(n, 555)
    p_tables = full_tables(p_topo, n, seed=61)
    d_tables = decode_tables(d_topo, n, seed=62)

    # Nothing stored for these tokens: a miss after the bounded wait.
    with pytest.raises(LMCacheLoadError, match="holds no KV for these 400 token"):
        decode.load("miss", tokens, d_tables, timeout_s=0.3)

    # Tables vLLM would never produce are refused before anything is copied.
    broken = [list(t) for t in p_tables]
    broken[0][2] = 0  # a hole after held blocks
    with pytest.raises(LMCacheStoreError, match="null block"):
        prefill.store("bad", tokens, broken)
    with pytest.raises(LMCacheStoreError, match="no longer holds"):
        full = next(g.index for g in p_topo.groups if g.spec.sliding_window is None)
        prefill.store(
            "bad", tokens, [[0, *t[1:]] if g == full else t for g, t in enumerate(p_tables)]
        )
    with pytest.raises(LMCacheStoreError, match="block ids cover 1"):
        prefill.store("bad", tokens, p_tables[:1])

    # Prefill kept less of a sliding window than decode needs: refused with positions.
    short = [list(t) for t in drop_outside_windows(p_topo, p_tables, n)]
    sliding = next(g.index for g in p_topo.groups if g.spec.sliding_window)
    first = window_first_block(p_topo, sliding, n)
    short[sliding][first] = 0
    receipt = prefill.store("short", tokens, short)
    prefill.wait_stored(receipt, timeout_s=20)
    with pytest.raises(LMCacheLoadError, match=f"prefill stored group {sliding} from"):
        decode.load("short-d", tokens, d_tables)
    with pytest.raises(LMCacheLoadError, match="needed"):
        decode.load("short-d", tokens, [t[:1] for t in d_tables])
    with pytest.raises(LMCacheLoadError, match="num_computed_tokens"):
        decode.load("short-d", tokens, d_tables, num_computed_tokens=n + 1)


def test_two_processes_through_lm_server(peer, lm_server, backends):
    """Prefill in another process (per-layer, its own block ids), decode here (kvcached)."""
    info = peer.wait_json(STORED, 180)
    n = info["tokens"]
    d_stack, d_topo, _ = build("g4tiny", "kvcached_contiguous", kv_mib=40)
    decode = backends(config(lm_server), "g4tiny", "kvcached_contiguous", kv_mib=40)
    zero_regions(d_topo)
    d_tables = decode_tables(d_topo, n, seed=71)
    loaded = decode.load("x", prompt(n, 90001), d_tables)
    assert loaded.nbytes == info["bytes"]
    ids, firsts = held(d_tables)
    assert kvcheck.mismatches(d_stack.kv_caches, d_topo, ids, first_positions=firsts) == []
    assert kvcheck.nonzero_blocks_outside(d_stack.kv_caches, d_topo, ids) == []
    # Negative control: other tokens (one changed) are a miss, not someone else's KV.
    other = prompt(n, 90001)
    other[-1] += 1
    with pytest.raises(LMCacheLoadError, match="holds no KV"):
        decode.load("x2", other, d_tables, timeout_s=0.3)
    assert os.environ["PYTHONHASHSEED"] == "0"
