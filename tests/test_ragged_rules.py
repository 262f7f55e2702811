"""The rules a context reads its input by, and the errors that name what is wrong.

A fractional point's image grid without ``sizes`` (the smallest grid holding the points: the ceiling), a
bool keep mask (True: kept, never indices 0 and 1), and a context applied to other tokens than it was built
for (another length, another number of rows: refused by name, not a size error or a silent broadcast)."""

from __future__ import annotations

import pytest
import timm
import torch

import vispos
from vispos.ragged import ragged_layout


def make(pos: str, *, prefix: bool = True, **options: object) -> torch.nn.Module:
    """A 1-block ViT patched with ``pos``: a class and a register token (2 prefix tokens), or none."""
    torch.manual_seed(0)
    tokens = {"reg_tokens": 1} if prefix else {"class_token": False, "global_pool": "avg"}
    net = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, num_heads=2, depth=1,
                            num_classes=0, **tokens)  # fmt: skip
    return vispos.patch(net, pos, inherit=False, **options).eval()


def test_fractional_points_without_sizes_take_the_ceiling_of_their_extent() -> None:
    """Cells (0, 0), (0, 1) and a token merged from (1, 1) and (2, 1), at (1.5, 1): the image has rows 0-2,
    so its grid is 3 x 2 (ceil(1.5) + 1), not 2 x 2 (floor + 1, which leaves the point outside), and not
    larger at whole-number points (1.0 reaches row 1: a 2-row grid)."""
    points = torch.tensor([[[0.0, 0.0], [0.0, 1.0], [1.5, 1.0]]])
    assert ragged_layout(points).sizes == [(3, 2)]
    assert ragged_layout(torch.tensor([[[0.0, 0.0], [1.0, 1.0]]])).sizes == [(2, 2)]
    assert ragged_layout(torch.tensor([[[0.0, 0.0], [1.0, 0.25]]])).sizes == [(2, 2)]  # x: ceil(0.25) = 1
    assert ragged_layout(torch.tensor([[[0, 0], [1, 1]]])).sizes == [(2, 2)]  # cells: their bounding box
    # a grid-dependent scheme (normalised coordinates) reads that grid: the same as with the sizes given
    net = make("rope2d", prefix=False, coords="normalized")
    found = net.vispos.ragged_context(points).layer(0)[0]
    given = net.vispos.ragged_context(points, torch.tensor([[3, 2]])).layer(0)[0]
    torch.testing.assert_close(found.cos, given.cos, rtol=0, atol=0)
    torch.testing.assert_close(found.sin, given.sin, rtol=0, atol=0)


def test_a_bool_keep_mask_keeps_the_patches_it_marks() -> None:
    """``keep`` as a bool mask [B, H*W] (True: kept) gives the positions of the kept patches, in grid order:
    those of their indices; it is not read as indices 0 and 1."""
    net = make("rope2d")
    pos = net.vispos
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[0, [1, 5, 6, 15]] = True
    mask[1, [0, 2, 9, 12]] = True
    indices = torch.tensor([[1, 5, 6, 15], [0, 2, 9, 12]])
    by_mask = pos.context((4, 4), torch.device("cpu"), keep=mask).layer(0)[0]
    by_index = pos.context((4, 4), torch.device("cpu"), keep=indices).layer(0)[0]
    torch.testing.assert_close(by_mask.cos, by_index.cos, rtol=0, atol=0)
    torch.testing.assert_close(by_mask.sin, by_index.sin, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"as many patches in every row, got \[4, 3\]"):
        uneven = mask.clone()
        uneven[1, 0] = False
        pos.context((4, 4), torch.device("cpu"), keep=uneven)
    with pytest.raises(ValueError, match=r"bool keep mask must be \[B, H\*W\] = \[B, 16\]"):
        pos.context((4, 4), torch.device("cpu"), keep=mask[:, :9])


@pytest.mark.parametrize("scheme", ["rope2d", "relbias2d"])
def test_a_context_of_another_token_count_is_refused_by_name(scheme: str) -> None:
    """A context built for one grid (18 tokens: 2 prefix + 4 x 4) handed to a block holding 10 tokens."""
    net = make(scheme)
    ctx = net.vispos.context((4, 4), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"built for 18 tokens \(2 prefix \+ a 4x4 grid\), the attention got 2 "
                                         r"row\(s\) of 10 tokens"):  # fmt: skip
        net.blocks[0](torch.randn(2, 10, 32), attn_mask=ctx)


def test_a_ragged_context_of_one_row_on_three_rows_is_refused() -> None:
    """A ragged (or subset) context is built per row: one row's context on three rows would broadcast
    silently, giving every row the first row's positions."""
    net = make("rope2d")
    cells = torch.cartesian_prod(torch.arange(2), torch.arange(3))[None]  # one 2 x 3 image
    ctx = net.vispos.ragged_context(cells, torch.tensor([[2, 3]]))
    net.blocks[0](torch.randn(1, 8, 32), attn_mask=ctx)  # its own row: runs
    with pytest.raises(ValueError, match=r"built for a ragged batch of 1 row\(s\) of 8 tokens, the attention got 3"):
        net.blocks[0](torch.randn(3, 8, 32), attn_mask=ctx)
    subset = net.vispos.context((2, 3), torch.device("cpu"), keep=torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match=r"built for a token subset of 1 row\(s\) of 4 tokens"):
        net.blocks[0](torch.randn(3, 4, 32), attn_mask=subset)


def test_float_sizes_are_refused_naming_what_they_must_be() -> None:
    with pytest.raises(ValueError, match=r"sizes must be an integer tensor \[1, 2\].*got torch.float32"):
        ragged_layout(torch.tensor([[[0.5, 1.0]]]), torch.tensor([[2.0, 2.0]]))
