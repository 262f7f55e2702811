"""The transformers floor is one claim, written in pyproject.toml and in vispos.hf, and kept: an older release
is refused by name (``make test-hf-min`` runs the adapter's tests at the floor itself)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import vispos.hf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_the_floor_is_declared_once() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    declared = re.search(r'^hf = \["transformers>=([0-9.]+)"\]', text, re.M).group(1)
    assert tuple(int(p) for p in declared.split(".")) == vispos.hf.TRANSFORMERS_MIN
    assert f'"transformers>={declared}"' in re.search(r"^test = \[.*\]", text, re.M).group(0)


def test_an_older_transformers_is_refused_by_name() -> None:
    with pytest.raises(ImportError, match=r"transformers >= 5\.18.*found 5\.17\.0"):
        vispos.hf.check_version("5.17.0")
    vispos.hf.check_version("5.18.0")
    vispos.hf.check_version("6.0.0.dev0")
