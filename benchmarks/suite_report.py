"""The report of ``make hf-suite`` and ``make timm-tests``: a host's own tests run on unpatched and
vispos-patched models, compared test by test.

``Outcomes`` collects one outcome per (family, scheme, test) from pytest's reports, prints per family and
scheme the tests passed / failed / skipped unpatched and patched, and lists every test that passes unpatched
and not patched with its reason (from the suite's list of tests that cannot apply to a patched model) or as
unexplained. The run's exit status is 1 when one is unexplained, else 0: tests that fail unpatched too are the
host's or the glue's, not vispos's."""

from __future__ import annotations

import collections
import fnmatch
from collections.abc import Mapping

import pytest

UNPATCHED = "unpatched"


class Outcomes:
    def __init__(self, title: str, known: Mapping[tuple[str, str, str], str]):
        """``known``: (test name pattern, family pattern, scheme pattern) -> why that test cannot apply."""
        self.title, self.known = title, known
        self.seen: dict[tuple[str, str], dict[str, str]] = collections.defaultdict(dict)

    def reason(self, family: str, scheme: str, test: str) -> str | None:
        for (t, f, s), why in self.known.items():
            if fnmatch.fnmatch(test, t) and fnmatch.fnmatch(family, f) and fnmatch.fnmatch(scheme, s):
                return why
        return None

    def add(self, family: str, scheme: str, test: str, report: pytest.TestReport) -> None:
        """A test's outcome: failed if any of its reports failed (set-up, a subtest, the call, teardown), else
        skipped if skipped, else passed."""
        if report.when != "call" and report.passed:
            return
        seen = self.seen[(family, scheme)]
        if report.failed or test not in seen:
            seen[test] = report.outcome

    def regressions(self) -> dict[tuple[str, str], dict[str, str | None]]:
        """(family, patched scheme) -> test -> reason (None: unexplained), for tests passing unpatched only."""
        out: dict[tuple[str, str], dict[str, str | None]] = {}
        for (family, scheme), tests in sorted(self.seen.items()):
            if scheme == UNPATCHED:
                continue
            base = self.seen.get((family, UNPATCHED), {})
            lost = {t: self.reason(family, scheme, t) for t, o in tests.items()
                    if o != "passed" and base.get(t) == "passed"}  # fmt: skip
            if lost:
                out[(family, scheme)] = lost
        return out

    def table(self) -> list[str]:
        lines = ["| family | scheme | unpatched passed / failed / skipped | patched passed / failed / skipped | "
                 "passing unpatched only: explained / not |", "| --- | --- | --- | --- | --- |"]  # fmt: skip
        lost = self.regressions()
        for family in sorted({f for f, _ in self.seen}):
            base = collections.Counter(self.seen.get((family, UNPATCHED), {}).values())
            for scheme in sorted({s for f, s in self.seen if f == family and s != UNPATCHED}):
                got = collections.Counter(self.seen[(family, scheme)].values())
                why = lost.get((family, scheme), {})
                explained = sum(r is not None for r in why.values())
                lines.append(f"| {family} | {scheme} | {base['passed']} / {base['failed']} / {base['skipped']} | "
                             f"{got['passed']} / {got['failed']} / {got['skipped']} | {explained} / "
                             f"{len(why) - explained} |")  # fmt: skip
        return lines

    def summary(self, terminalreporter) -> None:
        if not self.seen:
            return
        terminalreporter.section(self.title)
        for line in self.table():
            terminalreporter.write_line(line)
        for (family, scheme), tests in self.regressions().items():
            for test, why in sorted(tests.items()):
                terminalreporter.write_line(f"{family} {scheme} {test}: {why or 'UNEXPLAINED (passes unpatched)'}")

    def exit_status(self, session: pytest.Session) -> None:
        if self.seen:
            unexplained = any(r is None for tests in self.regressions().values() for r in tests.values())
            session.exitstatus = 1 if unexplained else 0
