"""xPos (Sun et al. 2022): RoPE whose pair magnitudes decay exponentially with the query-key distance.

Pair i of a head of ``dim`` channels has zeta_i = (2i + 0.4 dim) / (1.4 dim) < 1; q at position n is
scaled by zeta ** ((n - c) / scale_base) and k at m by zeta ** (-(m - c) / scale_base), so their product
carries zeta ** ((n - m) / scale_base): it decays as the key falls behind the query (a causal scheme).
The centre c (the middle of each sequence's positions) cancels in q.k; it halves the largest power, so
the scales of N tokens stay within zeta_0 ** (+-N / (2 scale_base)) (zeta_0 = 2/7): 2.3e4 at N = 8192
with the default scale_base, where uncentred powers reach 5e8 and overflow fp16 (65504) past ~4000 tokens.
Scaled keys can still outgrow fp16 where their product with the queries does not: ``vispos.layers.Attention``
therefore keeps xPos's q, k and attention in fp32 (the output returns to the input dtype).
"""

from __future__ import annotations

import torch
from torch import nn

from .._validate import check_choice, check_dim, check_float, check_positions
from ..registry import register
from .rope import LAYOUTS, Rotary, expand_angles, rope_angles
from .rope_scaling import rope_inv_freq


def xpos_zeta(dim: int) -> torch.Tensor:
    """Per-pair decay bases [dim // 2]."""
    return (torch.arange(0, dim, 2, dtype=torch.float32) + 0.4 * dim) / (1.4 * dim)


def centred_power(positions: torch.Tensor, scale_base: float) -> torch.Tensor:
    """(n - c) / scale_base per position, fp32, with c the middle of each sequence's positions. [..., N, 1]."""
    pos = positions.float()
    centre = (pos.amin(-1, keepdim=True) + pos.amax(-1, keepdim=True)) / 2  # [..., 1]
    return ((pos - centre) / scale_base)[..., None]


@register("xpos", ndim=1, kind="rotary", trainable=False, relative=True, context=("dim",),
    summary="RoPE with exponential decay (causal)",
    extrapolation="above RoPE past the training length on passkey (docs/seq1d.md)",
    reference="Sun et al. 2022")
class XPos(nn.Module):
    def __init__(self, *, dim: int, theta: float = 10000.0, scale_base: float = 512.0, layout: str = "half") -> None:
        super().__init__()
        self.dim = check_dim(dim, 2, "xpos")
        self.theta = check_float("theta", theta, positive=True)
        self.scale_base = check_float("scale_base", scale_base, positive=True)
        self.layout = check_choice("layout", layout, LAYOUTS)

    def forward(self, positions: torch.Tensor | int) -> Rotary:
        positions = check_positions(positions)
        angles = expand_angles(rope_angles(positions, rope_inv_freq(self.dim, self.theta)), self.layout)
        zeta = expand_angles(xpos_zeta(self.dim).to(positions.device), self.layout)  # [d]
        power = centred_power(positions, self.scale_base)  # [..., N, 1]
        q_scale, k_scale = zeta**power, zeta ** (-power)
        if positions.dim() == 2:
            angles, q_scale, k_scale = angles[:, None], q_scale[:, None], k_scale[:, None]
        return Rotary(angles.cos(), angles.sin(), self.layout, q_scale, k_scale)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, theta={self.theta}, scale_base={self.scale_base}, layout={self.layout!r}"
