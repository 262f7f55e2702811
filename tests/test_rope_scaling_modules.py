"""RoPE scaling inside the modules: rope rotates by the scaled angles, rope2d scales each axis by its own
factor (its YaRN attention factor the geometric mean of the axes')."""

from __future__ import annotations

import math

import pytest
import torch
from rope_scaling_refs import (
    plain,
    yarn_reference,
)

import vispos


@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_rope_module_rotates_by_scaled_angles(kind: str) -> None:
    d, l0, n = 16, 8, 32
    rope = vispos.create_encoding("rope", dim=d, scaling={"type": kind, "factor": 4.0, "original_length": l0})
    rot = rope(n)
    inv = [f / 4 for f in plain(d, 1e4)] if kind == "linear" else yarn_reference(d, 1e4, 4.0, l0)
    att = 1.0 if kind == "linear" else 0.1 * math.log(4) + 1
    angles = torch.tensor([[p * f for f in inv] for p in range(n)], dtype=torch.float64)
    torch.testing.assert_close(rot.cos.double(), att * torch.cat((angles.cos(), angles.cos()), -1), atol=1e-5, rtol=0)
    torch.testing.assert_close(rot.sin.double(), att * torch.cat((angles.sin(), angles.sin()), -1), atol=1e-5, rtol=0)


def test_rope2d_scales_each_axis_by_its_own_factor() -> None:
    d, train, grid = 16, (4, 6), (8, 6)  # y grows 2x, x not at all
    rope2d = vispos.create_encoding("rope2d", dim=d, scaling="linear", train_grid=train)
    rot = rope2d(grid)
    f = plain(d // 2, 100.0)  # each axis: d / 2 channels, d / 4 pairs
    cells = [(y, x) for y in range(grid[0]) for x in range(grid[1])]
    angles = torch.tensor([[x * fj for fj in f] + [y * fj / 2 for fj in f] for y, x in cells], dtype=torch.float64)
    torch.testing.assert_close(rot.cos.double(), torch.cat((angles.cos(), angles.cos()), -1), atol=1e-5, rtol=0)
    plain_rot = vispos.create_encoding("rope2d", dim=d)(train)
    torch.testing.assert_close(rope2d(train).cos, plain_rot.cos)  # at the training grid: unchanged


def test_rope2d_yarn_attention_factor_is_geometric_mean_of_axes() -> None:
    d = 16
    rope2d = vispos.create_encoding("rope2d", dim=d, scaling={"type": "yarn"}, train_grid=(4, 4))
    rot = rope2d((8, 4))
    att_y, att_x = 0.1 * math.log(2) + 1, 1.0
    assert float(rot.cos[0, 0]) == pytest.approx(math.sqrt(att_y * att_x), rel=1e-6)  # angle 0 at (0, 0)
