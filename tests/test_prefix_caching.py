"""Prefix caching on, as vLLM runs it (issue 50), through vLLM's own ``Scheduler`` on both
engines, real NIXL between two processes and vLLM-made KV (``lab/tools/prefix_sim.py``).

Decode reads only the blocks past its own prefix hit in each KV cache group, never writes a
block it did not allocate for the load, and a full hit reads nothing and frees prefill's
blocks at once. Prefill's own hits are served as any other block. g4tiny has 6 KV cache
groups: 5 sliding-window (window 128, blocks of 32 tokens) and 1 full attention (blocks of
16), so a prompt's hit differs per group.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvshare_connector.toolkit.procs import pick_free_port
from lab.tools.engine_sim import READY, RESULT
from lab.tools.negative_control import OVERWRITE_HITS
from lab.tools.prefix_sim import PrefixEngine, start_prefill, tokens

ROOT = str(Path(__file__).resolve().parents[1])
DECODE_SALT = 1  # decode's own KV differs from prefill's copy: a write over it shows

A, X, Z = tokens(0, 320), tokens(5, 320), tokens(9, 320)
# prefill's prompts, computed in this order (p1 hits p0's first 224 tokens on prefill too)
PROMPTS = {
    "p0": A,  # no hit on decode: the whole prompt is read
    "p1": A[:224] + X[:96],  # shares 224 tokens (7 sliding-window blocks, 14 full) with p0
    "p2": A,  # decode's prompt is p2's and one token more (the first-token hand-off)
    "p5": A,  # the same again: now decode holds all of it in every group
    "p3": A,  # the same prompt again: vLLM recomputes its last token, the last blocks are read
    "p4": Z,  # no hit (the control of p1's bytes)
    "p6": A[:224] + X[:96],  # p1's prompt: the negative control, then a failed load
    "p8": A,  # prefill's own hit (288 of 320 tokens, shared with p0), read whole by a new decode
}


def read_log(path: Path) -> dict[str, dict[str, Any]]:
    return {r["request_id"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.fixture
def engines():
    made: list[PrefixEngine] = []

    def make(*args: Any, **kwargs: Any) -> PrefixEngine:
        made.append(PrefixEngine(*args, **kwargs))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def serve(
    tmp_path: Path, prompts: dict[str, list[int]], layout: str = "per_layer", model: str = "g4tiny"
) -> Any:
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(prompts))
    options = ("--layout", layout, "--model", model)
    return start_prefill(pick_free_port(), str(path), *options, cwd=ROOT)


def run(decode: PrefixEngine, rid: str, prompt: list[int], params: dict) -> None:
    decode.add_prompt(rid, prompt, 2, dict(params))
    decode.run_until(lambda: rid in decode.outputs)


@pytest.mark.parametrize("layout", ["per_layer"])
def test_decode_reads_only_past_its_hit_in_every_group(engines, tmp_path, layout):
    child = serve(tmp_path, PROMPTS, layout)
    try:
        ready = child.wait_json(READY, 180)["requests"]
        params = {rid: r["kv_transfer_params"] for rid, r in ready.items()}
        log = tmp_path / "reads.jsonl"
        # the control connector loads as KVShareConnector but for the request told to write
        # over its hit; "recompute": a failed load is computed locally on every release
        decode = engines(
            "g4tiny", layout, "kv_consumer", pick_free_port(), {"read_log": str(log)},
            salt=DECODE_SALT, failure_policy="recompute", connector="HitOverwritingConnector",
            module_path="lab.tools.negative_control",
        )  # fmt: skip
        # (made before any request: each engine seeds vLLM's process-wide hash of a prompt's
        # first block again, which would void the other's prefix cache afterwards)
        fresh = engines("g4tiny", layout, "kv_consumer", pick_free_port(), salt=DECODE_SALT)
        run(decode, "d0", A, params["p0"])
        run(decode, "d1", PROMPTS["p1"], params["p1"])
        run(decode, "d2", [*A, 7], params["p2"])
        run(decode, "d5", [*A, 7], params["p5"])
        run(decode, "d3", A, params["p3"])
        run(decode, "d4", Z, params["p4"])
        # Negative control: p6 (p1's prompt) read over the blocks of decode's hit
        run(decode, "d6", PROMPTS["p6"], {**params["p6"], OVERWRITE_HITS: True})
        # Prefill's own hit served as any other block: a decode without it reads all of p8
        run(fresh, "e8", A, params["p8"])
        result = child.wait_json(RESULT, 90)
        # A load with a per-group hit that fails (its prefill is gone) starts over: its
        # sliding-window groups lack the window before the full-attention hit
        run(decode, "d7", PROMPTS["p6"], {**params["p6"], "remote_port": pick_free_port()})
    finally:
        child.kill()
    reads = read_log(log)
    errors = {
        r: (o.kv_transfer_params or {}).get("kv_load_error") for r, o in decode.outputs.items()
    }
    assert "d7" in errors and errors.pop("d7")  # prefill unreachable: computed locally
    assert set(errors.values()) == {None}, errors
    assert decode.computed_from["d7"] == 0  # from the start, not from its hit (288)
    decode.loaded.pop("d7")  # (checked when reported: the failed load had moved nothing)
    # the control's writes over decode's hit are found, in full attention's 18 hit blocks
    assert decode.hit_blocks["d6"] == [0, 0, 0, 0, 0, 18]
    overwritten = decode.loaded.pop("d6")
    assert overwritten and all("(group 5," in m for m in overwritten), overwritten
    assert {m.split("#")[1].rstrip(")") for m in overwritten} == {str(i) for i in range(18)}
    # byte for byte: the blocks the load filled hold prefill's KV, the hit's decode's own
    loaded = {r: m for r, m in decode.loaded.items() if r not in ("d2", "d5")}
    assert loaded == {"d0": [], "d1": [], "d3": [], "d4": []}, decode.loaded
    assert decode.loaded.get("d2", []) == []
    # d1: the full-attention group holds its 224 shared tokens (14 blocks) and reads the 6
    # after them; each sliding-window group holds none of its window and reads it (4 blocks)
    assert decode.hit_blocks["d1"] == [0, 0, 0, 0, 0, 14]
    assert decode.read_blocks["d1"] == [4, 4, 4, 4, 4, 6]
    assert decode.read_blocks["d0"] == decode.read_blocks["d4"] == [4, 4, 4, 4, 4, 20]
    assert reads["d1"]["tokens_hit"] == 224 and reads["d1"]["tokens_loaded"] == 96
    assert reads["d0"]["tokens_hit"] == 0 and reads["d0"]["tokens_loaded"] == 320
    assert reads["d1"]["bytes"] < reads["d4"]["bytes"] == reads["d0"]["bytes"]
    # d3: full attention holds all but the last 32 tokens (vLLM recomputes the last token,
    # on 32-token boundaries); a sliding-window group's hit at 288 would need its window
    # before 288, which no load brought: it reads its window again
    assert decode.hit_blocks["d3"] == [0, 0, 0, 0, 0, 18]
    assert decode.read_blocks["d3"] == [4, 4, 4, 4, 4, 2] and reads["d3"]["tokens_hit"] == 288
    # d2: all 320 tokens prefill computed are in full attention's cache. vLLM 0.26 keeps
    # each sliding-window group's window at 320 too: nothing to read. 0.34 keeps only what a
    # hit at d0's last token (319) takes: the windows and full attention's last 32 tokens.
    if reads["d2"]["tokens_hit"] == 320:
        assert reads["d2"]["bytes"] == 0 and "d2" not in decode.loaded
    else:
        assert reads["d2"]["tokens_hit"] == 288
        assert decode.read_blocks["d2"] == [4, 4, 4, 4, 4, 2]
    # d5: now every group holds all of it: nothing read, prefill freed p5 at once
    assert reads["d5"]["bytes"] == 0 and reads["d5"]["tokens_loaded"] == 0
    assert reads["d5"]["tokens_hit"] == 320 and "d5" not in decode.loaded
    assert result["held"] == [] and result["free_blocks"] == result["total_blocks"]
    assert result["expired_leases"] == 0  # decode freed p5 itself, not its lease
    # prefill's own hits (the blocks p3 and p8 share with p0) served as any other block
    assert ready["p3"]["hit_tokens"] == ready["p8"]["hit_tokens"] == 288
    assert fresh.loaded == {"e8": []} and fresh.read_blocks["e8"] == [4, 4, 4, 4, 4, 20]
    shared = [
        set(a) & set(b)
        for a, b in zip(
            params["p0"]["remote_block_ids"], params["p8"]["remote_block_ids"], strict=True
        )
    ]
    assert len(shared[5]) == 18  # full attention's 18 hit blocks are p0's own
    # the scheduler's counters (Prometheus: vllm:kvshare_prefix_hit_tokens, _loaded_tokens),
    # at admission: the read log's loads; d6's as admitted (the control then read all 320)
    # and d7's (hit 288, 32 to load, then failed)
    logged = [r for rid, r in reads.items() if rid != "d6"]
    hit = sum(s["prefix_hit_tokens"] for s in decode.scheduler_stats)
    assert hit == sum(r["tokens_hit"] for r in logged) + 0 + 288
    loaded_tokens = sum(s["loaded_tokens"] for s in decode.scheduler_stats)
    assert loaded_tokens == sum(r["tokens_loaded"] for r in logged) + 32 + 32


def expected_blocks(engine: PrefixEngine, tokens: int, hit: int) -> tuple[list[int], list[int]]:
    """(hit, read) blocks per group of a load of ``tokens`` whose full-attention groups hold
    ``hit`` tokens and whose sliding-window groups hold none of their window."""
    hits, reads = [], []
    for group in engine.topology.groups:
        size, window = group.spec.block_size, group.spec.sliding_window
        total = -(-tokens // size)
        first = max(0, tokens - window + 1) // size if window else hit // size
        hits.append(0 if window else hit // size)
        reads.append(total - first)
    return hits, reads


@pytest.mark.parametrize(
    ("model", "prefill_layout", "decode_layout"),
    [
        ("g4tiny", "kvcached_contiguous", "kvcached_per_layer"),
        ("g4uniform", "cross_layer", "cross_layer"),  # 0.26's tensor; 0.34: block-major
    ],
)
def test_hits_in_other_layouts(engines, tmp_path, model, prefill_layout, decode_layout):
    """The same reads past the hit with kvcached's buffers and the cross-layer layouts:
    p1 shares 224 tokens with p0, which decode loaded first; byte for byte, the hit's blocks
    keep decode's own KV. (g4uniform: one full-attention group, vLLM's own common hit.)"""
    prompts = {"p0": A, "p1": PROMPTS["p1"]}
    child = serve(tmp_path, prompts, prefill_layout, model)
    try:
        params = {
            r: v["kv_transfer_params"] for r, v in child.wait_json(READY, 180)["requests"].items()
        }
        log = tmp_path / "reads.jsonl"
        decode = engines(
            model, decode_layout, "kv_consumer", pick_free_port(), {"read_log": str(log)},
            salt=DECODE_SALT,
        )  # fmt: skip
        run(decode, "d0", A, params["p0"])
        run(decode, "d1", prompts["p1"], params["p1"])
        result = child.wait_json(RESULT, 90)
    finally:
        child.kill()
    reads = read_log(log)
    assert decode.loaded == {"d0": [], "d1": []}, decode.loaded
    assert (decode.hit_blocks["d1"], decode.read_blocks["d1"]) == expected_blocks(decode, 320, 224)
    assert (decode.hit_blocks["d0"], decode.read_blocks["d0"]) == expected_blocks(decode, 320, 0)
    assert reads["d1"]["tokens_hit"] == 224 and reads["d1"]["bytes"] < reads["d0"]["bytes"]
    assert result["held"] == [] and result["free_blocks"] == result["total_blocks"]


def test_a_failing_per_group_lookup_leaves_vllms_own_hit(caplog):
    """Whatever goes wrong in the per-group lookup, the scheduler goes on with vLLM's hit."""
    import weakref
    from types import SimpleNamespace

    from kvshare_connector.vllm import prefix_hits

    class Config:  # vLLM's KVCacheConfig, as far as the lookup reads it
        kv_cache_groups = (0, 1)

    class Manager:
        kv_cache_config = Config()

        @property
        def coordinator(self):
            raise RuntimeError("a vLLM without it")

    class Loads:
        def loads_to(self, request):
            return 320

        def took_group_hits(self, request_id, release):
            raise AssertionError("no per-group hit to take")

    manager, loads = Manager(), Loads()
    key = id(manager.kv_cache_config)
    prefix_hits._ENGINES[key] = (weakref.ref(manager.kv_cache_config), weakref.ref(loads))
    try:
        lookup = prefix_hits._wrapped(lambda m, r: ("vLLM's blocks", 0, 224), 3)
        assert lookup(manager, SimpleNamespace(request_id="r")) == ("vLLM's blocks", 0, 224)
        assert "a vLLM without it" in caplog.text
        # nothing diverges (no group holds more than vLLM's hit): not even looked at
        flat = prefix_hits._wrapped(lambda m, r: ("vLLM's blocks", 64, 0), 4)
        assert flat(manager, SimpleNamespace(request_id="r")) == ("vLLM's blocks", 64, 0)
    finally:
        prefix_hits._ENGINES.pop(key, None)
