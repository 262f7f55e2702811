"""Catalogue claims about measured extrapolation agree with the project's committed results.

A scheme's ``extrapolation`` text that cites a results document (``docs/seq1d.md``, ``docs/fmnist_full``)
states something those results show; each such claim is checked here against the run's results.json, so
a rerun that contradicts the catalogue fails. Committed reports are also what the report generator
writes from their results.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import vispos
from train.evaluation.report import write_outputs
from train.evaluation.results import RunResult

DOCS = Path(__file__).resolve().parents[1] / "docs"


def passkey(row: str, run: str = "passkey") -> list[float]:
    """Passkey accuracy of a row at 1x, 2x, 4x, 8x the training length (docs/seq1d/<run>)."""
    results = json.loads((DOCS / "seq1d" / run / "results.json").read_text())
    accuracy = results["tasks"]["passkey"]["rows"][row]["accuracy"]
    return [accuracy[str(n)] for n in results["lengths"]]


def below_learned2d_at_2x(run: str) -> bool:
    """rope2d_mixed's mean accuracy at twice the training size is below learned2d's in docs/<run>."""
    data = json.loads((DOCS / run / "results.json").read_text())
    at_2x = str(2 * data["train_size"])
    acc = {n: data["schemes"][n]["accuracy"]["resize"][at_2x] for n in ("rope2d_mixed", "learned2d")}
    return acc["rope2d_mixed"] < acc["learned2d"]


# scheme -> (ndim, the document its claim cites, the check of that claim)
CLAIMS = {
    "alibi": (1, "docs/seq1d.md", lambda: min(passkey("alibi")) >= 0.95),  # "holds to 8x"
    "rope": (1, "docs/seq1d.md", lambda: passkey("rope")[1] < passkey("rope")[0] and passkey("rope")[-1] < 0.5),
    "sincos1d": (1, "docs/seq1d.md", lambda: passkey("sincos1d")[1] < passkey("sincos1d")[0]),
    "xpos": (1, "docs/seq1d.md", lambda: all(
        x > r for x, r in zip(passkey("xpos")[1:], passkey("rope")[1:], strict=True))),
    "fire": (1, "docs/seq1d.md", lambda: min(passkey("fire", "fire")[:3]) >= 0.95
             and passkey("fire", "fire")[3] < passkey("alibi", "fire")[3]),  # "holds to 4x ... 96% at 8x"
    "rope2d_mixed": (2, "docs/fmnist_native, docs/fmnist_full",
                     lambda: below_learned2d_at_2x("fmnist_native") and below_learned2d_at_2x("fmnist_full")),
}


@pytest.mark.parametrize("scheme", CLAIMS)
def test_cited_extrapolation_claims_hold_in_the_cited_results(scheme: str) -> None:
    ndim, source, holds = CLAIMS[scheme]
    assert source in vispos.get_info(scheme, ndim).extrapolation
    assert holds()


def test_every_extrapolation_text_citing_a_result_is_checked_here() -> None:
    citing = {i.name for n in (1, 2) for i in map(lambda s: vispos.get_info(s, n), vispos.list_encodings(n))
              if "docs/" in i.extrapolation}
    assert citing == set(CLAIMS)


@pytest.mark.parametrize("run", ["fmnist_full", "fmnist_extrapolation", "fmnist_native", *(
    f"fmnist_native/ablations/{a}" for a in ("crop008", "heads1", "crop008_heads1", "long", "long4", "poslr30")),
    "fmnist_native/quick", "fmnist_grid14", "fmnist_grid14/seed_0", "fmnist_grid14/seed_1", "fmnist_grid14/seed_2",
    "fmnist_grid14/quick", "fmnist_grid14/ablations/alibi2d_heads1"])
def test_committed_report_is_what_the_generator_writes(run: str, tmp_path: Path) -> None:
    """results.md from results.json: the duration line is the training and fine-tuning time summed over
    entries and seeds (a resumed run's last call took seconds)."""
    results = RunResult.from_json(json.loads((DOCS / run / "results.json").read_text()))
    assert write_outputs(results, tmp_path) and (tmp_path / "results.md").read_text() == (
        DOCS / run / "results.md"
    ).read_text()
