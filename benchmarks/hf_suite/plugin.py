"""The pytest plugin of ``make hf-suite``: transformers' own common model tests on vispos-patched models.

Loaded with ``-p benchmarks.hf_suite.plugin``. At start-up it makes ``tests/`` of the installed transformers'
sdist (``benchmarks.suite_sources``, fetched once into ``.cache/``) importable as the package
``transformers_tests``. The sdist ships ``test_modeling_common.py`` but not the two mixins it imports from
``tests/exporters`` and ``tests/generation``: empty stand-ins take their place, so transformers' export and
``generate`` tests do not run (vision encoders do not generate).

At the end it prints the comparison of ``benchmarks.suite_report`` (the reasons from ``known.py``)."""

from __future__ import annotations

import sys
import types

import pytest

from benchmarks.hf_suite.known import KNOWN
from benchmarks.suite_report import Outcomes
from benchmarks.suite_sources import sources

PACKAGE = "transformers_tests"
OUTCOMES = Outcomes("transformers' common model tests on vispos-patched models", KNOWN)


def _stand_in(name: str, **attrs: object) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


def pytest_configure(config: pytest.Config) -> None:  # noqa: ARG001
    tests = sources("transformers") / "tests"
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(tests)]  # the sdist's files import each other relatively
    sys.modules[PACKAGE] = package
    for sub in ("exporters", "generation"):
        _stand_in(f"{PACKAGE}.{sub}", __path__=[])
    _stand_in(f"{PACKAGE}.exporters.test_export", ExportTesterMixin=type("ExportTesterMixin", (), {}))
    _stand_in(f"{PACKAGE}.generation.test_utils", GenerationTesterMixin=type("GenerationTesterMixin", (), {}))


def _key(nodeid: str) -> tuple[str, str, str] | None:
    parts = nodeid.split("::")
    if len(parts) < 3 or not parts[-2].startswith("Test_"):
        return None
    family, scheme = parts[-2][len("Test_") :].split("__")
    return family, scheme, parts[-1]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    key = _key(report.nodeid)
    if key is not None:
        OUTCOMES.add(*key, report)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ARG001
    OUTCOMES.summary(terminalreporter)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:  # noqa: ARG001
    OUTCOMES.exit_status(session)
