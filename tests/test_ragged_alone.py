"""Ragged and packed batches: each image gives what it gives alone, for every 2D scheme, padded or
packed with segment ids, its tokens in any order, size-dependent settings at its own size
(reference and negative controls: ``ragged_refs``)."""

from __future__ import annotations

import pytest
import torch
from ragged_refs import (
    PACKED,
    SCHEMES_2D,
    SIZES,
    gap,
    ids,
    make,
    orders,
    ragged_features,
    without_positions,
)

import vispos


@pytest.mark.parametrize("scheme", SCHEMES_2D, ids=ids)
def test_each_image_of_a_padded_ragged_batch_gives_its_output_alone(scheme: str | list[str]) -> None:
    net = make(scheme, prefix=True)
    with torch.no_grad():
        out, image, rank = ragged_features(net, [[i] for i in range(len(SIZES))], orders(net))
        assert out.isfinite().all()  # padding rows included
        assert gap(net, out, image, rank) <= 1e-5
        if not without_positions(scheme):  # negative control: positions from the token order
            out, image, rank = ragged_features(net, [[i] for i in range(len(SIZES))], orders(net), wrong_coords=True)
            assert gap(net, out, image, rank) > 1e-3


@pytest.mark.parametrize("scheme", SCHEMES_2D, ids=ids)
def test_each_image_packed_in_a_row_with_segment_ids_gives_its_output_alone(scheme: str | list[str]) -> None:
    net = make(scheme, prefix=False)
    with torch.no_grad():
        out, image, rank = ragged_features(net, PACKED, orders(net))
        assert gap(net, out, image, rank) <= 1e-5
        if not without_positions(scheme):
            out, image, rank = ragged_features(net, PACKED, orders(net), wrong_coords=True)
            assert gap(net, out, image, rank) > 1e-3


@pytest.mark.parametrize("scheme", SCHEMES_2D, ids=ids)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_permuting_tokens_with_their_coordinates_permutes_the_outputs(scheme: str | list[str], packed: bool) -> None:
    net = make(scheme, prefix=not packed)
    rows = PACKED if packed else [[i] for i in range(len(SIZES))]
    p = net.num_prefix_tokens
    with torch.no_grad():
        out, _, _ = ragged_features(net, rows, orders(net))
        n = out.shape[1] - p
        g = torch.Generator().manual_seed(5)
        perms = [torch.randperm(n, generator=g) for _ in rows]  # padding moves too
        moved, _, _ = ragged_features(net, rows, orders(net), row_perm=perms)
        expected = torch.stack([torch.cat((o[:p], o[p:][perm])) for o, perm in zip(out, perms, strict=True)])
        valid = torch.ones(out.shape[:2], dtype=torch.bool)
        for r, row in enumerate(rows):  # compare tokens of images only (padding outputs are never read)
            valid[r, p + sum((SIZES[i][0] // 8) * (SIZES[i][1] // 8) for i in row) :] = False
        valid[:, p:] = valid[:, p:].gather(1, torch.stack(perms))
        torch.testing.assert_close(moved[valid], expected[valid], rtol=1e-5, atol=1e-5)
        if not without_positions(scheme):  # positions from the order: a permutation changes them
            wrong, _, _ = ragged_features(net, rows, orders(net), wrong_coords=True)
            wrong_moved, _, _ = ragged_features(net, rows, orders(net), wrong_coords=True, row_perm=perms)
            wrong_expected = torch.stack([torch.cat((o[:p], o[p:][q])) for o, q in zip(wrong, perms, strict=True)])
            assert (wrong_moved[valid] - wrong_expected[valid]).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("scheme", "options"),
    [
        ("rope2d", {"coords": "normalized"}),
        ("rope2d", {"scaling": "yarn"}),
        ("rope2d", {"ref_grid": (4, 4)}),
        ("relbias2d", {"log_n": True}),
        ("rope2d_mixed", {"log_n": True}),
    ],
    ids=["normalized", "yarn", "ref_grid", "relbias2d-log_n", "mixed-log_n"],
)
def test_size_dependent_settings_use_each_images_own_size(scheme: str, options: dict[str, object]) -> None:
    """Normalised coordinates, scaling relative to the training grid, a reference grid and log-n attention
    scaling (folded into q per token) all read each image's own grid size. Trained on a 4 x 4 grid, so
    that some images are larger (scaling factors and log-n factors above 1) and some smaller."""
    options = dict(options)
    log_n = options.pop("log_n", False)
    net = make(scheme, prefix=True, img_size=32, **options)
    if log_n:
        vispos.configure(net, log_n_attention=True)
    with torch.no_grad():
        out, image, rank = ragged_features(net, [[i] for i in range(len(SIZES))], orders(net))
        assert gap(net, out, image, rank) <= 1e-5
