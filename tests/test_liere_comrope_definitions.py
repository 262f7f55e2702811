"""ComRoPE (AP, LD) and LieRE against the papers' definitions on random inputs: block rotations equal
``torch.linalg.matrix_exp`` of the published generator sums; ComRoPE's generators commute and its logits are relative,
LieRE's do neither, and commuting generators are the cause (against the released code:
``tests/test_liere_comrope_sources.py``); the options the rotary family refuses.
"""

from __future__ import annotations

import pytest
import torch
from rope_family import CLEAR, FP, GRID, HEAD_DIM, HEADS, SEEDS, build, content, dense_logits, logits, xy
from torch import nn

import vispos
from vispos.diagnostics import scheme_logits, translation_error
from vispos.encodings.comrope import axis_partition_mask


def block_diag(blocks: torch.Tensor) -> torch.Tensor:
    """[..., M, b, b] -> [..., M b, M b] block-diagonal."""
    *lead, m, b, _ = blocks.shape
    out = torch.zeros(*lead, m * b, m * b, dtype=blocks.dtype)
    for i in range(m):
        out[..., i * b : (i + 1) * b, i * b : (i + 1) * b] = blocks[..., i, :, :]
    return out


# --- LieRE and ComRoPE ---------------------------------------------------------------------------------


def published_generators(name: str, enc: nn.Module) -> torch.Tensor:
    """The generators [heads, 2 (x, y), M, b, b] as the papers' code defines them, from the raw parameters."""
    if name == "liere2d":  # LieRE: U - U^T, U the strict upper triangle of the raw parameters
        upper = torch.triu(enc.raw.detach().double(), diagonal=1)
        return upper - upper.transpose(-1, -2)
    skew = enc.base.detach().double() - enc.base.detach().double().transpose(-1, -2)  # P_m - P_m^T
    if enc.variant == "ld":  # B_km = theta_km (P_m - P_m^T)
        return skew[:, None] * enc.scale.detach().double()[None, :, :, None, None]
    blocks = skew.shape[1]
    gens = torch.zeros(skew.shape[0], 2, *skew.shape[1:], dtype=torch.float64)
    for axis in range(2):
        for m in range(blocks):
            if m % 2 == axis:  # B_km = P_m - P_m^T when m = k (mod number of axes)
                gens[:, axis, m] = skew[:, m]
    return gens


# LieRE in its block form per head (its defaults, dense and shared: tests/test_liere_comrope_sources.py)
LIERE_BLOCKS = {"block_size": 4, "per_head": True}
VARIANTS = [("liere2d", LIERE_BLOCKS), ("comrope2d", {"variant": "ap"}), ("comrope2d", {"variant": "ld"})]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("name", "options"), VARIANTS)
@pytest.mark.parametrize("coords", ["normalized", "pixel"])
def test_block_rotations_are_the_matrix_exponential_of_the_published_generators(
    name: str, options: dict, coords: str, seed: int
) -> None:
    enc = build(name, seed, coords=coords, **options)
    gens = published_generators(name, enc)  # [heads, 2, M, b, b]
    torch.testing.assert_close(enc.generators().double(), gens, rtol=1e-6, atol=1e-6)
    c = xy(GRID, coords)  # [N, 2]
    dense_gen = block_diag(gens)  # [heads, 2, d, d]
    total = c[None, :, 0, None, None] * dense_gen[:, None, 0] + c[None, :, 1, None, None] * dense_gen[:, None, 1]
    rotations = torch.linalg.matrix_exp(total)  # [heads, N, d, d], dense, float64
    out = enc(GRID)
    torch.testing.assert_close(block_diag(out.blocks.double()), rotations, rtol=1e-4, atol=1e-4)
    q, k = content(seed, HEADS, HEAD_DIM), content(seed + 7, HEADS, HEAD_DIM)
    expected = dense_logits(rotations, q, k).float()
    torch.testing.assert_close(scheme_logits(enc, GRID, q=q, k=k), expected, rtol=1e-3, atol=1e-3)


def commutator(gens: torch.Tensor) -> torch.Tensor:
    """|A_x A_y - A_y A_x| relative to |A_x| |A_y| (Frobenius), per head: [heads]."""
    a, b = gens[:, 0], gens[:, 1]
    return (a @ b - b @ a).flatten(1).norm(dim=1) / (a.flatten(1).norm(dim=1) * b.flatten(1).norm(dim=1))


@pytest.mark.parametrize("seed", SEEDS)
def test_comrope_generators_commute_and_its_logits_are_relative_but_liere_neither(seed: int) -> None:
    for variant in ("ap", "ld"):
        enc = build("comrope2d", seed, variant=variant)
        assert commutator(enc.generators().detach()).max() < 1e-6, variant
        assert translation_error(logits(enc, seed), GRID).max() < FP, variant
    liere = build("liere2d", seed, **LIERE_BLOCKS)
    assert commutator(liere.generators().detach()).min() > CLEAR
    assert translation_error(logits(liere, seed), GRID).min() > CLEAR  # LieRE is not exactly relative


@pytest.mark.parametrize("seed", SEEDS)
def test_breaking_commutativity_breaks_the_relative_property(seed: int) -> None:
    """The negative control of the test above: ComRoPE-AP with every block turning with both axes
    (its axis mask removed) is LieRE-like, and its logits stop being functions of offsets alone."""
    enc = build("comrope2d", seed, variant="ap")
    enc.mask = torch.ones_like(enc.mask)
    with torch.no_grad():
        enc.base.copy_(content(seed, *enc.base.shape))
    gens = enc.generators().detach()
    gens[:, 1] = gens[:, 1].flip(-1)  # a different skew matrix per axis: no longer commuting
    assert commutator(gens).min() > CLEAR
    enc.generators = lambda: gens  # type: ignore[method-assign]
    assert translation_error(logits(enc, seed), GRID).min() > CLEAR


def test_liere_generators_that_commute_make_it_relative() -> None:
    """LieRE is relative exactly when its generators commute: y generators a multiple of the x ones."""
    enc = build("liere2d", 0, **LIERE_BLOCKS)
    with torch.no_grad():
        enc.raw[:, 1] = 0.5 * enc.raw[:, 0]
    assert commutator(enc.generators().detach()).max() < 1e-6
    assert translation_error(logits(enc, 0), GRID).max() < FP


def test_axis_partition_mask_gives_each_block_one_axis() -> None:
    mask = axis_partition_mask(2, 6)[..., 0, 0]  # [2, 6]
    assert mask.tolist() == [[1, 0, 1, 0, 1, 0], [0, 1, 0, 1, 0, 1]]


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("comrope2d", {"dim": 12, "block_size": 4}, r"divisible by 8"),  # AP: two axes x blocks of 4
        ("comrope2d", {"variant": "xy"}, r"accepted: ap, ld"),
        ("liere2d", {"dim": 18, "block_size": 4}, r"divisible by 4"),
        ("liere2d", {"block_size": 1}, r"block_size must be >= 2"),
        ("string2d", {"freqs": "learned"}, r"accepted: mixed, axial, golden"),
    ],
)
def test_bad_options_are_refused(name: str, options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        vispos.create_encoding(name, **{"dim": HEAD_DIM, "num_heads": HEADS} | options)
