"""The README and docs say what the code does: the option tables are the code's own, the
README stays short and keeps its two commands, every docs page links back to it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvshare_connector.backends.options import ConnectorOptions

ROOT = Path(__file__).resolve().parents[1]
TABLE = re.compile(r"<!-- options:.*?-->\n(.*?)\n<!-- /options -->", re.S)


@pytest.mark.parametrize("page", ["README.md", "docs/configuration.md"])
def test_the_option_table_is_the_codes(page):
    """Every option in ``ConnectorOptions`` (name, default, variable, help) and no other;
    regenerate with ``ConnectorOptions.markdown_table()``."""
    found = TABLE.search((ROOT / page).read_text())
    assert found is not None, f"{page} has no options block"
    assert found.group(1).strip() == ConnectorOptions.markdown_table()


def test_the_readme_is_short_and_keeps_its_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 120
    assert "bash scripts/demo.sh" in text and "bash scripts/test.sh" in text
    for link in re.findall(r"\]\(((?:docs|results)/[^)#]+)\)", text):
        assert (ROOT / link).exists(), link


def test_every_docs_page_links_back_to_the_readme():
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert len(pages) >= 8
    for page in pages:
        assert "(../README.md)" in page.read_text(), page.name


def test_results_keep_evidence_not_archives():
    """Each run under results/ is its write-up (README.md, or one per benchmark) and summary
    data, at most 200 KB, no raw logs."""
    runs = sorted(p for p in (ROOT / "results").glob("*/*") if p.is_dir())
    assert runs
    for run in runs:
        files = [p for p in run.rglob("*") if p.is_file()]
        assert any(p.suffix == ".md" for p in files), run
        assert sum(p.stat().st_size for p in files) <= 200_000, run
        raw = [p.name for p in files if p.suffix in {".log", ".tgz", ".gz", ".jsonl", ".err"}]
        assert not raw, (run, raw)
