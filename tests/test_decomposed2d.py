"""decomposed2d (MViTv2 / ViTDet / SAM): the formula, timm's implementation, relative and separable structure,
SAM's resize rule, option validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from timm.models.vision_transformer_sam import get_decomposed_rel_pos_bias, get_rel_pos

import vispos
from vispos.diagnostics import cross_term, translation_error
from vispos.encodings.decomposed import relative_rows, resize_rel_table

HEAD_DIM, HEADS = 8, 2


def scheme(train_grid: tuple[int, int], seed: int = 0) -> torch.nn.Module:
    """decomposed2d with random tables (SAM starts them at zero, which would hide every property)."""
    module = vispos.create_encoding("decomposed2d", dim=HEAD_DIM, train_grid=train_grid)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return module


def reference(q: torch.Tensor, table_h: torch.Tensor, table_w: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """The formula, pair by pair: bias[b, n, (qy, qx), (ky, kx)] = q . R_h[qy - ky] + q . R_w[qx - kx], the
    tables indexed by offset + (size - 1) (tables of the grid's own size: no resize)."""
    h, w = grid
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    ys, xs = ys.flatten(), xs.flatten()  # [HW]: row-major cells
    r_h = table_h[ys[:, None] - ys[None, :] + h - 1]  # [HW, HW, d]: R_h[qy - ky]
    r_w = table_w[xs[:, None] - xs[None, :] + w - 1]
    return torch.einsum("bnqd,qkd->bnqk", q, r_h) + torch.einsum("bnqd,qkd->bnqk", q, r_w)


@pytest.mark.parametrize("grid", [(3, 5), (4, 4), (1, 6)])
def test_decomposed2d_equals_the_formula(grid: tuple[int, int]) -> None:
    module = scheme(grid)
    q = torch.randn(2, HEADS, grid[0] * grid[1], HEAD_DIM)
    got = module(grid).logits(q)
    torch.testing.assert_close(got, reference(q, module.rel_pos_h, module.rel_pos_w, grid), atol=1e-5, rtol=1e-5)


GRIDS = [((4, 4), (4, 4)), ((3, 5), (3, 5)), ((4, 4), (6, 5)), ((5, 3), (2, 2))]


@pytest.mark.parametrize(("train_grid", "grid"), GRIDS)
def test_decomposed2d_equals_timm_get_decomposed_rel_pos_bias(
    train_grid: tuple[int, int], grid: tuple[int, int]
) -> None:
    """timm's SAM function on random q and tables, at the training grid and (resized) at others."""
    module = scheme(train_grid, seed=1)
    q = torch.randn(3, HEADS, grid[0] * grid[1], HEAD_DIM)
    got = module(grid).logits(q)
    timm_bias = get_decomposed_rel_pos_bias(q.flatten(0, 1), module.rel_pos_h, module.rel_pos_w, grid, grid)
    torch.testing.assert_close(got, timm_bias.view_as(got), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("q_size", "k_size", "length"), [(4, 4, 7), (6, 6, 7), (3, 6, 11), (6, 3, 11), (5, 2, 9)])
def test_relative_rows_equal_timm_get_rel_pos_with_resize_and_coordinate_scaling(q_size, k_size, length) -> None:
    table = torch.randn(length, HEAD_DIM)
    torch.testing.assert_close(relative_rows(table, q_size, k_size), get_rel_pos(q_size, k_size, table))


def test_decomposed2d_resize_is_linear_interpolation_as_sam() -> None:
    """Another grid: each table stretched to 2 * size - 1 entries by linear interpolation (half-pixel centres),
    written here as the interpolation itself: entry i of the new table reads the old one at (i + 0.5) L / L' - 0.5."""
    table = torch.randn(7, HEAD_DIM)  # a 4-cell axis
    new = 11  # a 6-cell axis
    at = ((torch.arange(new) + 0.5) * 7 / new - 0.5).clamp(0, 6)
    lo = at.floor().long().clamp(max=5)
    frac = (at - lo)[:, None]
    expected = table[lo] * (1 - frac) + table[lo + 1] * frac
    torch.testing.assert_close(resize_rel_table(table, new), expected, atol=1e-6, rtol=1e-6)
    assert resize_rel_table(table, 7) is table  # the training size: the table itself
    module = scheme((4, 4))
    rows = module((6, 4)).rows_h  # [6, 6, d]: the resized table at every (qy, ky)
    resized = F.interpolate(module.rel_pos_h.T[None], size=11, mode="linear")[0].T
    torch.testing.assert_close(rows, resized[torch.arange(6)[:, None] - torch.arange(6)[None, :] + 5])


@pytest.mark.parametrize("seed", [0, 1])
def test_decomposed2d_is_translation_invariant_for_a_fixed_query(seed: int) -> None:
    """The same q at every cell: the logits depend on the offset (qy - ky, qx - kx) alone."""
    grid = (5, 7)
    module = scheme(grid, seed)
    q = torch.randn(HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed))
    logits = module(grid).logits(q[None, :, None].expand(1, HEADS, 35, HEAD_DIM))[0]  # [heads, 35, 35]
    assert translation_error(logits, grid).max() < 1e-4
    moved = module(grid).logits(q.flip(-1)[None, :, None].expand(1, HEADS, 35, HEAD_DIM))[0]
    assert translation_error(moved, grid).max() < 1e-4


def test_decomposed2d_has_no_row_column_cross_term() -> None:
    """The term is a y-only part plus an x-only part: for any q (one per cell, random), every query row is
    f(ky) + g(kx), so its mixed second difference over the keys vanishes; and the scheme's cross term is zero."""
    grid = (4, 5)
    module = scheme(grid, seed=3)
    q = torch.randn(2, HEADS, 20, HEAD_DIM)
    bias = module(grid).logits(q).reshape(2, HEADS, 20, 4, 5)  # [..., ky, kx]
    mixed = bias[..., 1:, 1:] - bias[..., 1:, :-1] - bias[..., :-1, 1:] + bias[..., :-1, :-1]
    assert mixed.abs().max() < 1e-4 * bias.abs().max()
    same_q = module(grid).logits(q[:1, :, :1].expand(1, HEADS, 20, HEAD_DIM))[0]
    assert (cross_term(same_q, grid) < 1e-4).all()
    # the x-part alone: zero the height table, and the bias no longer depends on ky
    with torch.no_grad():
        module.rel_pos_h.zero_()
    x_only = module(grid).logits(q).reshape(2, HEADS, 20, 4, 5)
    assert (x_only - x_only[..., :1, :]).abs().max() < 1e-6


def test_decomposed2d_token_subset_and_prefix_rows() -> None:
    """A token subset reads the rows of the full bias; prefix tokens get zero bias."""
    grid = (3, 4)
    module = scheme(grid, seed=4)
    q = torch.randn(2, HEADS, 1 + 12, HEAD_DIM)
    full = module(grid).with_prefix(1).logits(q)  # [2, heads, 13, 13]
    assert full[:, :, 0].abs().max() == 0 and full[:, :, :, 0].abs().max() == 0
    tokens = torch.tensor([[0, 3, 5, 12], [0, 1, 2, 7]])
    sub_q = q.gather(2, tokens[:, None, :, None].expand(2, HEADS, 4, HEAD_DIM))
    got = module(grid).with_prefix(1).take(tokens).logits(sub_q)
    expected = torch.stack([full[b][:, tokens[b]][:, :, tokens[b]] for b in range(2)])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_decomposed2d_starts_at_zero_as_sam_and_validates_options() -> None:
    module = vispos.create_encoding("decomposed2d", dim=HEAD_DIM, train_grid=(3, 4))
    assert module.rel_pos_h.shape == (5, HEAD_DIM) and module.rel_pos_w.shape == (7, HEAD_DIM)
    assert not module.rel_pos_h.any() and not module.rel_pos_w.any()
    assert vispos.create_encoding("decomposed2d", dim=HEAD_DIM, init_std=0.02).rel_pos_h.abs().sum() > 0
    with pytest.raises(ValueError, match="init_std"):
        vispos.create_encoding("decomposed2d", dim=HEAD_DIM, init_std=-1.0)
    with pytest.raises(ValueError, match="train_grid"):
        vispos.create_encoding("decomposed2d", dim=HEAD_DIM, train_grid=(0, 3))
    with pytest.raises(TypeError, match="accepted: dim, train_grid, init_std"):
        vispos.create_encoding("decomposed2d", dim=HEAD_DIM, per_head=True)
    info = vispos.get_info("decomposed2d")
    assert info.kind == "query_bias" and info.relative and info.per_layer and info.trainable


def test_decomposed2d_in_a_ragged_batch_is_refused_by_name() -> None:
    """A ragged or packed batch (several grid sizes in one call) is refused with what to do instead."""
    from timm.models.vision_transformer import VisionTransformer

    vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    model = vispos.patch(vit, "decomposed2d")
    ys, xs = torch.meshgrid(torch.arange(3), torch.arange(4), indexing="ij")
    coords = torch.stack((ys.flatten(), xs.flatten()), -1)[None].expand(2, -1, -1)  # [2, 12, 2]
    with pytest.raises(ValueError, match="ragged and packed batches are not supported"):
        model.vispos.ragged_context(coords, torch.tensor([[3, 4], [3, 4]]))
