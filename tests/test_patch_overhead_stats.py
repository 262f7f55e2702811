"""The overhead benchmark's interval (benchmarks/patch_overhead.py): a bootstrap of the median of per-round
ratios, tested on ratios of known spread (no timing here)."""

from __future__ import annotations

import random
import statistics

from benchmarks.patch_overhead import CONTROL, configurations, interval


def test_the_interval_holds_the_median_and_narrows_with_more_rounds() -> None:
    rng = random.Random(3)
    few = [1.05 + rng.gauss(0, 0.03) for _ in range(8)]
    many = [1.05 + rng.gauss(0, 0.03) for _ in range(128)]
    for ratios in (few, many):
        low, high = interval(ratios)
        assert low <= statistics.median(ratios) <= high
    assert interval(many)[1] - interval(many)[0] < (interval(few)[1] - interval(few)[0]) / 2
    low, high = interval(many)
    expected = 2 * 1.96 * 1.2533 * 0.03 / len(many) ** 0.5  # the median's normal-theory 95 % width
    assert expected / 2 < high - low < expected * 2
    assert interval(few) == interval(few)  # seeded: a rerun of the report prints the same interval


def test_a_constant_ratio_has_no_width_and_the_control_row_is_the_unpatched_model_again() -> None:
    assert interval([1.02] * 10) == (1.02, 1.02)
    configs = configurations(["rope2d"])
    baseline, _ = configs[CONTROL]
    assert baseline == configs["vispos rope2d"][0]  # measured against the same baseline as every scheme
