"""The config sweep: parsing, lm-eval command lines, verdicts, reports, the tiny tokenizer, and
a whole sweep against fake vLLM servers with real lm-eval on the local task."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvshare_connector.toolkit import report as pd_report
from kvshare_connector.toolkit.lmeval import EvalSpec, agreement, lm_eval_argv, parse_output
from kvshare_connector.toolkit.report import write_reports
from kvshare_connector.toolkit.sweep import SweepEntry, compare_probes, judge, load_sweep

from .support.fake_vllm_server import fake_answer

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "scripts" / "sweep_configs"
FAKE = Path(__file__).resolve().parent / "support" / "fake_vllm_server.py"
FAKE_CMD = (
    f"{{python}} {shlex.quote(str(FAKE))} {{model}} --role {{role}} --host {{host}} --port {{port}}"
)


def _entry(**kwargs) -> SweepEntry:
    return SweepEntry(name=kwargs.pop("name", "c"), model=kwargs.pop("model", "m"), **kwargs)


def test_shipped_sweep_files_parse() -> None:
    tiny = load_sweep(CONFIGS / "tiny_local.yaml")
    assert len(tiny) >= 3
    assert {e.layout for e in tiny} == {"per_layer", "cross_layer"}
    assert any(e.kvcached and e.kvcached_contiguous_layout for e in tiny)
    assert any(e.kvcached and e.kvcached_contiguous_layout is False for e in tiny)
    for e in tiny:
        assert Path(e.tiny_model_config).is_file()  # resolved against the sweep file
        assert Path(e.eval.include_path, "kvshare_arith.yaml").is_file()
        assert e.min_agreement == 1.0 and e.eval.offline
    e2b = load_sweep(CONFIGS / "gemma4_e2b_gsm8k.yaml")
    assert {(e.model, e.expected_score, e.eval.task) for e in e2b} == {
        ("google/gemma-4-E2B-it", 0.485, "gsm8k")
    }


def test_load_sweep_merges_defaults_and_rejects_typos(tmp_path: Path) -> None:
    good = tmp_path / "s.json"
    good.write_text(
        json.dumps(
            {
                "defaults": {"model": "m", "env": {"A": "1"}, "eval": {"task": "t", "limit": 3}},
                "configs": [
                    {"name": "a"},
                    {"name": "b", "env": {"B": "2"}, "eval": {"num_fewshot": 0}},
                ],
            }
        )
    )
    a, b = load_sweep(good)
    assert a.env == {"A": "1"} and b.env == {"A": "1", "B": "2"}
    assert (b.eval.task, b.eval.limit, b.eval.num_fewshot) == ("t", 3, 0)
    assert a.eval.num_fewshot == 5
    bad = tmp_path / "bad.yaml"
    bad.write_text("configs:\n  - name: a\n    model: m\n    kv_cached: true\n")
    with pytest.raises(ValueError, match=r"unknown keys \['kv_cached'\]"):
        load_sweep(bad)
    dup = tmp_path / "dup.yaml"
    dup.write_text("configs:\n  - {name: a, model: m}\n  - {name: a, model: n}\n")
    with pytest.raises(ValueError, match="unique"):
        load_sweep(dup)
    with pytest.raises(ValueError, match="exactly one of model"):
        SweepEntry(name="x")
    with pytest.raises(ValueError, match="layout must be one of"):
        SweepEntry(name="x", model="m", layout="cross-layer")


def test_server_env_for_kvcached() -> None:
    assert _entry().server_env() == {"ENABLE_KVCACHED": "false"}
    env = _entry(kvcached=True, kvcached_contiguous_layout=False).server_env()
    assert env == {"ENABLE_KVCACHED": "true", "KVCACHED_CONTIGUOUS_LAYOUT": "false"}


def test_lm_eval_argv_chat_for_gemma4_and_completions_otherwise(tmp_path: Path) -> None:
    spec = EvalSpec(include_path="/tasks", limit=10.0)
    chat = lm_eval_argv(spec, "http://h:1", "google/gemma-4-E2B-it", tmp_path)
    assert chat[chat.index("--model") + 1] == "local-chat-completions"
    model_args = chat[chat.index("--model_args") + 1]
    assert "base_url=http://h:1/v1/chat/completions" in model_args
    assert "model=google/gemma-4-E2B-it" in model_args
    assert "tokenized_requests=False" in model_args
    assert "--apply_chat_template" in chat
    assert chat[chat.index("--num_fewshot") + 1] == "5"
    assert chat[chat.index("--tasks") + 1] == "gsm8k"
    assert chat[chat.index("--include_path") + 1] == "/tasks"
    assert chat[chat.index("--limit") + 1] == "10"
    plain = lm_eval_argv(EvalSpec(limit=0.5), "http://h:1", "Qwen/Qwen3-0.6B", tmp_path)
    assert plain[plain.index("--model") + 1] == "local-completions"
    assert "tokenizer_backend=None" in plain[plain.index("--model_args") + 1]
    assert "--apply_chat_template" not in plain
    assert plain[plain.index("--limit") + 1] == "0.5"


def _parts(pd: float, base: float, pd_resp: dict, base_resp: dict, probes=None) -> dict:
    return {
        "pd": {"score": pd, "_responses": pd_resp, "_probes": probes and probes[1]},
        "baseline": {"score": base, "_responses": base_resp, "_probes": probes and probes[0]},
    }


def test_judge() -> None:
    same = {0: "a", 1: "b"}
    probe = [{"text": "x", "tokens": ["t1"], "logprobs": [-0.5]}]
    ok = judge(_entry(min_agreement=1.0), _parts(0.4, 0.4, same, same, (probe, probe)))
    assert ok["status"] == "passed" and ok["agreement"] == 1.0
    assert ok["probe"] == {"n": 1, "tokens_equal": 1, "max_abs_logprob_diff": 0.0}
    differ = judge(_entry(min_agreement=1.0), _parts(0.4, 0.4, same, {0: "a", 1: "c"}))
    assert differ["status"] == "failed" and differ["checks"]["agreement"] is False
    assert differ["checks"]["pd_vs_baseline"] is True
    off = judge(_entry(expected_score=0.485, tolerance=0.03), _parts(0.44, 0.44, same, same))
    assert off["status"] == "failed" and off["checks"]["pd_vs_expected"] is False
    near = judge(
        _entry(expected_score=0.485, baseline_tolerance=0.02), _parts(0.47, 0.48, same, same)
    )
    assert near["status"] == "passed"
    bad_probe = [{"text": "y", "tokens": ["t2"], "logprobs": [-0.5]}]
    assert compare_probes(probe, bad_probe)["tokens_equal"] == 0
    assert agreement({}, same) is None


def test_reports_are_written(tmp_path: Path) -> None:
    results = [
        {
            "name": "cfg-a",
            "status": "passed",
            "error": None,
            "config": {
                "model": "/x/g4tiny",
                "layout": "per_layer",
                "kvcached": True,
                "kvcached_contiguous_layout": False,
                "block_size": 16,
            },
            "pd": {"score": 0.4},
            "baseline": {"score": 0.4},
            "agreement": 1.0,
            "probe": {"n": 4, "tokens_equal": 4},
            "expected_score": 0.485,
            "tolerance": 0.03,
        },
        {
            "name": "cfg-b",
            "status": "error",
            "error": "LaunchError: prefill0 exited",
            "config": {"model": "m"},
            "pd": None,
            "baseline": None,
            "agreement": None,
            "probe": None,
            "expected_score": None,
        },
    ]
    paths = write_reports(tmp_path, results, {"config_file": "s.yaml", "metric": "m,f"})
    assert json.loads(paths["json"].read_text())["results"][0]["name"] == "cfg-a"
    md = paths["markdown"].read_text()
    assert "| cfg-a | g4tiny | per_layer | on (false) | 16 |" in md
    assert "0.485 ± 0.030" in md and "4/4" in md
    assert "| error: LaunchError: prefill0 exited |" in md
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Re-rendering from results.json alone (results copied off a GPU host).
    paths["markdown"].unlink()
    paths["plot"].unlink()
    assert pd_report.main([str(paths["json"])]) == 0
    assert "| cfg-a |" in paths["markdown"].read_text() and paths["plot"].is_file()


def test_runs_of_one_configuration_each_merge_into_one_report(tmp_path: Path) -> None:
    def run(name: str, started: str, status: str, pd: float) -> dict:
        result = {
            "name": name,
            "status": status,
            "error": None,
            "config": {"model": "g4tiny"},
            "pd": {"score": pd},
            "baseline": {"score": 0.5},
            "agreement": 1.0,
            "probe": None,
            "expected_score": None,
        }
        meta = {"config_file": "s.yaml", "started": started, "finished": started, "metric": "m"}
        return {"meta": meta, "results": [result]}

    files = []
    for i, (name, started, status, pd) in enumerate(
        [
            ("cfg-a", "2026-11-29 20:00:00", "failed", 0.1),
            ("cfg-b", "2026-11-29 22:00:00", "passed", 0.5),
            ("cfg-a", "2026-11-29 23:00:00", "passed", 0.5),  # the rerun replaces the first
        ]
    ):
        path = tmp_path / f"run{i}" / "results.json"
        path.parent.mkdir()
        path.write_text(json.dumps(run(name, started, status, pd)))
        files.append(str(path))
    with pytest.raises(SystemExit):  # several inputs and nowhere to write the merge
        pd_report.main(files)
    assert pd_report.main([*files, "--out", str(tmp_path / "merged")]) == 0
    merged = json.loads((tmp_path / "merged" / "results.json").read_text())
    assert [(r["name"], r["status"]) for r in merged["results"]] == [
        ("cfg-b", "passed"),
        ("cfg-a", "passed"),
    ]
    assert merged["meta"]["started"] == "2026-11-29 20:00:00"
    assert merged["meta"]["finished"] == "2026-11-29 23:00:00"
    assert merged["meta"]["merged_from"] == 3
    md = (tmp_path / "merged" / "results.md").read_text()
    assert md.count("| passed |") == 2 and "failed" not in md


def test_tiny_model_dir_has_a_matching_tokenizer(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "g4tiny"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "make_tiny_tokenizer.py"),
            "--config",
            str(CONFIGS / "models" / "g4tiny_config.json"),
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 4096
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert len(tok) == 4096
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    ids = tok("Question: What is 12 + 7?\nAnswer:").input_ids
    assert ids[0] == 2 and max(ids) < 4096
    assert tok.decode(ids, skip_special_tokens=True) == "Question: What is 12 + 7?\nAnswer:"
    # Every id a dummy-weight model can emit decodes to something.
    assert all(t is not None for t in tok.convert_ids_to_tokens(list(range(4096))))
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def _fake_accuracy() -> float:
    """What the fake model scores on the local task (strict match on '#### n')."""
    rows = [json.loads(x) for x in (CONFIGS / "local_task" / "kvshare_arith_test.jsonl").open()]
    right = 0
    for row in rows:
        a, op, b = re.match(r"What is (-?\d+) ([+*-]) (-?\d+)\?", row["question"]).groups()
        right += str(fake_answer(int(a), op, int(b))) == row["answer"].split("#### ")[1]
    return right / len(rows)


@pytest.mark.slow
def test_whole_sweep_against_fake_servers_with_real_lm_eval(tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    pytest.importorskip("matplotlib")
    sweep_file = tmp_path / "sweep.yaml"
    local_task = CONFIGS / "local_task"
    sweep_file.write_text(
        json.dumps(  # JSON is YAML
            {
                "defaults": {
                    "baseline_tolerance": 0.0,
                    "min_agreement": 1.0,
                    "ready_timeout": 60,
                    "eval": {
                        "task": "kvshare_arith",
                        "include_path": str(local_task),
                        "num_concurrent": 4,
                        "offline": True,
                        "run_timeout": 300,
                    },
                },
                "configs": [
                    {
                        "name": "fake-per-layer",
                        "model": "fake-model",
                        "layout": "per_layer",
                        "block_size": 16,
                        "max_model_len": 2048,
                        "gpu_memory_utilization": 0.2,
                        "eval": {"api": "completions"},
                    },
                    {
                        "name": "fake-cross-layer-kvcached",
                        "layout": "cross_layer",
                        "tiny_model_config": str(CONFIGS / "models" / "g4uniform_config.json"),
                        "kvcached": True,
                        "kvcached_contiguous_layout": False,
                        "decode_gpus": ["1"],
                        "eval": {"api": "chat"},
                    },
                    # Negative control: a decode server that generates from the wrong KV.
                    {
                        "name": "fake-corrupt-decode",
                        "model": "fake-model",
                        "baseline": False,
                        "expected_score": _fake_accuracy(),
                        "tolerance": 0.0,
                        "probe": False,
                        "env": {"FAKE_CORRUPT_DECODE": "1"},
                        "eval": {"api": "completions"},
                    },
                ],
            }
        )
    )
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "config_sweep_accuracy.sh"),
            str(sweep_file),
            "--output-dir",
            str(out),
            "--server-cmd",
            FAKE_CMD,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=480,  # ~75 s on an idle 2-core machine; generous for loaded CI
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the negative control fails
    data = json.loads((out / "results.json").read_text())
    good, kvc, corrupt = data["results"]
    expected = _fake_accuracy()
    assert 0 < expected < 1
    for r in (good, kvc):
        assert r["status"] == "passed", r
        assert r["pd"]["score"] == r["baseline"]["score"] == pytest.approx(expected)
        assert r["agreement"] == 1.0 and r["pd"]["n"] == 20
        assert r["probe"]["tokens_equal"] == r["probe"]["n"] == 4
    assert corrupt["status"] == "failed" and corrupt["pd"]["score"] == 0.0
    assert corrupt["checks"]["pd_vs_expected"] is False
    # The servers were started as configured.
    prefill_log = (out / "fake-cross-layer-kvcached" / "pd" / "prefill0.log").read_text()
    first = prefill_log.splitlines()[0]
    assert '"kv_connector_extra_config":{"cross_layer_blocks":true}' in first
    assert "--load-format dummy" in first and "--served-model-name g4uniform" in first
    baseline_log = (out / "fake-per-layer" / "baseline" / "colocated.log").read_text()
    assert "--kv-transfer-config" not in baseline_log.splitlines()[0]
    assert (out / "models" / "g4uniform" / "tokenizer.json").is_file()
    md = (out / "results.md").read_text()
    assert all(f"| {r['name']} |" in md for r in data["results"])
    assert (out / "results.png").read_bytes()[:4] == b"\x89PNG"
    # lm-eval's own files are kept, and sample-level outputs match the summary.
    _, _, _, pd_resp, _ = parse_output(
        Path(good["pd"]["results_file"]).parent.parent, "kvshare_arith", "exact_match,strict-match"
    )
    assert len(pd_resp) == 20


def test_a_configuration_that_fails_to_start_is_reported_and_the_sweep_goes_on(
    tmp_path: Path,
) -> None:
    from kvshare_connector.toolkit.sweep import run_sweep

    slow = ["--startup-delay", "30"]  # the fake server never gets ready in time
    entries = [
        SweepEntry(name=f"never-ready-{i}", model="fake-model", vllm_args=slow, ready_timeout=1.0)
        for i in range(2)
    ]
    results = run_sweep(entries, tmp_path, server_cmd=FAKE_CMD)
    assert [r["status"] for r in results] == ["error", "error"]
    assert all("not healthy after" in r["error"] for r in results)
    assert (
        "--startup-delay" in (tmp_path / "never-ready-1" / "baseline" / "colocated.log").read_text()
    )
    saved = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [r["name"] for r in saved] == ["never-ready-0", "never-ready-1"]
    assert "| error: LaunchError" in (tmp_path / "results.md").read_text()
