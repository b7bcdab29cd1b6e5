"""kv_exact's checks in verify mode and kv_outputs' comparison, on a GPU cell's records
(2026-11-30, e2b/plain: the engines' JSON files, kept in tests/fixtures) with the
verify-mode records added as the engines write them."""

from __future__ import annotations

import copy
import json
import tarfile
from pathlib import Path

import pytest

from lab.gpu_checks import kv_exact, kv_outputs, prefix_batches

ROOT = Path(__file__).resolve().parent.parent
RAW = ROOT / "tests" / "fixtures" / "kv_exact_e2b_plain.tgz"

CELL = {**kv_exact.CELLS["e2b/plain"], "verify": True}


@pytest.fixture
def cell(tmp_path) -> Path:
    with tarfile.open(RAW) as tar:
        members = [m for m in tar.getmembers() if "/e2b__plain/" in m.name]
        tar.extractall(tmp_path, members=members, filter="data")
    work = tmp_path / "runs" / "kvx" / "e2b__plain"
    n = len(kv_exact.PROMPT_LENS)
    with open(work / "decode.jsonl", "a") as out:  # the probe's record of refused loads
        for i in range(n):
            failed = f"VerificationError: request t{i}: its KV differs from what prefill ..."
            record = {"side": "decode", "request_id": f"t{i}", "remote_request_id": f"pt{i}"}
            out.write(json.dumps({**record, "tampered": True, "failed": failed}) + "\n")
    main = [r for r in map(json.loads, (work / "decode.jsonl").read_text().splitlines())
            if not r.get("scrambled") and "failed" not in r][:n]  # fmt: skip
    refusal = "ClaimRefused: ... are not the ones prefill holds ..., in their order: ..."
    with open(work / "decode.jsonl", "a") as out:  # reordered: refused, then computed again
        for i, record in enumerate(main):
            ids = {"request_id": f"o{i}", "remote_request_id": record["remote_request_id"]}
            out.write(json.dumps({"side": "decode", **ids, "reordered": True,
                                  "failed": refusal}) + "\n")  # fmt: skip
            again = {**record, **ids, "reordered": True, "at": "recomputed"}
            out.write(json.dumps(again) + "\n")
    with open(work / "decode.read_log.jsonl", "w") as log:  # main + control loads, verified
        for i in range(2 * n):
            log.write(json.dumps({"request_id": f"r{i}", "bytes": 1, "verified": 543}) + "\n")
    result = json.loads((work / "decode.result.json").read_text())
    error = {"kv_load_error": "VerificationError: ... differs from prefill block 7"}
    result["tamper"] = {"kv_transfer_params": [error] * n}
    result["reorder"] = {"kv_transfer_params": [{"kv_load_error": refusal}] * n}
    (work / "decode.result.json").write_text(json.dumps(result))
    return work


def test_verify_mode_passes_a_cell_whose_tampered_loads_were_refused(cell):
    checked = kv_exact.check_cell(cell, CELL)
    assert checked["problems"] == []
    assert checked["verified_loads"] == 2 * len(kv_exact.PROMPT_LENS)
    assert checked["tamper_refused"] == len(kv_exact.PROMPT_LENS)


def test_verify_mode_passes_reordered_loads_refused_and_computed_again(cell):
    checked = kv_exact.check_cell(cell, CELL)
    assert checked["reorder_refused"] == len(kv_exact.PROMPT_LENS)
    assert sum(r["batch"] == "reorder" for r in checked["requests"]) == len(kv_exact.PROMPT_LENS)


@pytest.mark.parametrize("wrong", ["accepted", "recomputed_differs"])
def test_verify_mode_fails_a_reordered_load_accepted_or_computed_wrong(cell, wrong):
    records = [json.loads(x) for x in (cell / "decode.jsonl").read_text().splitlines()]
    for record in records:
        if record.get("reordered") and record["request_id"] == "o1":
            if wrong == "accepted" and "failed" in record:
                record["failed"] = ""
            if wrong == "recomputed_differs" and record.get("at") == "recomputed":
                name = next(iter(record["digests"]))
                record["digests"][name][0] = "0" * 64
    (cell / "decode.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    problems = kv_exact.check_cell(cell, CELL)["problems"]
    if wrong == "accepted":
        assert any("reorder o1: load was not refused" in p for p in problems), problems
    else:
        assert any(p.startswith("reorder o1") and "mismatch" in p for p in problems), problems


def test_verify_mode_fails_a_cell_whose_tampered_load_was_accepted(cell):
    lines = (cell / "decode.jsonl").read_text().splitlines()
    last = max(i for i, line in enumerate(lines) if json.loads(line).get("tampered"))
    accepted = json.loads(lines[last])
    del accepted["failed"]
    lines[last] = json.dumps(accepted)
    (cell / "decode.jsonl").write_text("\n".join(lines) + "\n")
    problems = kv_exact.check_cell(cell, CELL)["problems"]
    assert any("load was not refused" in p for p in problems)


@pytest.mark.parametrize("generated", [0, 3])
def test_a_tampered_load_ended_without_output_counts_as_refused(cell, generated):
    """vLLM 0.33 under kv_load_failure_policy "fail" ends the refused request with no output
    and no kv_transfer_params; that is a refusal, but a tampered request that generated
    tokens without a VerificationError is not (decode ran on KV it did not verify)."""
    result = json.loads((cell / "decode.result.json").read_text())
    n = len(kv_exact.PROMPT_LENS)
    result["tamper"] = {"kv_transfer_params": [None] * n, "tokens": [[1] * generated] * n}
    (cell / "decode.result.json").write_text(json.dumps(result))
    problems = kv_exact.check_cell(cell, CELL)["problems"]
    if generated:
        assert sum("3 token(s) generated, no VerificationError" in p for p in problems) == n
    else:
        assert problems == []


def test_verify_mode_fails_a_cell_with_an_unverified_load(cell):
    lines = (cell / "decode.read_log.jsonl").read_text().splitlines()
    (cell / "decode.read_log.jsonl").write_text("\n".join(lines[1:]) + "\n")
    problems = kv_exact.check_cell(cell, CELL)["problems"]
    assert any("loads verified" in p for p in problems)


def test_outputs_are_set_against_the_noise_floor_and_the_control(cell):
    decode = json.loads((cell / "decode.result.json").read_text())
    colocated = {k: copy.deepcopy(decode[k]) for k in ("main", "control")}
    alone = copy.deepcopy(decode["main"])
    alone["logprobs"] = [[lp - 0.01 for lp in row] for row in alone["logprobs"]]
    colocated["main_alone"] = alone  # the engine's own noise: 0.01 at every token
    colocated["control"]["logprobs"] = [  # the control (wrong KV) lands far off
        [lp - 1.5 for lp in row] for row in colocated["control"]["logprobs"]
    ]
    colocated["control"]["tokens"] = [[t + 1 for t in row] for row in decode["control"]["tokens"]]
    result = kv_outputs.compare_outputs(decode, colocated)

    assert result["pd_vs_colocated"]["identical"] == len(kv_exact.PROMPT_LENS)
    assert result["noise_floor"]["first_logprob_diff_max"] == pytest.approx(0.01)
    assert result["control_vs_colocated"]["same_prefix"] == [0] * len(kv_exact.PROMPT_LENS)
    assert result["pd_within_floor"] and result["control_above_floor"]
    assert "noise floor" in kv_outputs.table({"e2b/plain": result})


def test_a_control_inside_the_noise_floor_is_reported_as_unable_to_tell(cell):
    decode = json.loads((cell / "decode.result.json").read_text())
    same = {k: copy.deepcopy(decode[k]) for k in ("main", "control")}
    same["main_alone"] = copy.deepcopy(decode["main"])
    same["main_alone"]["logprobs"] = [[lp - 0.5 for lp in r] for r in decode["main"]["logprobs"]]
    result = kv_outputs.compare_outputs(decode, same)
    assert not result["control_above_floor"]


# ---- the shared-prefix batches (issue 50, --prefix) -------------------------------------------


def test_prefix_batches_start_as_the_main_batch_and_go_their_own_way():
    main = kv_exact.prompts("main", 4096)
    batches = [kv_exact.prompts(b, 4096) for b in prefix_batches.BATCHES]
    assert prefix_batches.BATCHES == ("prefix", "prefix-control")
    for i, prompt in enumerate(main):
        n = prefix_batches.shared(len(prompt))
        assert n % 64 == 0 and 0.7 * len(prompt) < n <= 0.75 * len(prompt)
        for other in batches:
            assert len(other[i]) == len(prompt) and other[i][:n] == prompt[:n]
            assert other[i][n:] != prompt[n:]
        assert batches[0][i][n:] != batches[1][i][n:]
    cell = {**CELL, "prefix": True}
    assert kv_exact.batches_of(cell)[-2:] == prefix_batches.BATCHES
    prefill = {"startup_s": 1.0, "main": {"kv_transfer_params": [{"remote_request_id": "a"}]},
               "prefix": {"kv_transfer_params": [{"remote_request_id": "b"}, None]}}  # fmt: skip
    assert kv_exact.batches_by_request(prefill) == {"a": "main", "b": "prefix"}


@pytest.mark.parametrize(
    ("prefix_load", "problem"),
    [
        ({"bytes": 400, "tokens_hit": 512, "tokens_loaded": 188}, None),
        # the whole prompt read, as before issue 50: its hit was 0
        ({"bytes": 1000, "tokens_hit": 0, "tokens_loaded": 700}, "0 tokens hit, of 512"),
        ({"bytes": 1000, "tokens_hit": 512, "tokens_loaded": 188}, "1000 bytes read"),
        ({"bytes": 400, "tokens_hit": 576, "tokens_loaded": 124}, "576 tokens hit"),
        ({"bytes": 400, "tokens_hit": 512, "tokens_loaded": 100}, "is not the prompt"),
        ({"bytes": 400}, "no token counts"),
    ],
)
def test_prefix_loads_read_past_their_hit_and_less_than_no_hit(prefix_load, problem):
    requests = [
        {"request_id": "m0", "batch": "main", "num_tokens": 700},
        {"request_id": "x0", "batch": "prefix", "num_tokens": 700},
        {"request_id": "c0", "batch": "prefix-control", "num_tokens": 700},
    ]
    log = [{"request_id": "m0", "bytes": 1000, "tokens_hit": 0, "tokens_loaded": 700},
           {"request_id": "x0", **prefix_load},
           {"request_id": "c0", "bytes": 400, "tokens_hit": 512, "tokens_loaded": 188}]  # fmt: skip
    found = prefix_batches.problems(requests, log)
    assert found == [] if problem is None else (len(found) == 1 and problem in found[0]), found
    assert "0 loads in the read log" in prefix_batches.problems(requests, log[:1])[0]
