"""The package's version has one source, which CHANGELOG names; the wheel check runs README's Quick start."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

import vispos

ROOT = Path(__file__).resolve().parents[1]

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None


@pytest.mark.skipif(tomllib is None, reason="tomllib (Python 3.11+) reads pyproject.toml")
def test_the_version_is_written_once_and_pyproject_reads_it() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "vispos.__version__"}


def test_the_version_is_changelogs_newest() -> None:
    """CHANGELOG's first section (``## Unreleased (X.Y.Z)`` or ``## X.Y.Z``) is the package's version."""
    first = re.search(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), flags=re.M).group(1)
    version = re.fullmatch(r"(?:Unreleased \()?(\d+\.\d+\.\d+)\)?", first).group(1)
    assert vispos.__version__ == version


def _wheel_check():
    spec = importlib.util.spec_from_file_location("wheel_check", ROOT / ".ci" / "wheel_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_wheel_check_runs_the_quick_start_it_names() -> None:
    """``.ci/wheel_check.py`` takes the block under README's "## Quick start" heading, not the first block."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    expected = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    assert _wheel_check().quick_start(readme) == expected
    assert expected != re.search(r"```python\n(.*?)```", readme, flags=re.S).group(1)  # not the intro block
    with pytest.raises(SystemExit, match="Quick start"):
        _wheel_check().quick_start("# x\n\n```python\nprint(1)\n```\n")
