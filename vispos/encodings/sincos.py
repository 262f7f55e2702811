"""Fixed sinusoidal embeddings added to the tokens: 1D (Vaswani et al. 2017) and 2D (x and y halves).

1D: PE[pos, 2i] = sin(pos / T ** (2i / d)), PE[pos, 2i + 1] = cos(pos / T ** (2i / d)), T = 1e4.
2D: PE(x, y) = [PE_1D(x, d/2) || PE_1D(y, d/2)] (the seed survey's formula; MAE / timm build the same
values with the channels grouped differently).
"""

from __future__ import annotations

import torch
from torch import nn

from .._validate import check_dim, check_float, check_grid, check_positions
from ..registry import register


def sincos_1d(positions: torch.Tensor, dim: int, temperature: float = 1e4) -> torch.Tensor:
    """positions [..., N] -> [..., N, dim], sin on even channels and cos on odd ones."""
    inv_freq = 1.0 / temperature ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    angles = positions.double()[..., None] * inv_freq  # [..., N, d/2]
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2).float()


def sincos_2d(
    grid: tuple[int, int],
    dim: int,
    temperature: float = 1e4,
    device: torch.device | None = None,
    cells: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grid (H, W) -> [H*W, dim], row-major: x on the first dim/2 channels, y on the rest; or the embedding
    [M, dim] of the points ``cells`` [M, 2] ((y, x), possibly fractional)."""
    if cells is None:
        h, w = grid
        yy, xx = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        yy, xx = yy.flatten(), xx.flatten()
    else:
        yy, xx = cells[:, 0], cells[:, 1]
    return torch.cat((sincos_1d(xx, dim // 2, temperature), sincos_1d(yy, dim // 2, temperature)), -1)


@register("sincos1d", ndim=1, kind="additive", trainable=False, relative=False, context=("dim",),
    summary="Vaswani sinusoidal",
    extrapolation="formula defined anywhere; degrades past the training length (docs/seq1d.md)",
    reference="Vaswani et al. 2017")
class SinCos1d(nn.Module):
    """The fixed table for token positions; ``dim`` splits into a sin and a cos per frequency."""

    splits = 2  # channels per frequency (sin, cos); SinCos2d also halves them per axis

    def __init__(self, *, dim: int, temperature: float = 1e4) -> None:
        super().__init__()
        self.dim = check_dim(dim, self.splits, self.scheme_name, what="token width")
        self.temperature = check_float("temperature", temperature, positive=True)

    @property
    def scheme_name(self) -> str:
        return type(self).__name__.lower()

    def forward(self, positions: torch.Tensor | int) -> torch.Tensor:
        """-> [(B,) N, dim] fp32, to add to the token embeddings."""
        return sincos_1d(check_positions(positions), self.dim, self.temperature)


@register("sincos2d", ndim=2, kind="additive", trainable=False, relative=False, context=("dim",),
    summary="fixed 2D sin-cos, x and y on half the channels each (MAE)",
    extrapolation="any grid (formula); unseen absolute positions",
    reference="Vaswani et al. 2017; He et al. 2022 (MAE)")
class SinCos2d(SinCos1d):
    """The fixed table for a patch grid: x on the first half of the channels, y on the second."""

    splits = 4  # a sin and a cos per frequency, per axis

    def forward(  # type: ignore[override]
        self, grid: tuple[int, int], device: torch.device | None = None, *, cells: torch.Tensor | None = None
    ) -> torch.Tensor:
        """-> [H*W, dim] fp32; ``cells`` [M, 2]: at those points ((y, x), possibly fractional) -> [M, dim]."""
        return sincos_2d(check_grid(grid), self.dim, self.temperature, device, cells)
