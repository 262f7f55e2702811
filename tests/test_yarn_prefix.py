"""YaRN's attention factor on prefix tokens (cls, registers), pinned against transformers' rule.

transformers (``_compute_yarn_parameters`` returns ``attention_factor`` = 0.1 ln s + 1 unless given; the rotary
embedding multiplies cos and sin by it, and ``apply_rotary_pos_emb`` computes q cos + rotate_half(q) sin for every
token) multiplies q and k of every rotated token by the factor, the token at angle 0 (position 0, the identity
rotation) included, so every logit q . k gets factor^2. Only channels left out of the rotation
(``partial_rotary_factor``'s pass-through) are not multiplied. vispos's prefix tokens are tokens at the identity
rotation, as transformers' position 0, not pass-through channels: their q and k get the factor too, so the logits
between prefix and patch tokens, and among prefix tokens, get the same factor^2 (YaRN's temperature on every
logit) as those among patches. The reference below transcribes transformers' YaRN frequencies per axis."""

from __future__ import annotations

import math

import pytest
import timm
import torch

import vispos

THETA, TRAIN, GRID = 100.0, (4, 4), (8, 8)  # rope2d's default theta; 2x per axis: s = 2 on both


def yarn_inv_freq(dim: int, base: float, factor: float, original: int, beta_fast: float = 32, beta_slow: float = 1):
    """transformers' YaRN inverse frequencies [dim / 2] (truncated correction range, its default)."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    keep = 1 - ramp  # the share of the unscaled frequency
    return extrapolation / factor * (1 - keep) + extrapolation * keep


def reference_logits(q: torch.Tensor, k: torch.Tensor, cells: torch.Tensor, p: int, prefix_factor: bool = True):
    """q, k [heads, P + M, d] of P prefix tokens then patch tokens at ``cells`` [M, 2] (y, x) of the 8 x 8 grid,
    trained at 4 x 4 -> logits [heads, P + M, P + M] by transformers' rule (axial, x pairs first, half layout)."""
    d = q.shape[-1]
    m = 0.1 * math.log(2) + 1  # both axes at s = 2: the geometric mean of two equal factors
    inv = yarn_inv_freq(d // 2, THETA, 2.0, TRAIN[0])  # [d / 4] per axis
    angles = torch.cat((cells[:, 1, None] * inv, cells[:, 0, None] * inv), dim=-1).double()  # [M, d / 2]
    angles = torch.cat((angles, angles), dim=-1)  # half layout: [M, d]
    cos = torch.cat((torch.ones(p, d, dtype=torch.float64), angles.cos())) * m
    sin = torch.cat((torch.zeros(p, d, dtype=torch.float64), angles.sin())) * m
    if not prefix_factor:
        cos[:p] = 1.0

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x = x.double()
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    return rotate(q) @ rotate(k).transpose(-1, -2)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    net = timm.create_model("vit_tiny_patch16_224", img_size=64, reg_tokens=2, depth=1, num_classes=0)
    net = vispos.patch(net, "rope2d")
    return vispos.configure(net, scaling="yarn").eval()


def contexts(pos: vispos.positions.Positions) -> dict[str, tuple[object, torch.Tensor]]:
    """The four ways a forward builds rotations, each with its patch tokens' cells [M, 2]."""
    cpu = torch.device("cpu")
    cells = torch.cartesian_prod(torch.arange(GRID[0]), torch.arange(GRID[1]))
    keep = torch.tensor([0, 9, 27, 63, 5])
    return {
        "dense": (pos.context(GRID, cpu), cells),
        "subset": (pos.context(GRID, cpu, keep=keep[None]), cells[keep]),
        "ragged cells": (pos.ragged_context(cells[keep][None], torch.tensor([GRID])), cells[keep]),
        "ragged points": (pos.ragged_context(cells[keep][None].float(), torch.tensor([GRID])), cells[keep]),
    }


@pytest.mark.parametrize("path", ["dense", "subset", "ragged cells", "ragged points"])
def test_yarn_factor_reaches_prefix_rows_as_transformers_position_zero(model: torch.nn.Module, path: str) -> None:
    pos = model.vispos
    p, heads = pos.num_prefix_tokens, model.blocks[0].attn.num_heads
    ctx, cells = contexts(pos)[path]
    rotation, _ = ctx.layer(0)
    d = model.embed_dim // heads
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(heads, p + len(cells), d, generator=g), torch.randn(heads, p + len(cells), d, generator=g)
    rq, rk = rotation.rotate(q[None], k[None])
    logits = (rq[0].double() @ rk[0].double().transpose(-1, -2))
    torch.testing.assert_close(logits, reference_logits(q, k, cells, p), rtol=1e-4, atol=1e-4)
    m2 = (0.1 * math.log(2) + 1) ** 2
    torch.testing.assert_close(logits[:, :p, :p], m2 * (q[:, :p] @ k[:, :p].transpose(-1, -2)).double(),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    unscaled = reference_logits(q, k, cells, p, prefix_factor=False)  # control: the factor left off prefix rows
    assert (logits[:, :p] - unscaled[:, :p]).abs().max() > 1e-2
