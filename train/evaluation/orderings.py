"""The literature's orderings of 2D schemes above the training resolution, checked against a run's results.

A published ordering (``Claim``) names vispos schemes best first. ``check`` reads a run's per-seed accuracies at
one protocol and evaluation size and tests every pair the ordering implies: the claimed better scheme's mean
minus the other's, against twice the standard error of that difference over seeds (Welch's, from each
scheme's sample standard deviation). A pair *agrees* when the difference exceeds it in the claimed
direction, is *reversed* when it exceeds it the other way, and is a *tie* otherwise. The ordering agrees when
every pair does, disagrees when any pair is reversed, and is unresolved when the rest are ties. With three
seeds the test is loose (a tie needs a gap below about 2.3 standard deviations of one seed), which is the
honest reading of three seeds. With one seed of a scheme the standard error is undefined: its pairs are
*untested* (their gaps are printed, marked as one seed's), never agreeing or reversed, and an ordering whose
pairs are all untested is itself untested.

Every row also states how many of each ranked scheme's seeds pass the convergence check
(``train.evaluation.convergence``; an evaluation-only entry, such as ``rope2d+linear``, is its trained base's
model), so that an ordering read off models still learning says so.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from itertools import combinations

from .report import seed_tables
from .results import RunResult, SchemeResult, convergences, within_of_config


@dataclass(frozen=True)
class Claim:
    """A published ordering: ``schemes`` best first, as vispos names them; ``numbers`` the source's figures."""

    source: str
    setting: str
    schemes: tuple[str, ...]
    numbers: str


CLAIMS: dict[str, Claim] = {
    "rope_vit": Claim(
        "RoPE-ViT (ECCV 2024)", "ViT-S, ImageNet-1k, trained at 224, resized 144-512",
        ("rope2d_mixed", "rope2d", "learned2d"),
        "81.8 / 80.0 / 79.4 at 384 px (1.71x); 79.1 / 76.1 / 75.4 at 512 px (2.29x)"),
    "blogpost": Claim(
        "ICLR 2025 blogpost", "ViT, ImageNet-100, trained at 224, zero-shot 96-512",
        ("alibi2d", "rope2d_mixed", "learned2d", "nope"),
        "65.8 / 58.9 / 55.9 / 54.2 at 384 px (1.71x), the same order at 448 and 512"),
    "lookhere": Claim(
        "LookHere (NeurIPS 2024)", "ViT-B/16, ImageNet-1k, trained at 224, tested up to 1024 px",
        ("lookhere2d", "rope2d"), "+21.7 top-1 over 2D RoPE at 1024 px (4.57x)"),
    "tmlr": Claim(
        "extrapolation study under review at TMLR", "ViT-Tiny, ImageNet-100, trained at 224, zero-shot to 1024",
        ("fire2d", "rope2d"), "FIRE 63.1 / RoPE 18.9 at 1024 px (4.57x)"),
}


@dataclass(frozen=True)
class Pair:
    """One implied pair: ``better`` is claimed above ``worse``; ``gap`` their mean difference (points)."""

    better: str
    worse: str
    gap: float
    se: float | None  # the standard error of ``gap`` over seeds (None: undefined, one seed of either scheme)

    @property
    def verdict(self) -> str:
        if self.se is None:
            return "untested"
        margin = 2.0 * self.se
        return "agrees" if self.gap > margin else "reversed" if self.gap < -margin else "tie"


@dataclass(frozen=True)
class Check:
    claim: Claim
    protocol: str
    size: int
    means: dict[str, float]  # scheme -> mean accuracy (%)
    pairs: list[Pair]
    converged: dict[str, tuple[int, int]]  # scheme -> (seeds that pass the convergence check, seeds checked)

    @property
    def missing(self) -> tuple[str, ...]:
        """The claimed schemes the run did not train (an ablation of a few rows)."""
        return tuple(s for s in self.claim.schemes if s not in self.means)

    @property
    def verdict(self) -> str:
        verdicts = {p.verdict for p in self.pairs}
        if "reversed" in verdicts:
            return "no"
        if verdicts == {"untested"}:
            return "untested (one seed)"
        return "yes" if verdicts == {"agrees"} else "unresolved"

    def ordering(self) -> str:
        """The schemes by mean, best first; ``≈`` where a pair is a tie, ``>`` where it is resolved, ``>?`` where
        it is untested (one seed)."""
        ranked = sorted(self.means, key=lambda s: -self.means[s])
        signs = {frozenset((p.better, p.worse)): {"tie": "≈", "untested": ">?"}.get(p.verdict, ">")
                 for p in self.pairs}  # fmt: skip
        out = f"{ranked[0]} {self.means[ranked[0]]:.1f}"
        for above, below in zip(ranked, ranked[1:], strict=False):
            sign = signs.get(frozenset((above, below)), ">")
            out += f" {sign} {below} {self.means[below]:.1f}"
        return out

    def details(self) -> str:
        """The reversed and tied pairs in words, e.g. ``reversed: learned2d above rope2d_mixed by 4.1 ± 1.2``."""
        if {p.verdict for p in self.pairs} == {"untested"}:  # the means are one seed's, the ordering shows them
            return "one seed: no pair tested" + (f"; not trained: {', '.join(self.missing)}" if self.missing else "")
        parts = []
        for p in self.pairs:
            if p.verdict == "reversed":
                parts.append(f"reversed: {p.worse} above {p.better} by {-p.gap:.1f} ± {p.se:.1f}")
            elif p.verdict == "tie":
                parts.append(f"tie: {p.better} - {p.worse} = {p.gap:+.1f} ± {p.se:.1f}")
            elif p.verdict == "untested":
                parts.append(f"untested, one seed: {p.better} - {p.worse} = {p.gap:+.1f}")
        parts += [f"not trained: {', '.join(self.missing)}"] if self.missing else []
        return "; ".join(parts) or "every pair as claimed"

    @property
    def unconverged(self) -> tuple[str, ...]:
        """The ranked schemes with a seed that fails the convergence check (unchecked seeds are not counted)."""
        return tuple(s for s, (passed, checked) in self.converged.items() if passed < checked)

    def convergence(self) -> str:
        """Per scheme, in the claimed order, ``passed/checked`` seeds of the convergence check, e.g.
        ``learned2d 0/3, rope2d 3/3``; ``–`` for a scheme with no checked seed."""
        return ", ".join(f"{s} {p}/{c}" if c else f"{s} –" for s, (p, c) in self.converged.items())


def _seed_values(results: RunResult, scheme: str, protocol: str, size: int) -> list[float]:
    tables = seed_tables(results.schemes[scheme])
    if size not in tables[0].get(protocol, {}):
        raise KeyError(f"{results.name} has no {protocol} accuracy at {size} px "
                       f"(sizes: {', '.join(map(str, results.sizes))}; protocols: {', '.join(results.protocols)})")
    return [t[protocol][size] for t in tables]


def check(results: RunResult, claim: Claim, protocol: str, size: int) -> Check:
    """Every pair ``claim`` implies, tested on ``results`` at ``protocol`` and ``size`` (px); the pairs of a
    claimed scheme the run lacks are left out and named (``missing``), as long as two schemes remain."""
    present = tuple(s for s in claim.schemes if s in results.schemes)
    if len(present) < 2:
        raise KeyError(f"{results.name} has {len(present)} of {claim.source}'s schemes "
                       f"({', '.join(claim.schemes)}); an ordering needs two")
    values = {s: _seed_values(results, s, protocol, size) for s in present}
    means = {s: statistics.fmean(v) for s, v in values.items()}

    def se(a: list[float], b: list[float]) -> float | None:
        if len(a) < 2 or len(b) < 2:
            return None  # a sample standard deviation needs two seeds
        return math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))

    pairs = [Pair(hi, lo, means[hi] - means[lo], se(values[hi], values[lo]))
             for hi, lo in combinations(present, 2)]
    return Check(claim, protocol, size, means, pairs, {s: _converged(results, s) for s in present})


def _converged(results: RunResult, scheme: str) -> tuple[int, int]:
    """(seeds that pass, seeds checked) of the model behind ``scheme``: its own, or its trained base's."""
    entry: SchemeResult = results.schemes[scheme]
    if entry.train is None and entry.scheme.base in results.schemes:
        entry = results.schemes[entry.scheme.base]
    verdicts = [v for v in convergences(entry, within_of_config(results.config)) if v is not None]
    return sum(v.converged for v in verdicts), len(verdicts)


def format_checks(checks: list[Check], train_size: int) -> str:
    """Markdown: one row per (claim, size): the published ordering, vispos's, and whether they agree."""
    lines = ["| source | published ordering | size | vispos ordering (mean top-1 %) | agrees? | pairs | converged |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for c in checks:
        published = " > ".join(c.claim.schemes)
        lines.append(f"| {c.claim.source} | {published} | {c.size} px ({c.size / train_size:.2g}x) | "
                     f"{c.ordering()} | {c.verdict} | {c.details()} | {c.convergence()} |")
    return "\n".join(lines)


def convergence_note(checks: list[Check]) -> str | None:
    """One sentence naming the rows read off models that fail the convergence check; None when there are none."""
    behind = sorted({s for c in checks for s in c.unconverged})
    if not behind:
        return None
    rows = sum(bool(c.unconverged) for c in checks)
    return (f"{rows} of {len(checks)} rows rank models that fail the convergence check ({', '.join(behind)}): "
            "those orderings hold at this schedule, and may move with training that reaches a plateau")
