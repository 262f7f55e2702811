"""The linear-map rotary family (``rope2d_golden``, ``string2d``) against the papers' definitions on random inputs.

- angles <omega_j, p>: golden-gate frequencies turn by the golden angle; axial maps (``string2d`` with
  ``freqs="axial"``, ``rope2d``, ComRoPE-AP) have no cross term, directional / learned maps do;
- STRING = P RoPE(p) P^T (Cayley P) = exp(sum_i p_i L_i) with commuting L_i, and folding P^T into the q/k
  projections leaves a model's outputs unchanged (against the released code: ``tests/test_golden_string_sources.py``).
"""

from __future__ import annotations

import math

import pytest
import timm
import torch
from rope_family import CLEAR, FP, GRID, HEAD_DIM, HEADS, SEEDS, build, content, dense_logits, logits, xy
from torch import nn

import vispos
from vispos.diagnostics import cross_term, layer_logits, scheme_logits, translation_error
from vispos.encodings.rotary_nd import GOLDEN_ANGLE, axial_freqs, golden_freqs
from vispos.encodings.string import fold_string, skew_part

EMBED = 64  # the width of the ViT STRING is folded into


def dense_rope(angles: torch.Tensor) -> torch.Tensor:
    """Per-pair angles [..., d/2] -> the rotation matrix [..., d, d] of the ``half`` layout (pair j is
    channels j and j + d/2), written out entry by entry."""
    half = angles.shape[-1]
    r = torch.zeros(*angles.shape[:-1], 2 * half, 2 * half, dtype=torch.float64)
    c, s = angles.double().cos(), angles.double().sin()
    j = torch.arange(half)
    r[..., j, j], r[..., j + half, j + half] = c, c
    r[..., j, j + half], r[..., j + half, j] = -s, s
    return r


# --- the linear-map family ---------------------------------------------------------------------------


def test_golden_frequencies_follow_the_golden_angle() -> None:
    f = golden_freqs(HEAD_DIM, theta=100.0, spacing="golden_angle")[0]  # [2, d/2]: one head
    j = torch.arange(HEAD_DIM // 2, dtype=torch.float64)
    mag = 100.0 ** (-2 * j / HEAD_DIM)
    torch.testing.assert_close(f.double().norm(dim=0), mag, rtol=1e-6, atol=0)
    turn = torch.atan2(f[1].double(), f[0].double()) - j * GOLDEN_ANGLE  # direction minus j x golden angle
    wrapped = torch.remainder(turn + math.pi, 2 * math.pi) - math.pi
    torch.testing.assert_close(wrapped, torch.zeros_like(j), atol=1e-6, rtol=0)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_axial_linear_map_is_rope2d(layout: str) -> None:
    """string2d with freqs='axial' and P = I is rope2d: the linear map reproduces axial RoPE exactly."""
    axial = vispos.create_encoding("rope2d", dim=HEAD_DIM, theta=10.0, layout=layout)(GRID)
    string = vispos.create_encoding("string2d", dim=HEAD_DIM, num_heads=HEADS, freqs="axial", layout=layout)(GRID)
    torch.testing.assert_close(string.cos, axial.cos, rtol=0, atol=0)
    torch.testing.assert_close(string.sin, axial.sin, rtol=0, atol=0)
    torch.testing.assert_close(string.basis, torch.eye(HEAD_DIM).expand(HEADS, -1, -1), rtol=0, atol=0)
    ref = axial_freqs(HEAD_DIM, 10.0)
    assert (ref[0, HEAD_DIM // 4 :] == 0).all() and (ref[1, : HEAD_DIM // 4] == 0).all()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("name", "options", "separable"),
    [
        ("rope2d_golden", {}, False),
        ("string2d", {}, False),
        ("string2d", {"freqs": "golden"}, False),
        ("string2d", {"freqs": "axial"}, True),  # axial RoPE in any basis: x pairs and y pairs stay apart
        ("string2d", {"variant": "circulant"}, False),
        ("comrope2d", {"variant": "ap"}, True),  # each block turns with one axis
        ("comrope2d", {"variant": "ld"}, False),
        ("rope2d", {}, True),
        ("rope2d_mixed", {}, False),
    ],
)
def test_cross_term_separates_axial_from_directional_rotations(
    name: str, options: dict, separable: bool, seed: int
) -> None:
    out = logits(build(name, seed, **options), seed)
    assert translation_error(out, GRID).max() < FP
    if separable:
        assert cross_term(out, GRID).max() < FP
    else:
        assert cross_term(out, GRID).min() > CLEAR


# --- STRING --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("freqs", ["mixed", "golden"])
def test_string_matches_its_definition(freqs: str, seed: int) -> None:
    """R(p) = P RoPE(p) P^T with P = (I - S)(I + S)^-1 orthogonal, and R(p) = exp(x L_x + y L_y) with
    L_i = P Omega_i P^T commuting (STRING's theorem); the logits are (R(p) q) . (R(p') k)."""
    enc = build("string2d", seed, freqs=freqs)
    s = skew_part(enc.skew.detach()).double()
    eye = torch.eye(HEAD_DIM, dtype=torch.float64)
    p = (eye - s) @ torch.linalg.inv(eye + s)  # the Cayley transform as written
    torch.testing.assert_close(enc.basis().double(), p, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p.transpose(-1, -2) @ p, eye.expand_as(p), rtol=0, atol=1e-10)

    coords = xy(GRID, "pixel")  # [N, 2]
    freq = enc.freqs.detach().double()
    freq = freq if freq.dim() == 3 else freq.expand(HEADS, -1, -1)  # [heads, 2, d/2]
    rope = dense_rope(coords @ freq)  # [heads, N, d, d]
    rotations = p[:, None] @ rope @ p[:, None].transpose(-1, -2)  # P RoPE(p) P^T
    gens = []
    for i in range(2):  # L_i = P Omega_i P^T, Omega_i: the generator of the pairs' turns along axis i
        omega = torch.zeros(HEADS, HEAD_DIM, HEAD_DIM, dtype=torch.float64)
        j = torch.arange(HEAD_DIM // 2)
        omega[:, j + HEAD_DIM // 2, j], omega[:, j, j + HEAD_DIM // 2] = freq[:, i], -freq[:, i]
        gens.append(p @ omega @ p.transpose(-1, -2))
    torch.testing.assert_close(gens[0] @ gens[1], gens[1] @ gens[0], rtol=0, atol=1e-9)
    total = coords[None, :, 0, None, None] * gens[0][:, None] + coords[None, :, 1, None, None] * gens[1][:, None]
    torch.testing.assert_close(torch.linalg.matrix_exp(total), rotations, rtol=0, atol=1e-8)
    q, k = content(seed, HEADS, HEAD_DIM), content(seed + 7, HEADS, HEAD_DIM)
    expected = dense_logits(rotations, q, k).float()
    torch.testing.assert_close(scheme_logits(enc, GRID, q=q, k=k), expected, rtol=1e-4, atol=1e-4)


def string_vit(seed: int, **options: object) -> nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model(
        "vit_tiny_patch16_224", img_size=(20, 28), patch_size=4, embed_dim=EMBED, depth=2, num_heads=HEADS,
        reg_tokens=1, num_classes=3, **options,
    )  # fmt: skip
    vispos.patch(model, "string2d")
    with torch.no_grad():
        for i, module in enumerate(model.vispos.attention):
            module.skew.copy_(content(50 + seed + i, *module.skew.shape) * 0.3)  # a basis far from I
    return model.eval()


@pytest.mark.parametrize("seed", SEEDS)
def test_folding_string_into_the_projections_keeps_the_outputs(seed: int) -> None:
    model = string_vit(seed)
    x = content(seed, 2, 3, 20, 28)
    with torch.no_grad():
        before = model(x)
        logits_before = layer_logits(model, (5, 7), layer=1, content=content(seed, EMBED))
        qkv_before = model.blocks[0].attn.qkv.weight.clone()
        fold_string(model)
        after = model(x)
        logits_after = layer_logits(model, (5, 7), layer=1, content=content(seed, EMBED))
    assert all(m.folded for m in model.vispos.attention)
    assert all(m(GRID).basis is None for m in model.vispos.attention)  # RoPE alone at run time
    assert (model.blocks[0].attn.qkv.weight - qkv_before).abs().max() > CLEAR  # the weights did change
    torch.testing.assert_close(model.blocks[0].attn.qkv.weight[2 * EMBED :], qkv_before[2 * EMBED :], rtol=0, atol=0)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits_after, logits_before, rtol=1e-4, atol=1e-4)

    fresh = string_vit(seed + 10)  # a folded checkpoint restores the folded state with the folded weights
    fresh.load_state_dict(model.state_dict())
    assert all(m.folded for m in fresh.vispos.attention)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), before, rtol=1e-4, atol=1e-5)
    fold_string(model)  # a second fold is a no-op
    with torch.no_grad():
        torch.testing.assert_close(model(x), after, rtol=0, atol=0)


def test_fold_string_refuses_what_it_cannot_fold() -> None:
    with pytest.raises(ValueError, match=r"identity q/k norms"):
        fold_string(string_vit(0, qk_norm=True))
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=1)
    with pytest.raises(ValueError, match=r"patched with pos='string2d'"):
        fold_string(vispos.patch(model, "rope2d"))
