"""Fixed sinusoidal embeddings added to the tokens: 1D (Vaswani et al. 2017) and 2D (x and y halves).

1D: PE[pos, 2i] = sin(pos / T ** (2i / d)), PE[pos, 2i + 1] = cos(pos / T ** (2i / d)), T = 1e4.
2D: PE(x, y) = [PE_1D(x, d/2) || PE_1D(y, d/2)] (the seed survey's formula; MAE / timm build the same
values with the channels grouped differently).
"""

from __future__ import annotations

import torch
from torch import nn

from .._validate import check_float, check_grid, check_int, check_positions
from ..registry import register


def sincos_1d(positions: torch.Tensor, dim: int, temperature: float = 1e4) -> torch.Tensor:
    """positions [..., N] -> [..., N, dim], sin on even channels and cos on odd ones."""
    inv_freq = 1.0 / temperature ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions.double()[..., None] * inv_freq.to(positions.device)  # [..., N, d/2]
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2).float()


def sincos_2d(
    grid: tuple[int, int], dim: int, temperature: float = 1e4, device: torch.device | None = None
) -> torch.Tensor:
    """Grid (H, W) -> [H*W, dim], row-major: x on the first dim/2 channels, y on the rest."""
    h, w = grid
    yy, xx = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    return torch.cat(
        (sincos_1d(xx.flatten(), dim // 2, temperature), sincos_1d(yy.flatten(), dim // 2, temperature)), -1
    )


@register(
    "sincos1d", ndim=1, kind="additive", acts_on="embedding (added)", trainable=False, relative=False,
    extrapolation="formula defined anywhere; poor in practice", summary="Vaswani sinusoidal",
    context=("dim",), reference="Vaswani et al. 2017",
)
class SinCos1d(nn.Module):
    def __init__(self, *, dim: int, temperature: float = 1e4) -> None:
        super().__init__()
        self.dim = check_int("dim", dim, minimum=2)
        if dim % 2:
            raise ValueError(f"sincos1d needs an even dim, got {dim}")
        self.temperature = check_float("temperature", temperature, positive=True)

    def forward(self, positions: torch.Tensor | int) -> torch.Tensor:
        """-> [(B,) N, dim] fp32, to add to the token embeddings."""
        return sincos_1d(check_positions(positions), self.dim, self.temperature)


@register(
    "sincos2d", ndim=2, kind="additive", acts_on="embedding (added)", trainable=False, relative=False,
    extrapolation="any grid (formula); unseen absolute positions",
    summary="fixed 2D sin-cos, x and y on half the channels each (MAE)",
    context=("dim",), reference="Vaswani et al. 2017; He et al. 2022 (MAE)",
)
class SinCos2d(nn.Module):
    def __init__(self, *, dim: int, temperature: float = 1e4) -> None:
        super().__init__()
        self.dim = check_int("dim", dim, minimum=4)
        if dim % 4:
            raise ValueError(f"sincos2d needs dim divisible by 4 (sin and cos per axis), got {dim}")
        self.temperature = check_float("temperature", temperature, positive=True)

    def forward(self, grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
        """-> [H*W, dim] fp32."""
        return sincos_2d(check_grid(grid), self.dim, self.temperature, device)
