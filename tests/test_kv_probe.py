"""The KV probe's digests and comparison on KV memory laid out as vLLM 0.26 lays it out.

What the GPU driver (lab/gpu_checks/kv_exact.py) concludes rests on these: a faithful copy
of every block compares equal across physical layouts (per-layer, kvcached, cross-layer),
blocks aligned per group at the tail with null blocks skipped; the scrambled negative
control, a single flipped byte and a sharer that reads the wrong owner are each reported
with their location; and bytes outside the request's tokens do not count.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvshare_connector.demo import kvcheck
from kvshare_connector.toolkit.procs import pick_free_port
from kvshare_connector.vllm import compat
from kvshare_connector.vllm.adapter import cross_layer_views
from lab.tools.kv_digests import (
    compare,
    needed_from,
    positions_of,
    request_record,
    scrambled,
)

E2B = "gemma4_e2b_shape"
TOKENS = 1300  # > the 512-token sliding window: sliding groups hold only a tail
LOCATION = re.compile(
    r"layer model\.layers\.\d+\.self_attn\.attn, group \d+, block \d+ "
    r"\(position \d+; prefill block \d+\)"
)


class Side:
    """One engine's KV memory: owner views, sharer views (aliases) and topology."""

    def __init__(self, stack_topology: Any, model: str, layout: str, kv_mib: int):
        stack, self.topology = stack_topology(model, layout, kv_mib)
        if stack.cross_layer_tensor is not None:  # what the probe derives from the tensor
            self.views, _ = cross_layer_views(
                stack.kv_cache_config,
                stack.cross_layer_tensor,
                stack.cross_layer_backend,
                stack.vllm_config,
            )
        else:
            self.views = {n: stack.kv_caches[n] for n in self.topology.owners}
        self.sharer_views = {s: stack.kv_caches[s] for s in self.topology.sharers}
        for view in self.views.values():
            kvcheck._as_int16(view).zero_()

    def tables(self, seed: int, avoid: Sequence[Sequence[int]] = ()) -> list[list[int]]:
        """Full block tables from position 0, distinct ids across groups (HMA groups
        overlay one buffer), never the null block nor a block in ``avoid``."""
        import torch

        counts = [math.ceil(TOKENS / g.spec.block_size) for g in self.topology.groups]
        gen = torch.Generator().manual_seed(seed)
        taken = {b for ids in avoid for b in ids}
        pool = (torch.randperm(self.topology.num_blocks - 1, generator=gen) + 1).tolist()
        ids = [b for b in pool if b not in taken][: sum(counts)]
        assert len(ids) == sum(counts), "KV too small for these requests"
        out, at = [], 0
        for count in counts:
            out.append(ids[at : at + count])
            at += count
        return out

    def clipped(self, tables: list[list[int]]) -> list[list[int]]:
        """What prefill holds: sliding-window groups keep window + 1 blocks, the first one
        already freed (null block 0), as vLLM frees blocks out of the window."""
        out = []
        for group, ids in zip(self.topology.groups, tables, strict=True):
            window = group.spec.sliding_window
            if window:
                ids = [0, *ids[-(math.ceil(window / group.spec.block_size) + 1) + 1 :]]
            out.append(list(ids))
        return out

    def block(self, name: str, block: int) -> Any:
        owner = self.topology.owners[name]
        view = kvcheck._as_int16(self.views[name])
        return kvcheck._block_slice(view, owner.labels, owner.spec.block_size, block)

    def fill_random(self, tables: list[list[int]], seed: int) -> None:
        import torch

        gen = torch.Generator().manual_seed(seed)
        for name, owner in self.topology.owners.items():
            for block in tables[owner.group]:
                if block:
                    target = self.block(name, block)
                    target.copy_(torch.randint(-(2**15), 2**15, target.shape, generator=gen))

    def record(self, tables: list[list[int]], side: str, **kw: Any) -> dict[str, Any]:
        """What the probe writes for one request (the ids are the tests' own)."""
        fields = {"side": side, "request_id": side, "remote_request_id": "prefill", **kw}
        sharer_views = fields.pop("sharer_views", self.sharer_views)
        return request_record(self.topology, self.views, sharer_views, tables, TOKENS, **fields)


def tail_pairs(local: list[int], remote: list[int]) -> list[tuple[int, int]]:
    """Blocks paired as the NIXL sink pairs them: tail-aligned, null block 0 skipped."""
    n = min(len(local), len(remote))
    pairs = zip(local[len(local) - n :], remote[len(remote) - n :], strict=True)
    return [(lb, rb) for lb, rb in pairs if lb and rb]


def transfer(src: Side, src_ids: list[list[int]], dst: Side, dst_ids: list[list[int]]) -> int:
    """Copy whole logical blocks from prefill's to decode's blocks, paired at the tail."""
    pairs = [tail_pairs(d, s) for d, s in zip(dst_ids, src_ids, strict=True)]
    for name, owner in dst.topology.owners.items():
        for lb, rb in pairs[owner.group]:
            dst.block(name, lb).copy_(src.block(name, rb))
    return sum(len(p) for p in pairs)


LAYOUTS = [
    (E2B, "per_layer", "kvcached_contiguous"),
    (E2B, "kvcached_per_layer", "per_layer"),
    ("g4uniform", "cross_layer", "per_layer"),
]


@pytest.fixture(params=LAYOUTS, ids=["-".join(p[1:]) for p in LAYOUTS])
def sides(request, stack_topology):
    model, prefill_layout, decode_layout = request.param
    # Own kv sizes: these tests write into the KV, other tests' cached stacks stay clean.
    return Side(stack_topology, model, prefill_layout, 40), Side(
        stack_topology, model, decode_layout, 44
    )


def expected_counts(side: Side, decode_tables: list[list[int]], prefill_held: list[list[int]]):
    """Owner-layer blocks and bytes a faithful comparison covers, counted independently."""
    blocks = nbytes = 0
    for owner in side.topology.owners.values():
        spec = owner.spec
        d, p = decode_tables[owner.group], prefill_held[owner.group]
        n = min(len(d), len(p))
        for i, (lb, rb) in enumerate(zip(d[len(d) - n :], p[len(p) - n :], strict=True)):
            if lb and rb:
                position = math.ceil(TOKENS / spec.block_size) - n + i
                valid = min(spec.block_size, TOKENS - position * spec.block_size)
                blocks += 1
                nbytes += valid * 2 * spec.num_kv_heads * spec.head_size * spec.itemsize
    return blocks, nbytes


def test_faithful_copy_matches_across_layouts(sides):
    prefill, decode = sides
    held = prefill.clipped(prefill.tables(1))
    prefill.fill_random(held, seed=7)
    tables = decode.tables(2)  # decode: full tables, older sliding blocks never loaded
    moved = transfer(prefill, held, decode, tables)
    # The stale tail of each last block (beyond the prompt) differs; it must not count.
    for name, owner in decode.topology.owners.items():
        last = decode.block(name, tables[owner.group][-1])
        valid = TOKENS - (len(tables[owner.group]) - 1) * owner.spec.block_size
        assert 0 < valid < owner.spec.block_size
        last.masked_fill_(kvcheck._token_index(last, owner.labels) >= valid, 12345)

    result = compare(prefill.record(held, "prefill"), decode.record(tables, "decode"))
    assert result["problems"] == [] and result["groups_without_blocks"] == []
    assert result["mismatches"] == 0, result["locations"]
    blocks, nbytes = expected_counts(decode, tables, held)
    assert moved > 0 and result["blocks_compared"] == blocks
    assert result["bytes_compared"] == nbytes
    assert result["sharers_checked"] == 2 * len(decode.topology.sharers) > 0
    assert result["sharer_mismatches"] == 0


def test_scrambled_load_is_caught_with_locations(sides):
    prefill, decode = sides
    held = prefill.clipped(prefill.tables(3))
    prefill.fill_random(held, seed=8)
    tables = decode.tables(4)
    transfer(prefill, held, decode, list(scrambled(tables)))  # bytes land in wrong blocks

    result = compare(prefill.record(held, "prefill"), decode.record(tables, "decode"))
    assert result["blocks_compared"] > 0
    assert result["mismatches"] == result["blocks_compared"]  # every block moved
    assert len(result["locations"]) == 5
    assert all(LOCATION.fullmatch(loc) for loc in result["locations"]), result["locations"]


def test_one_flipped_byte_is_located_and_bytes_past_the_prompt_are_not(stack_topology):
    prefill, decode = (
        Side(stack_topology, E2B, "per_layer", 40),
        Side(stack_topology, E2B, "per_layer", 44),
    )
    held = prefill.clipped(prefill.tables(5))
    prefill.fill_random(held, seed=9)
    tables = decode.tables(6)
    transfer(prefill, held, decode, tables)
    full = next(g for g in decode.topology.groups if not g.spec.sliding_window)
    name, bs = full.layer_names[1], full.spec.block_size
    last = decode.block(name, tables[full.index][-1])
    token_axis = decode.topology.owners[name].labels.index("token")
    past = TOKENS % bs  # first slot after the prompt in its last block
    last.narrow(token_axis, past, 1).add_(1)
    assert compare(prefill.record(held, "p"), decode.record(tables, "d"))["mismatches"] == 0

    last.narrow(token_axis, past - 1, 1).view(-1)[0] += 1  # the prompt's last token
    result = compare(prefill.record(held, "p"), decode.record(tables, "d"))
    position = len(tables[full.index]) - 1
    assert result["mismatches"] == 1
    assert result["locations"] == [
        f"layer {name}, group {full.index}, block {tables[full.index][-1]} "
        f"(position {position}; prefill block {held[full.index][-1]})"
    ]


def test_sharer_reading_another_owner_is_caught(stack_topology):
    side = Side(stack_topology, E2B, "per_layer", 40)
    tables = side.tables(7)
    side.fill_random(tables, seed=10)
    sharer, target = next(iter(side.topology.sharers.items()))
    other = next(
        n
        for n, o in side.topology.owners.items()
        if o.group == side.topology.owners[target].group and n != target
    )
    wrong = {**side.sharer_views, sharer: side.views[other]}
    record = side.record(tables, "prefill", sharer_views=wrong)
    result = compare(record, side.record(tables, "decode"))
    assert result["mismatches"] == 0
    assert result["sharer_mismatches"] == 1
    assert result["sharer_locations"] == [f"prefill: {sharer} != its target {target}"]


def test_lmcache_compares_only_what_the_last_token_attends_to(stack_topology):
    """LMCache moves a sliding group from the block of ``n - window``: older blocks decode
    holds were never loaded, and count only when asked to compare everything."""
    prefill, decode = (
        Side(stack_topology, E2B, "per_layer", 40),
        Side(stack_topology, E2B, "per_layer", 44),
    )
    tables_p, tables_d = prefill.tables(11), decode.tables(12)
    prefill.fill_random(tables_p, seed=13)
    assert needed_from(TOKENS, {"block_size": 32, "sliding_window": 512}) == (TOKENS - 512) // 32
    loaded_p, loaded_d = [], []
    for group, p, d in zip(decode.topology.groups, tables_p, tables_d, strict=True):
        spec = {"block_size": group.spec.block_size, "sliding_window": group.spec.sliding_window}
        start = needed_from(TOKENS, spec)
        loaded_p.append([0] * start + p[start:])
        loaded_d.append([0] * start + d[start:])
    transfer(prefill, loaded_p, decode, loaded_d)
    prefill_rec, decode_rec = prefill.record(tables_p, "p"), decode.record(tables_d, "d")
    assert compare(prefill_rec, decode_rec, needed_only=True)["mismatches"] == 0
    result = compare(prefill_rec, decode_rec)
    sliding_owners = sum(1 for o in decode.topology.owners.values() if o.spec.sliding_window)
    skipped = needed_from(TOKENS, {"block_size": 32, "sliding_window": 512})
    assert result["mismatches"] == sliding_owners * skipped  # decode's never-loaded blocks


def test_positions_scramble_and_needed_from():
    assert positions_of([5, 6, 7], 100, 16) == [4, 5, 6]  # a tail of 7 blocks
    assert positions_of(list(range(1, 9)), 100, 16) == list(range(7))  # a longer table
    assert scrambled([[0, 3, 4, 5], [9]]) == ([0, 4, 5, 3], [9])  # nulls stay, all move
    assert needed_from(1300, {"block_size": 32, "sliding_window": 512}) == 24
    assert needed_from(1300, {"block_size": 16, "sliding_window": None}) == 0


def _driver() -> Any:
    from lab.gpu_checks import kv_exact

    return kv_exact


def test_driver_verdicts(stack_topology, tmp_path, monkeypatch):
    """The driver passes a faithful cell and fails one whose control did not mismatch."""
    import json

    driver = _driver()
    monkeypatch.setattr(driver, "PROMPT_LENS", (TOKENS,))
    prefill, decode = (
        Side(stack_topology, E2B, "per_layer", 80),
        Side(stack_topology, E2B, "per_layer", 84),
    )
    first = prefill.tables(20)
    held = [prefill.clipped(first), prefill.clipped(prefill.tables(21, avoid=first))]
    tables = [decode.tables(22)]
    tables.append(decode.tables(23, avoid=tables[0]))
    for seed, ids in enumerate(held):
        prefill.fill_random(ids, seed=30 + seed)
    transfer(prefill, held[0], decode, tables[0])
    transfer(prefill, held[1], decode, list(scrambled(tables[1])))
    lines = {"prefill": [], "decode": []}
    for i, kind in enumerate(("main", "control")):
        p = prefill.record(held[i], "prefill", request_id=f"r{i}")
        d = decode.record(tables[i], "decode", request_id=f"d{i}", scrambled=kind == "control")
        d["remote_request_id"] = p["request_id"] = f"r{i}"
        lines["prefill"].append(p)
        lines["decode"].append(d)
    for role, records in lines.items():
        (tmp_path / f"{role}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    checked = driver.check_cell(tmp_path, {"model": E2B})
    assert checked["problems"] == []
    result = {"cell": "e2b/plain", "rc_prefill": 0, "rc_decode": 0, **checked}
    assert driver.passed(result) and "| PASS |" in driver.summary([result])

    lines["decode"][1]["scrambled"] = False  # a "main" request that mismatches, and no control
    (tmp_path / "decode.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines["decode"]))
    failed = {"cell": "x", "rc_prefill": 0, "rc_decode": 0, **driver.check_cell(tmp_path, {})}
    assert not driver.passed(failed)
    assert any("control: 0 of 1 requests compared" in p for p in failed["problems"])
    assert any("block / 0 sharer mismatch" in p for p in failed["problems"])


# ---- the connector through vLLM's scheduler (emulated forward, NIXL or LMCache) ----------


def _probe_pd(
    tmp_path: Path,
    prefill_layout: str,
    model: str,
    extra: dict,
    tamper: bool = False,
    reorder: bool = False,
) -> list[dict]:
    """Prefill 3 requests, decode them (the last scrambled; with ``tamper`` the second's
    load is tampered with, which verify_kv must refuse); each decode request compared."""
    import json

    from lab.tools.engine_sim import Engine, decode_requests

    probe = {"connector": "KVProbeConnector", "module_path": "lab.tools.kv_probe"}
    made = []
    try:
        config = {**extra, "kv_lease_duration": 60, "kv_probe": {"out": str(tmp_path / "p")}}
        made.append(Engine(model, prefill_layout, "kv_producer", pick_free_port(), config, **probe))
        prefill = made[0]
        for i in range(3):
            prefill.add(f"p{i}", 300 + 37 * i, 1, {"do_remote_decode": True}, i)
        prefill.run_until(lambda: len(prefill.outputs) == 3)
        prefill.step()  # the step after they finished: holds (and digests) reach the worker
        config = {**extra, "kv_probe": {"out": str(tmp_path / "d")}}
        # "recompute": a refused load is computed locally and says why (kv_load_error), on
        # 0.26 and on vLLM >= 0.30, where kv_load_failure_policy decides (default: fail)
        policy = {"failure_policy": "recompute"} if tamper or reorder else {}
        made.append(
            Engine(model, "per_layer", "kv_consumer", pick_free_port(), config, **probe, **policy)
        )
        requests = {
            r: {"kv_transfer_params": o.kv_transfer_params} for r, o in prefill.outputs.items()
        }
        scramble = dict(requests["p2"]["kv_transfer_params"], kvshare_probe_scramble=True)
        requests["p2"] = {"kv_transfer_params": scramble}
        if tamper:
            bad = dict(requests["p1"]["kv_transfer_params"], kvshare_probe_tamper=True)
            requests["p1"] = {"kv_transfer_params": bad}
        if reorder:  # what kv_exact's reorder batch sends: rotated lists, flagged
            params = requests["p1"]["kv_transfer_params"]
            rotated = scrambled(params["remote_block_ids"])
            bad = dict(params, remote_block_ids=rotated, kvshare_probe_reorder=True)
            requests["p1"] = {"kv_transfer_params": bad}
        report = decode_requests(made[1], requests, 300)
        errors = {
            r: (v["kv_transfer_params"] or {}).get("kv_load_error") for r, v in report.items()
        }
        if tamper:  # refused and computed locally; the others load
            assert "VerificationError" in str(errors.pop("d1")), report["d1"]
            made[1].loaded.pop("d1", None)
            return [errors]
        if reorder:  # refused by prefill, computed locally; the others load
            assert "in their order" in str(errors.pop("d1")), report["d1"]
            assert errors == {"d0": None, "d2": None}
            made[1].step()  # the step after d1 finished: its blocks are digested
        else:
            assert all(r["kv_transfer_params"] is None for r in report.values())  # no error
            # engine_sim's own pattern check agrees: loaded as written, but the scrambled one
            assert made[1].loaded["d0"] == made[1].loaded["d1"] == [] and made[1].loaded["d2"]
    finally:
        for engine in made:
            engine.close()
    sources = {}
    for line in (tmp_path / "p").read_text().splitlines():
        sources[json.loads(line)["request_id"]] = json.loads(line)
    decoded = [json.loads(line) for line in (tmp_path / "d").read_text().splitlines()]
    if reorder:  # the refusal, then the blocks decode computed, digested once it finished
        refused, recomputed = [r for r in decoded if r.get("reordered")]
        assert "in their order" in refused["failed"] and recomputed["at"] == "recomputed"
        return [compare(sources[recomputed["remote_request_id"]], recomputed)]
    assert len(sources) == len(decoded) == 3
    needed_only = extra.get("backend") == "lmcache"
    results = {}
    for record in decoded:
        result = compare(sources[record["remote_request_id"]], record, needed_only=needed_only)
        results[record["request_id"]] = {**result, "scrambled": record["scrambled"]}
    return [results[r] for r in ("d0", "d1", "d2")]


@pytest.mark.parametrize(
    ("model", "prefill_layout"), [("g4tiny", "per_layer"), ("g4uniform", "cross_layer")]
)
def test_probe_connector_nixl_pd(tmp_path, model, prefill_layout):
    """Real vLLM scheduler and NIXL: faithful loads compare equal, the scrambled one not."""
    main0, main1, control = _probe_pd(tmp_path, prefill_layout, model, {})
    for result in (main0, main1):
        assert not result["scrambled"] and result["problems"] == []
        assert result["blocks_compared"] > 0 and result["groups_without_blocks"] == []
        assert result["mismatches"] == 0 and result["sharer_mismatches"] == 0
        # The CPU stack binds no tensor to the model's layers: a cross-layer prefill has no
        # sharer tensor here (on the GPU, the forward context's binding is checked).
        # (vLLM 0.33's block-major layout comes as per-layer views, sharers aliased.)
        cross_tensor = prefill_layout == "cross_layer" and compat.HAS_CROSS_LAYER_TENSOR
        missing = 4 if cross_tensor else 0
        assert result["sharers_missing"] == {"prefill": missing, "decode": 0}
    assert control["scrambled"] and control["mismatches"] == control["blocks_compared"] > 0
    assert all(LOCATION.fullmatch(loc) for loc in control["locations"])


@pytest.mark.parametrize("extra", [{}, {"staging_mib": 0}], ids=["packed", "direct"])
def test_probe_connector_tampered_load_is_refused_by_verify_kv(tmp_path, extra):
    """The GPU driver's tamper control, through vLLM's scheduler on the CPU: the probe
    overwrites a block of one load after its READ (packed: in its staging slot; direct: in
    the block itself); verify_kv (on by default) refuses it."""
    (errors,) = _probe_pd(tmp_path, "per_layer", "g4tiny", extra, tamper=True)
    assert errors == {"d0": None, "d2": None}


@pytest.mark.parametrize("computes", [True, False], ids=["computed", "control"])
def test_probe_connector_reordered_load_is_refused_then_recomputed(tmp_path, monkeypatch, computes):
    """kv_exact's reorder batch through vLLM's scheduler on the CPU: prefill refuses the
    rotated block list, decode computes the prompt itself (engine_sim's model writes what
    prefill's wrote), and the probe's digests of the finished request's blocks equal
    prefill's. Control: a decode whose model writes nothing there; the same check must
    report the blocks differ."""
    from lab.tools.engine_sim import Engine

    if not computes:
        forward = Engine._forward_prefill
        monkeypatch.setattr(
            Engine, "_forward_prefill",
            lambda self, rid, twin=None: None if twin else forward(self, rid),
        )  # fmt: skip
    (recomputed,) = _probe_pd(tmp_path, "per_layer", "g4tiny", {}, reorder=True)
    assert recomputed["problems"] == [] and recomputed["blocks_compared"] > 0
    if computes:
        assert recomputed["mismatches"] == 0 and recomputed["groups_without_blocks"] == []
    else:
        assert recomputed["mismatches"] == recomputed["blocks_compared"]


def test_probe_connector_lmcache_pd(tmp_path, monkeypatch):
    """LMCache backend: prefill digests what it stores (it holds no blocks for decode)."""
    pytest.importorskip("lmcache")
    from lab.tools.engine_sim import lmcache_extra

    from .support.lmcache_util import QUIET_ENV, running_lm_server

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    for key, value in QUIET_ENV.items():
        monkeypatch.setenv(key, value)
    with running_lm_server() as url:
        main0, main1, control = _probe_pd(tmp_path, "per_layer", "g4tiny", lmcache_extra(url))
    for result in (main0, main1):
        assert result["blocks_compared"] > 0 and result["problems"] == []
        assert result["mismatches"] == 0 and result["sharer_mismatches"] == 0
    assert control["mismatches"] == control["blocks_compared"] > 0
