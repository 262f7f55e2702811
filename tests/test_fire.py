"""``fire`` against the FIRE in common use (``tests/fire_ref.py``, mcleish7/arithmetic at 86022a5), and
``fire2d``, vispos's 2D form, against its formula and its rule on other grids.

- 1D: a released FIRE's state dict loads into ``fire`` as it is, and both give the same bias (fp32, 1e-5) at
  the released defaults and with a threshold the positions pass (progressive interpolation at work), at a
  training length and at 4x it; the causal form masks later keys; batched positions give each row its own.
- 2D: the bias per offset equals the module docstring's formula written out here; with the default
  threshold it is relative at and below the training grid, and beyond it the largest offsets of every grid
  meet the same MLP input (+-1): a larger grid is interpolated into the training range.
"""

from __future__ import annotations

import math

import pytest
import torch
from fire_ref import FIRE

import vispos

HEADS = 4


def released(seed: int, **options: object) -> FIRE:
    torch.manual_seed(seed)
    ref = FIRE(num_heads=HEADS, **options).eval()
    with torch.no_grad():  # away from the initial values, so that c and L matter
        ref.c.fill_(0.37)
        ref.L_multiplier.fill_(1.3)
    return ref


@pytest.mark.parametrize("length", [16, 64], ids=["train", "4x"])
@pytest.mark.parametrize("options", [{}, {"init_L": 8.0, "mlp_width": 16}], ids=["released", "threshold-8"])
def test_fire_equals_the_released_module_with_its_weights(options: dict, length: int) -> None:
    ref = released(0, **options)
    ours = vispos.create_encoding(
        "fire", num_heads=HEADS, threshold=options.get("init_L", 512.0), mlp_width=options.get("mlp_width", 32)
    )
    ours.load_state_dict(ref.state_dict())  # the same parameter names: c, init_L, L_multiplier, mlp
    with torch.no_grad():
        expected = ref(length, torch.device("cpu"))[0]  # [heads, N, N]
        got = ours(length)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_fire_is_relative_before_its_threshold_and_not_past_it() -> None:
    fire = vispos.create_encoding("fire", num_heads=HEADS, threshold=10.0)
    with torch.no_grad():
        bias = fire(40)
    torch.testing.assert_close(bias[:, 5, 2], bias[:, 9, 6])  # queries before L = 10: the offset alone
    assert (bias[:, 20, 17] - bias[:, 35, 32]).abs().max() > 1e-3  # past it: normalised by the query's position


def test_fire_causal_masks_later_keys_and_keeps_the_rest() -> None:
    open_, causal = (vispos.create_encoding("fire", num_heads=HEADS, threshold=4.0, causal=c) for c in (False, True))
    causal.load_state_dict(open_.state_dict())
    a, b = open_(10), causal(10)
    later = torch.ones(10, 10, dtype=torch.bool).triu(1)
    assert torch.isinf(b[:, later]).all() and (b[:, later] < 0).all()
    torch.testing.assert_close(b[:, ~later], a[:, ~later])


def test_fire_batched_positions_give_each_row_its_own_bias() -> None:
    fire = vispos.create_encoding("fire", num_heads=HEADS, threshold=3.0)
    positions = torch.tensor([[0, 1, 2, 3, 4], [5, 7, 9, 11, 13]])
    both = fire(positions)
    assert both.shape == (2, HEADS, 5, 5)
    for row in range(2):
        torch.testing.assert_close(both[row], fire(positions[row]))


def _fire2d_formula(enc: torch.nn.Module, grid: tuple[int, int]) -> torch.Tensor:
    """fire2d's bias per offset, from its formula with plain loops: [heads, 2H-1, 2W-1]."""
    fire = enc.fire
    c, threshold, eps = fire.c.item(), abs(fire.L_multiplier.item() * fire.init_L.item()), fire.eps

    def psi(x: float) -> float:
        return math.log(abs(c * x) + 1)

    h, w = grid
    out = torch.zeros(HEADS, 2 * h - 1, 2 * w - 1)
    for i, dy in enumerate(range(-(h - 1), h)):
        for j, dx in enumerate(range(-(w - 1), w)):
            u = [math.copysign(psi(d), d) / (psi(max(g - 1, threshold)) + eps) for d, g in ((dy, h), (dx, w))]
            with torch.no_grad():
                out[:, i, j] = fire.mlp(torch.tensor(u))
    return out


@pytest.mark.parametrize("grid", [(5, 7), (11, 9)], ids=["train", "larger"])
def test_fire2d_bias_is_its_formula(grid: tuple[int, int]) -> None:
    torch.manual_seed(1)
    enc = vispos.create_encoding("fire2d", num_heads=HEADS, train_grid=(5, 7))
    with torch.no_grad():
        enc.fire.c.fill_(0.6)
    assert enc.fire.init_L.item() == 6.0  # the default threshold: max(H, W) - 1 of the training grid
    torch.testing.assert_close(enc.offset_bias(grid).detach(), _fire2d_formula(enc, grid), rtol=1e-5, atol=1e-5)


def test_fire2d_is_relative_below_its_threshold_and_interpolates_beyond_it() -> None:
    torch.manual_seed(2)
    enc = vispos.create_encoding("fire2d", num_heads=HEADS, train_grid=(5, 7))
    with torch.no_grad():
        train, smaller, larger, largest = (enc.offset_bias(g) for g in ((5, 7), (3, 4), (9, 13), (17, 25)))
    # at and below the training grid, an offset has one value whatever the grid
    torch.testing.assert_close(smaller, train[:, 2:-2, 3:-3])
    # beyond it, the largest offsets of every grid meet the same inputs (+-1): the same bias at the corners
    corners = (slice(None), [0, 0, -1, -1], [0, -1, 0, -1])
    torch.testing.assert_close(largest[corners], larger[corners])
    # and a one-patch step reads a smaller input on the larger grid: offset (1, 1) moves towards offset 0
    assert (larger[:, 9, 13] - train[:, 5, 7]).abs().max() > 1e-4
