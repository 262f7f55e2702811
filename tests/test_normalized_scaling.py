"""RoPE scaling on DINOv3's normalized coordinates, against the rules the scalings are defined by.

Normalized coordinates span [-1, 1] at every size: position interpolation by construction. A scaling first
stretches each axis of a grid larger than training by size / training size (the training spacing), then
scales the frequencies from there. The references below are measured from the unscaled module at the
training grid (the per-row angle step of each pair, and how many turns it makes over the training image),
then compared with each method's published rule: linear (Chen et al. 2023) divides every step by s, NTK-aware
(bloc97) by s ** (2j / (d - 2)), YaRN (Peng et al. 2023) keeps the pairs that turn at least beta_fast times
over the training length, interpolates those that turn at most beta_slow times.
"""

from __future__ import annotations

import math

import pytest
import torch

from vispos.encodings.rope2d import Rope2d

DIM, THETA, TRAIN = 64, 100.0, (6, 4)  # DINOv3's base; a non-square training grid
PAIRS = DIM // 4  # rotary pairs per axis


def rope(scaling: object = None, **options: object) -> Rope2d:
    defaults = dict(dim=DIM, theta=THETA, coords="normalized", axes="yx", layout="half")
    return Rope2d(**(defaults | options), scaling=scaling, train_grid=TRAIN if scaling else None).eval()


def row_step(module: Rope2d, grid: tuple[int, int]) -> torch.Tensor:
    """Each y pair's angle step between two neighbouring rows at ``grid`` [PAIRS] (axes="yx": y pairs first)."""
    angles, _ = module.angles(grid)  # [H*W, DIM / 2]
    return angles[grid[1], :PAIRS] - angles[0, :PAIRS]


@pytest.mark.parametrize("normalize", ["separate", "min", "max"])
@pytest.mark.parametrize("grid", [(6, 4), (12, 8), (18, 4), (3, 2), (12, 20)])
def test_linear_scaling_is_dinov3s_own_frame_at_every_size(normalize: str, grid: tuple[int, int]) -> None:
    native, linear = rope(normalize=normalize), rope("linear", normalize=normalize)
    a, b = native(grid), linear(grid)
    torch.testing.assert_close(b.cos, a.cos, rtol=0, atol=1e-5)
    torch.testing.assert_close(b.sin, a.sin, rtol=0, atol=1e-5)
    assert b.temperature == 1.0


@pytest.mark.parametrize("kind", ["linear", "ntk", "dynamic_ntk", "yarn", "llama3"])
@pytest.mark.parametrize("grid", [TRAIN, (3, 4), (6, 2)])
def test_no_scaling_changes_anything_at_or_below_the_training_grid(kind: str, grid: tuple[int, int]) -> None:
    a, b = rope()(grid), rope(kind)(grid)
    torch.testing.assert_close(b.cos, a.cos, rtol=0, atol=1e-6)
    assert b.temperature == 1.0


def test_above_the_training_grid_the_scaled_frame_keeps_the_training_spacing() -> None:
    """The stretched frame without any frequency change (factor 1) is extrapolation: every pair turns by its
    training step between rows, where DINOv3's own frame would halve it at twice the grid."""
    train_step = row_step(rope(), TRAIN)
    stretched = rope({"type": "linear", "factor": 1.0})
    torch.testing.assert_close(row_step(stretched, (12, 8)), train_step, rtol=1e-5, atol=0)
    torch.testing.assert_close(row_step(rope(), (12, 8)), train_step / 2, rtol=1e-5, atol=0)


def test_ntk_scales_each_pair_as_the_ntk_aware_rule() -> None:
    s = 2.0
    expected = row_step(rope(), TRAIN) * s ** (-2 * torch.arange(PAIRS) / (2 * PAIRS - 2))
    torch.testing.assert_close(row_step(rope("ntk"), (12, 8)), expected, rtol=1e-5, atol=0)


def test_yarn_keeps_the_pairs_that_turn_often_over_the_training_image() -> None:
    s, fast, slow = 3.0, 1.0, 0.1
    train_step = row_step(rope(), TRAIN)
    turns = train_step * TRAIN[0] / (2 * math.pi)  # turns of each pair over the training image's height
    assert turns.max() > fast and turns.min() < slow  # the ramp's three regions all hold pairs
    scaling = {"type": "yarn", "beta_fast": fast, "beta_slow": slow, "truncate": False}
    yarn = rope(scaling)
    ratio = row_step(yarn, (18, 12)) / train_step
    kept, interpolated = turns >= fast, turns <= slow
    torch.testing.assert_close(ratio[kept], torch.ones(int(kept.sum())), rtol=1e-5, atol=0)
    torch.testing.assert_close(ratio[interpolated], torch.full((int(interpolated.sum()),), 1 / s), rtol=1e-5, atol=0)
    between = ~(kept | interpolated)
    assert between.any() and ((ratio[between] < 1) & (ratio[between] > 1 / s)).all()
    assert yarn((18, 12)).temperature == pytest.approx(0.1 * math.log(s) + 1.0)


def test_scaling_on_dinov3_periods_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="defined on theta's frequencies, not on min_period / max_period"):
        Rope2d(dim=DIM, coords="normalized", min_period=0.5, max_period=40.0, scaling="linear", train_grid=TRAIN)
