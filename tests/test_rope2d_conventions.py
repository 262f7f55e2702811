"""rope2d / rope2d_mixed conventions against timm's own RoPE modules, and DINOv3's coordinate augmentation.

Every convention option (axis order, layout, offset, normalisation, reference grid, periods) is checked
against the timm module that defines it, built independently (timm's ``pos_embed_sincos``), at square
and non-square grids; the augmentation against timm's DINOv3 module with the same random seed.
"""

from __future__ import annotations

import math

import pytest
import timm
import torch
from timm.layers.pos_embed_sincos import RotaryEmbeddingCat, RotaryEmbeddingDinoV3, RotaryEmbeddingMixed

from vispos import create_encoding
from vispos.encodings.coords2d import CoordAugment

GRIDS = [(4, 4), (3, 5), (6, 2)]
# timm < 1.0.31's RotaryEmbeddingDinoV3 puts y first whatever its grid_indexing and requires a temperature
TIMM_DINOV3_1_0_31 = pytest.mark.skipif(
    tuple(int(p) for p in timm.__version__.split(".")[:3] if p.isdigit()) < (1, 0, 31),
    reason="timm < 1.0.31's RotaryEmbeddingDinoV3 has no x-first order and no temperature=None",
)


def cos_sin(rotary) -> tuple[torch.Tensor, torch.Tensor]:
    return rotary.cos, rotary.sin


def timm_cat(module: torch.nn.Module, grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    sin, cos = module.get_embed(list(grid)).chunk(2, dim=-1)
    return cos, sin


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize(
    ("timm_kwargs", "options"),
    [
        # RoPE-ViT axial: x first, interleaved, theta 100
        (dict(temperature=100.0, grid_indexing="xy"), dict(theta=100.0, axes="xy", layout="interleaved")),
        # EVA-02 / timm's vit_*_rope_reg*: y first, theta 1e4, every grid stretched onto a 16 x 16 reference
        (
            dict(temperature=1e4, grid_indexing="ij", ref_feat_shape=(16, 16)),
            dict(theta=1e4, axes="yx", layout="interleaved", ref_grid=(16, 16)),
        ),
        # Perception Encoder: x first, grid offset 1, reference 24 x 24
        (
            dict(temperature=1e4, grid_indexing="xy", grid_offset=1.0, ref_feat_shape=(24, 24)),
            dict(theta=1e4, axes="xy", layout="interleaved", offset=1.0, ref_grid=(24, 24)),
        ),
        (dict(temperature=100.0, grid_indexing="ij", rotate_half=True), dict(theta=100.0, axes="yx", layout="half")),
    ],
)
def test_rope2d_equals_timm_axial_rope(grid, timm_kwargs, options):
    ref = RotaryEmbeddingCat(dim=32, in_pixels=False, **timm_kwargs)
    ours = create_encoding("rope2d", ndim=2, dim=32, **options)
    for a, b in zip(cos_sin(ours(grid)), timm_cat(ref, grid), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize(
    ("timm_kwargs", "options"),
    [
        (dict(), dict()),
        (dict(normalize_coords="min", grid_offset=0.25), dict(normalize="min", offset=0.25)),
        pytest.param(
            dict(normalize_coords="max", grid_indexing="xy", rotate_half=False),
            dict(normalize="max", axes="xy", layout="interleaved"),
            marks=TIMM_DINOV3_1_0_31,
        ),
        pytest.param(
            dict(temperature=None, min_period=0.5, max_period=40.0),
            dict(min_period=0.5, max_period=40.0),
            marks=TIMM_DINOV3_1_0_31,
        ),
    ],
)
def test_rope2d_normalized_equals_timm_dinov3(grid, timm_kwargs, options):
    ref = RotaryEmbeddingDinoV3(dim=32, **timm_kwargs)
    defaults = dict(coords="normalized", axes="yx", layout="half", theta=100.0)
    ours = create_encoding("rope2d", ndim=2, dim=32, **(defaults | options))
    for a, b in zip(cos_sin(ours(grid)), timm_cat(ref, grid), strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=0)


@pytest.mark.parametrize("grid", GRIDS)
def test_rope2d_mixed_with_adopted_freqs_equals_timm_mixed(grid):
    ref = RotaryEmbeddingMixed(dim=4 * 32, depth=2, num_heads=4, temperature=10.0)
    ours = create_encoding("rope2d_mixed", ndim=2, dim=32, num_heads=4, layout="interleaved")
    with torch.no_grad():
        ours.freqs.copy_(ref.freqs[:, 1])
    emb = ref.get_embed(list(grid))[1]  # layer 1: [heads, HW, 2 * dim] as (sin, cos)
    sin, cos = emb.chunk(2, dim=-1)
    torch.testing.assert_close(ours(grid).cos, cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours(grid).sin, sin, atol=1e-6, rtol=0)


# --- coordinate augmentation ---------------------------------------------------------------------


AUGMENT = dict(shift_coords=0.3, jitter_coords=1.5, rescale_coords=2.0)


@pytest.mark.parametrize("name", ["rope2d", "rope2d_mixed"])
def test_augmentation_is_off_in_eval_mode(name):
    context = dict(dim=32, num_heads=2) if name == "rope2d_mixed" else dict(dim=32)
    plain = create_encoding(name, ndim=2, coords="normalized", **context)
    augmented = create_encoding(name, ndim=2, coords="normalized", **context, **AUGMENT)
    if name == "rope2d_mixed":
        augmented.load_state_dict(plain.state_dict())
    augmented.eval()
    torch.testing.assert_close(augmented((5, 3)).cos, plain((5, 3)).cos, atol=0, rtol=0)
    augmented.train()
    assert (augmented((5, 3)).cos - plain((5, 3)).cos).abs().max() > 1e-3


def test_augmentation_draws_stay_in_their_ranges():
    """Each step recovered from the transformed coordinates: shift alone, jitter alone, rescale alone."""
    coords = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    torch.manual_seed(0)
    shifts = torch.stack([CoordAugment(shift=0.3)(coords)[0] for _ in range(2000)])
    jitters = torch.stack([CoordAugment(jitter=1.5)(coords)[1] for _ in range(2000)])
    rescales = torch.stack([CoordAugment(rescale=2.0)(coords)[1] for _ in range(2000)])
    assert shifts.abs().max() <= 0.3 and shifts.abs().max() > 0.29  # uniform in [-0.3, 0.3] per axis
    assert (shifts[:, 0] != shifts[:, 1]).all()  # drawn per axis
    log_j = jitters.log()
    assert log_j.abs().max() <= math.log(1.5) + 1e-6 and log_j.abs().max() > 0.95 * math.log(1.5)
    assert (jitters[:, 0] != jitters[:, 1]).all()
    assert rescales.log().abs().max() <= math.log(2.0) + 1e-6 and (rescales[:, 0] == rescales[:, 1]).all()
    assert rescales.min() < 0.55 and rescales.max() > 1.9  # log-uniform over [1/2, 2]


def test_augmented_rope2d_is_relative_within_a_sample():
    """One draw shared by all tokens: logits of shifted tokens equal those of the same offsets elsewhere."""
    rope = create_encoding("rope2d", ndim=2, dim=32, **AUGMENT).train()
    h, w = 5, 6
    torch.manual_seed(3)
    rot = rope((h, w))  # one draw
    q, k = torch.randn(1, 1, 1, 32).expand(1, 1, h * w, 32), torch.randn(1, 1, 1, 32).expand(1, 1, h * w, 32)
    qr, kr = rot.rotate(q, k)
    logits = (qr @ kr.transpose(-1, -2))[0, 0].reshape(h, w, h, w)
    # same offset (dy, dx) = (1, 2) from two different query positions
    torch.testing.assert_close(logits[0, 0, 1, 2], logits[3, 2, 4, 4], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[1, 3, 0, 1], logits[4, 4, 3, 2], atol=1e-5, rtol=0)


def test_augmentation_matches_timm_dinov3_draw_for_draw():
    """DINOv3's order (shift, jitter, rescale) and random draws: equal to timm's module under one seed."""
    ref = RotaryEmbeddingDinoV3(dim=32, **AUGMENT).train()
    ours = create_encoding("rope2d", ndim=2, dim=32, coords="normalized", axes="yx", **AUGMENT).train()
    torch.manual_seed(11)
    expected = timm_cat(ref, (4, 7))
    torch.manual_seed(11)
    got = cos_sin(ours((4, 7)))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(jitter_coords=0.5), "jitter_coords must be >= 1.0"),
        (dict(shift_coords=-1.0), "shift_coords must be >= 0.0"),
        (dict(coords="normalized", ref_grid=(4, 4)), "ref_grid applies to coords='pixel'"),
        (dict(min_period=1.0), "give both min_period and max_period"),
        (dict(axes="zx"), "unknown axes 'zx'; accepted: xy, yx"),
        (dict(ref_grid=(4, 4), scaling="linear", train_grid=(4, 4)), "does not combine with ref_grid"),
    ],
)
def test_bad_convention_options_are_refused_clearly(options, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        create_encoding("rope2d", ndim=2, dim=32, **options)


@pytest.mark.parametrize("scaling", [None, "linear", "ntk"])
def test_alternate_bands_share_out_one_head_wide_rope_and_scale_it_per_axis(scaling):
    """bands="alternate" (Pixtral): rows turn at the even frequencies of theta ** (-2i / d), columns at the odd ones;
    a scaling acts on that head-wide RoPE, each axis at its own factor (here 8 x 6 patches over a 4 x 4 training
    grid: 2 and 1.5), written out from the formulas: linear divides the positions, NTK raises the base to
    theta * s ** (d / (d - 2))."""
    dim, theta, grid = 16, 100.0, (8, 6)
    rope = create_encoding("rope2d", dim=dim, theta=theta, axes="yx", layout="half", bands="alternate",
                           scaling=scaling, train_grid=(4, 4))  # fmt: skip
    angles, _ = rope.angles(grid)
    rows, cols = torch.meshgrid(torch.arange(8.0), torch.arange(6.0), indexing="ij")
    expected = []
    for axis, (pos, s) in enumerate(((rows.flatten(), 2.0), (cols.flatten(), 1.5))):
        base = theta * s ** (dim / (dim - 2)) if scaling == "ntk" else theta
        whole = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # [dim / 2]: the head's RoPE
        freqs = whole[axis::2]  # rows the even, columns the odd
        expected.append(pos.double()[:, None] * freqs / (s if scaling == "linear" else 1.0))
    torch.testing.assert_close(angles.double(), torch.cat(expected, dim=-1), rtol=1e-6, atol=1e-6)
