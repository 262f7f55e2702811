"""docs/performance.md's compiled tables at ViT-S's width are what ``benchmarks.compiled_work`` prints from the
records it wrote (docs/compiled_work*.json): the figures in the text come from a command, not by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.compiled_work import table

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("records", "mode"), [("docs/compiled_work.json", "inference"),
                                               ("docs/compiled_work_training.json", "training")])
def test_performance_doc_holds_the_table_of_the_committed_records(records: str, mode: str) -> None:
    rows = json.loads((ROOT / records).read_text())
    assert {r["mode"] for r in rows} == {mode} and {r["size"] for r in rows} == {224}
    doc = (ROOT / "docs/performance.md").read_text()
    assert table(rows) in doc
    assert f"--json {records}" in doc  # the command that wrote them is named beside the table
