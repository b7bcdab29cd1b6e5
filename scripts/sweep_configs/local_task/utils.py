"""Loads the kvshare_arith task's JSONL files from this directory (no network, no HF hub).

lm-eval resolves relative ``data_files`` against the working directory, not the YAML file, so
the task uses ``custom_dataset`` and reads the files next to this module instead.
"""

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _read(name: str) -> list[dict]:
    with open(HERE / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_local(**kwargs) -> datasets.DatasetDict:
    """lm-eval passes metadata/model args as kwargs; the task needs none of them."""
    return datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(_read("kvshare_arith_train.jsonl")),
            "test": datasets.Dataset.from_list(_read("kvshare_arith_test.jsonl")),
        }
    )
