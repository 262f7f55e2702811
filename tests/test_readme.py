"""The Python examples of README and docs/ run as written (docs that match behaviour)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    (page, i, code)
    for page in PAGES
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))
]


def test_readme_has_examples() -> None:
    assert sum(page.name == "README.md" for page, _, _ in BLOCKS) >= 2


@pytest.mark.parametrize(("page", "index", "code"), BLOCKS, ids=[f"{p.relative_to(ROOT)}:{i}" for p, i, _ in BLOCKS])
def test_example_runs(page: Path, index: int, code: str) -> None:
    exec(compile(code, f"{page.relative_to(ROOT)} python block {index}", "exec"), {})


def test_readme_catalogue_is_the_registry_table() -> None:
    """README's catalogue is ``vispos.describe()`` verbatim, so a changed scheme text shows up here."""
    import vispos

    assert vispos.describe() in (ROOT / "README.md").read_text()
