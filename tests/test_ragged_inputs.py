"""Ragged batch inputs: padding contents and cells are ignored, sizes default to each image's bounding
box, and bad batches (shapes, cells, segment ids, prefix tokens in packed rows) are refused."""

from __future__ import annotations

import pytest
import torch
from ragged_refs import (
    make,
)


def test_positions_of_a_ragged_batch_ignore_padding_contents_and_cells() -> None:
    """Padding tokens hold random values and out-of-grid cells (99, 99) in every test of test_ragged_alone.py; here the
    structure mask itself: a valid query sees its own image only, a padding query every valid key and itself."""
    net = make("nope", prefix=False)
    coords = torch.tensor([[[0, 0], [0, 1], [0, 0], [99, 99]]])
    segments, valid = torch.tensor([[0, 0, 1, 0]]), torch.tensor([[True, True, True, False]])
    ctx = net.vispos.ragged_context(coords, torch.tensor([[[1, 2], [1, 1]]]), valid=valid, segments=segments)
    allowed = ctx.layer(0)[1][0, 0].isfinite()
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(allowed, expected)


def test_sizes_default_to_the_bounding_box_of_each_images_cells() -> None:
    net = make("rope2d", prefix=True)
    coords = torch.tensor([[[0, 0], [2, 4], [1, 1]], [[0, 0], [4, 1], [0, 0]]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    given = net.vispos.ragged_context(coords, torch.tensor([[3, 5], [5, 2]]), valid=valid)
    derived = net.vispos.ragged_context(coords, valid=valid)
    assert derived.ragged.sizes == given.ragged.sizes == [(3, 5), (5, 2)]
    torch.testing.assert_close(derived.layer(0)[0].cos, given.layer(0)[0].cos, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"coords": torch.zeros(1, 2, 2, dtype=torch.bool)}, r"real tensor \[B, N, 2\]"),  # floats: points
        ({"coords": torch.zeros(1, 2, dtype=torch.long)}, r"real tensor \[B, N, 2\]"),
        ({"coords": torch.tensor([[[0, 5], [0, 0]]]), "sizes": torch.tensor([[2, 5]])}, "outside their image's grid"),
        ({"coords": torch.zeros(1, 2, 2, dtype=torch.long), "sizes": torch.tensor([2, 2])}, r"sizes .*\[1, 2\]"),
        ({"coords": torch.zeros(1, 2, 2, dtype=torch.long), "valid": torch.ones(1, 2)}, "valid must be a bool tensor"),
        ({"coords": torch.zeros(1, 2, 2, dtype=torch.long), "sizes": torch.tensor([[0, 3]])}, "must be positive"),
    ],
    ids=["bool", "shape", "outside", "sizes-shape", "valid-dtype", "empty-grid"],
)
def test_a_bad_ragged_batch_is_refused(kwargs: dict[str, object], message: str) -> None:
    net = make("rope2d", prefix=True)
    with pytest.raises(ValueError, match=message):
        net.vispos.ragged_context(**kwargs)


def test_packed_rows_refuse_prefix_tokens_and_bad_segment_ids() -> None:
    coords, sizes = torch.zeros(1, 2, 2, dtype=torch.long), torch.tensor([[[1, 1], [1, 1]]])
    with pytest.raises(ValueError, match="packed rows .* cannot hold prefix tokens"):
        make("rope2d", prefix=True).vispos.ragged_context(coords, sizes, segments=torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match=r"image ids in 0 \.\. 1"):
        make("rope2d", prefix=False).vispos.ragged_context(coords, sizes, segments=torch.tensor([[0, 2]]))
