"""README's 14 x 14 table and docs/resolution.md's table of the seeds read the committed report
(docs/fmnist_grid14/results.md, itself tested to be what the generator writes from results.json): each cell is
the report's cell for that scheme and size, and the text names the seeds the report holds."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "docs/fmnist_grid14"
WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}


def _rows(lines: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """The header cells and the rows (first cell's first word: the entry) of the markdown table starting at
    ``lines[0]``."""
    end = next((i for i, line in enumerate(lines) if not line.startswith("|")), len(lines))
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[:end]]
    return cells[0], {row[0].split()[0]: row[1:] for row in cells[2:]}


def _table_after(text: str, marker: str) -> tuple[list[str], dict[str, list[str]]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if marker in line)
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("| scheme |"))
    return _rows(lines[first:])


def _report() -> tuple[dict[str, dict[int, str]], dict[str, dict[int, str]]]:
    """The report's resize tables: accuracy and change from the training size, per entry and pixel size."""
    md = (REPORT / "results.md").read_text()
    section = md.split("### resize")[1].split("\n### ")[0]
    tables = []
    for marker in ("Top-1 accuracy (%)", "Change from the training resolution"):
        header, rows = _table_after(section, marker)
        sizes = [int(re.match(r"(\d+) px", h).group(1)) for h in header[1:]]
        tables.append({name: dict(zip(sizes, cells, strict=True)) for name, cells in rows.items()})
    return tables[0], tables[1]


def _seeds() -> list[int]:
    return json.loads((REPORT / "results.json").read_text())["seeds"]


@pytest.mark.parametrize(("doc", "marker", "every"), [("README.md", "On ViT-S's 14 x 14 token grid", False),
                                                      ("docs/resolution.md", "### Measured: seeds", True)])
def test_doc_table_is_the_reports(doc: str, marker: str, every: bool) -> None:
    """README's headline leaves the position-free control out; resolution.md lists every entry."""
    accuracy, change = _report()
    header, rows = _table_after((ROOT / doc).read_text(), marker)
    assert set(rows) == set(accuracy) if every else set(rows) < set(accuracy)
    for column, title in enumerate(header[1:]):
        if m := re.fullmatch(r"(?:change )?(\d+) -> (\d+)", title):
            source, size = change, int(m.group(2))
        else:
            source, size = accuracy, int(re.match(r"(\d+) px", title).group(1))
        for name, cells in rows.items():
            assert cells[column] == source[name][size], (doc, name, title)


def test_docs_name_the_seeds_the_report_holds() -> None:
    seeds = _seeds()
    readme = (ROOT / "README.md").read_text()
    resolution = (ROOT / "docs/resolution.md").read_text()
    named = ", ".join(map(str, seeds[:-1])) + f" and {seeds[-1]}"
    assert f"mean ± std over the {WORDS[len(seeds)]} seeds" in " ".join(readme.split())
    assert f"mean ± std over seeds {named}:" in " ".join(resolution.split())
