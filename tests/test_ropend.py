"""``ropend``, N-D axial RoPE: on two axes it is ``rope2d``; the presets' channel splits; logits that depend on the
N-D offsets alone; per-axis scaling (the presets against each model's code: ``tests/test_ropend_presets.py``).
"""

from __future__ import annotations

import math

import pytest
import torch
from rope_family import CLEAR, GRID, HEAD_DIM, SEEDS, content

import vispos
from vispos.encodings.coords2d import grid_coords


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("coords", ["pixel", "normalized"])
def test_ropend_on_two_axes_is_rope2d(layout: str, coords: str) -> None:
    """(y, x) coordinates, half the channels per axis, the same theta: bit-equal to rope2d(axes='yx') with
    interleaved pairs; with ``half`` (pairs inside each axis's section) the same after gathering rope2d's
    channels of each axis together ([y pairs | their partners | x pairs | their partners])."""
    theta = 100.0
    split = (HEAD_DIM // 2, HEAD_DIM // 2)
    nd = vispos.create_encoding("ropend", dim=HEAD_DIM, split=split, theta=theta, layout=layout)
    axial = vispos.create_encoding("rope2d", dim=HEAD_DIM, theta=theta, layout=layout, axes="yx", coords=coords)
    yx = grid_coords(GRID, coords) * (2 * math.pi if coords == "normalized" else 1.0)  # DINOv3's 2 pi x coordinate
    q = HEAD_DIM // 4
    order = torch.arange(HEAD_DIM) if layout == "interleaved" else torch.cat(
        [torch.arange(q), torch.arange(q) + 2 * q, torch.arange(q) + q, torch.arange(q) + 3 * q]
    )  # fmt: skip
    got, want = nd.rotary(yx), axial(GRID)
    assert torch.equal(got.cos, want.cos[..., order]) and torch.equal(got.sin, want.sin[..., order])
    x = content(0, 1, 1, GRID[0] * GRID[1], HEAD_DIM)
    torch.testing.assert_close(got.rotate(x, x)[0], want.rotate(x[..., order.argsort()], x)[0][..., order])
    ids = vispos.create_encoding("ropend", dim=HEAD_DIM, split=(8, 8), theta=theta, layout=layout)
    yy, xx = torch.meshgrid(torch.arange(GRID[0]), torch.arange(GRID[1]), indexing="ij")
    if coords == "pixel":  # integer ids [2, N] through forward, as a 1D host hands them over
        out = ids(torch.stack((yy.flatten(), xx.flatten())))
        assert torch.equal(out.cos, got.cos) and torch.equal(out.sin, got.sin)


def test_ropend_presets_split_the_head_as_published() -> None:
    wan = vispos.create_encoding("ropend", dim=128, preset="wan")
    assert wan.split == (44, 42, 42) and wan.theta == 10000.0  # d - 4 (d // 6), 2 (d // 6), 2 (d // 6)
    hunyuan = vispos.create_encoding("ropend", dim=128, preset="hunyuanvideo")
    assert hunyuan.split == (16, 56, 56) and hunyuan.theta == 256.0
    vjepa = vispos.create_encoding("ropend", dim=64, preset="vjepa2")
    assert vjepa.split == (20, 20, 20)  # 2 * ((64 // 3) // 2) each; 4 channels unrotated
    ids = torch.randint(1, 9, (3, 11))
    rot = vjepa(ids)
    x = content(0, 1, 1, 11, 64)
    rx, _ = rot.rotate(x, x)
    torch.testing.assert_close(rx[..., 60:], x[..., 60:], rtol=0, atol=0)  # the channels after the sections
    assert (rx[..., :60] - x[..., :60]).abs().amax(dim=(0, 1, 2)).min() > 0  # every sectioned channel turns


@pytest.mark.parametrize("seed", SEEDS)
def test_ropend_logits_depend_on_3d_offsets_alone(seed: int) -> None:
    enc = vispos.create_encoding("ropend", dim=HEAD_DIM * 2, split=(12, 10, 10))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 6, (3, 9), generator=g)
    shift = torch.randint(0, 5, (3, 1), generator=g)
    q, k = content(seed, 1, 1, 9, HEAD_DIM * 2), content(seed + 1, 1, 1, 9, HEAD_DIM * 2)

    def logit(p: torch.Tensor) -> torch.Tensor:
        rq, rk = enc(p).rotate(q, k)
        return rq @ rk.transpose(-1, -2)

    torch.testing.assert_close(logit(ids + shift), logit(ids), rtol=1e-4, atol=1e-4)
    swapped = ids[[1, 0, 2]]  # the t and h ids exchanged: different logits (the split is not symmetric)
    assert (logit(swapped) - logit(ids)).abs().max() > CLEAR


def test_ropend_scales_each_axis_by_its_own_factor() -> None:
    enc = vispos.create_encoding(
        "ropend", dim=32, split=(8, 12, 12), scaling="linear", train_size=(4, 6, 6), scale_axes=(0,)
    )
    plain = vispos.create_encoding("ropend", dim=32, split=(8, 12, 12))
    (t, h, w), _ = enc.inv_freqs((8, 12, 12))  # twice the training length on every axis; only t scaled
    (t0, h0, w0), _ = plain.inv_freqs((8, 12, 12))
    torch.testing.assert_close(t, t0 / 2, rtol=0, atol=0)
    assert torch.equal(h, h0) and torch.equal(w, w0)
    everywhere = vispos.create_encoding("ropend", dim=32, split=(8, 12, 12), scaling="linear", train_size=(4, 6, 3))
    (t, h, w), _ = everywhere.inv_freqs((8, 12, 12))
    torch.testing.assert_close(torch.cat((t, h, w)), torch.cat((t0 / 2, h0 / 2, w0 / 4)), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"needs train_size"):
        vispos.create_encoding("ropend", dim=32, scaling="linear")
