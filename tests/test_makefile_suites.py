"""The hosts' suite targets (``make hf-suite``, ``make timm-tests``, ``make suites-ci``) run in the interpreter
given as ``PY`` as it is, and build the virtual environment first only when ``PY`` is that environment's python
(as on a fresh CI machine). Checked with ``make -n`` (nothing runs), against an environment that does not exist."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def dry_run(*args: str) -> str:
    done = subprocess.run(["make", "-n", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True)  # fmt: skip
    return done.stdout


@pytest.mark.parametrize("target", ["hf-suite", "timm-tests", "suites-ci"])
def test_suite_targets_use_a_given_interpreter_without_building_the_venv(target: str, tmp_path: Path) -> None:
    plan = dry_run(target, f"VENV={tmp_path / 'venv'}", f"PY={sys.executable}")
    assert "-m venv" not in plan and "pip install" not in plan
    assert f"{sys.executable} " in plan  # the suites run in it


@pytest.mark.parametrize("target", ["hf-suite", "timm-tests", "suites-ci"])
def test_suite_targets_build_the_default_venv_first(target: str, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    plan = dry_run(target, f"VENV={venv}")
    assert plan.index(f"-m venv {venv}") < plan.index("pytest")
