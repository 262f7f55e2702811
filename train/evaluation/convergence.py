"""Whether a trained model had stopped learning: the plateau test on its validation curve.

A flat curve at the end of a cosine schedule is trivially flat (the learning rate has gone to nearly
nothing), so the test compares the last fifth of training with the fifth before it, where the learning
rate is still 10-35 % of its peak (12-41 % after the default 10 % warm-up); a model still learning gains there.
A model at chance, or on a small validation set, moves by a few images from one point to the next, so the
gain is allowed that noise too: twice its standard error, estimated from the successive differences within
each fifth (the von Neumann estimator, which a steady trend barely inflates, unlike the spread around each
fifth's mean); with one point per fifth there is no estimate, and the gain alone decides.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

NOT_CHECKED = "not checked: validate more often (train.val_every)"


@dataclass(frozen=True)
class Convergence:
    """The plateau test's verdict on one validation curve (accuracies in %, the gain in points)."""

    gain: float  # mean val acc over the last fifth of training minus the mean over the fifth before
    last: float  # mean val acc over the last fifth
    points: int  # validation points in the two fifths together
    converged: bool  # gain <= train.converged_within + 2 x noise
    noise: float = 0.0  # the gain's standard error from point-to-point noise (successive differences in each fifth)


def plateau(curve: list[list[float]], total_steps: int | None, within: float) -> Convergence | None:
    """The verdict on ``curve`` ([global step, val acc] pairs) of a run of ``total_steps`` optimiser steps:
    converged when the last fifth (step > 0.8 total) gains at most ``within`` points, plus twice the gain's
    standard error from point-to-point noise, over the fifth before (0.6 total < step <= 0.8 total). None
    when either fifth holds no validation point."""
    if not total_steps:
        return None
    last = [acc for step, acc in curve if step > 0.8 * total_steps]
    before = [acc for step, acc in curve if 0.6 * total_steps < step <= 0.8 * total_steps]
    if not last or not before:
        return None
    gain = statistics.fmean(last) - statistics.fmean(before)
    # one point's variance from the successive differences within each fifth (the step between them is the gain)
    steps = [b - a for part in (before, last) for a, b in zip(part, part[1:], strict=False)]
    point_var = sum(d * d for d in steps) / (2 * len(steps)) if steps else 0.0
    noise = math.sqrt(point_var * (1 / len(last) + 1 / len(before)))
    return Convergence(gain=gain, last=statistics.fmean(last), points=len(last) + len(before),
                       converged=gain <= within + 2 * noise, noise=noise)


def verdict_cell(verdicts: list[Convergence | None]) -> str:
    """A report cell: one seed ``yes (+0.2 ± 0.3)`` / ``no (+3.1 ± 0.4)`` (the gain ± its noise); several
    ``2/3 (+0.4 max)`` (converged / checked seeds, the largest gain); ``–`` when no seed was checked."""
    checked = [v for v in verdicts if v is not None]
    if not checked:
        return "–"
    if len(verdicts) == 1:
        v = checked[0]
        return f"{'yes' if v.converged else 'no'} ({v.gain:+.1f} ± {v.noise:.1f})"
    unchecked = len(verdicts) - len(checked)
    return (f"{sum(v.converged for v in checked)}/{len(checked)} ({max(v.gain for v in checked):+.1f} max"
            + (f"; {unchecked} not checked" if unchecked else "") + ")")


def lr_window(warmup: float, floor: float = 0.0) -> tuple[float, float]:
    """The learning rate, as a fraction of its peak, at the end and at the start of the fifth before the last
    (80 % and 60 % of the steps), under train.engine.schedule's warm-up over ``warmup`` of the steps followed by
    a cosine down to ``floor`` (min_lr / lr), with steps taken as fractions of the run."""
    def at(t: float) -> float:
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * (t - warmup) / (1.0 - warmup)))
    return at(0.8), at(0.6)


def rule_text(within: float, window: tuple[float, float]) -> str:
    """The rule and its tolerance, in one sentence for a report; ``window`` is ``lr_window`` of the run."""
    low, high = window
    return (f"converged: the mean validation accuracy (training size) over the last fifth of training gains at "
            f"most {within:g} points (train.converged_within) plus twice the gain's standard error from "
            f"point-to-point noise over the fifth before, where the learning rate is still {100 * low:.0f}-"
            f"{100 * high:.0f} % of its peak")
