"""bf16 rotations round once: the eager three passes (``rope_eager``) and the fused block rotation (``rope_fused``)
compute in fp32 from bf16 q / k and bf16 tables and round the result to bf16 once, so every output lies within half
a bf16 unit in the last place of the fp32 result (products or sums kept in bf16 would be off by more)."""

from __future__ import annotations

import torch

from vispos.encodings.rope_eager import rotate_half_in_place
from vispos.encodings.rope_fused import fused_blocks


def half_ulp_bf16(reference: torch.Tensor) -> torch.Tensor:
    """Half a bf16 unit in the last place at each value of ``reference`` (fp32): bf16 keeps 8 significant bits."""
    exponent = torch.floor(torch.log2(reference.abs().clamp(min=1e-30)))
    return 2.0 ** (exponent - 8)


def within_one_rounding(out: torch.Tensor, reference: torch.Tensor) -> bool:
    return bool(((out.float() - reference).abs() <= half_ulp_bf16(reference) * 1.0001 + 1e-30).all())


def test_the_eager_rotation_rounds_bf16_once() -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 4, 64, 32, generator=g) * 3).to(torch.bfloat16)
    angles = torch.randn(64, 16, generator=g) * 5
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(torch.bfloat16)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(torch.bfloat16)
    xf, c, s = x.float(), cos.float(), sin.float()
    reference = xf * c + torch.cat((-xf[..., 16:], xf[..., :16]), -1) * s
    assert within_one_rounding(rotate_half_in_place(x.clone(), cos, sin), reference)


def test_the_fused_block_rotation_rounds_bf16_once() -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 4, 64, 32, generator=g) * 3).to(torch.bfloat16)
    generators = torch.randn(64, 8, 4, 4, generator=g)
    blocks = torch.linalg.matrix_exp(generators - generators.transpose(-1, -2)).to(torch.bfloat16)  # rotations
    xb = x.float().reshape(2, 4, 64, 8, 4)
    reference = torch.einsum("nmij,bhnmj->bhnmi", blocks.float(), xb).reshape(2, 4, 64, 32)
    assert within_one_rounding(fused_blocks(x, blocks), reference)
