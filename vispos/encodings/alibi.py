"""ALiBi (Press et al. 2022): a fixed, per-head linear penalty on distance, in 1D and on the 2D patch plane."""

from __future__ import annotations

import math

import torch
from torch import nn

from .._validate import check_bool, check_grid, check_int, check_positions
from ..registry import register
from .relbias import OffsetBias, offsets_2d


def alibi_slopes(num_heads: int, device: torch.device | None = None) -> torch.Tensor:
    """Geometric slopes 2 ** (-8 (i + 1) / n) for n a power of two; otherwise the slopes for the
    closest lower power of two followed by every other slope of the next power of two. [num_heads], made
    on ``device`` (from Python numbers: nothing is read back from a device)."""
    check_int("num_heads", num_heads, minimum=1)

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    lower = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(lower)
    if lower < num_heads:
        slopes += power_of_two(2 * lower)[0::2][: num_heads - lower]
    return torch.tensor(slopes, dtype=torch.float32, device=device)


def causal_mask(n: int, device: torch.device | None = None) -> torch.Tensor:
    """[N, N] float: 0 on and below the diagonal, -inf above (a query never sees later keys)."""
    return torch.full((n, n), float("-inf"), device=device).triu(1)


@register("alibi", ndim=1, kind="bias", trainable=False, relative=True, context=("num_heads", "causal"),
    summary="linear distance penalty, geometric slopes",
    extrapolation="holds to 8x the training length on passkey (docs/seq1d.md)",
    reference="Press et al. 2022")
class Alibi(nn.Module):
    """1D ALiBi. Symmetric form: -m |i - j|. ``causal=True`` also masks future keys (-inf above the
    diagonal); on the visible keys both forms give -m (i - j)."""

    def __init__(self, *, num_heads: int, causal: bool = False) -> None:
        super().__init__()
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.causal = check_bool("causal", causal)

    def forward(self, positions: torch.Tensor | int) -> torch.Tensor:
        """-> [(B,) heads, N, N] fp32."""
        positions = check_positions(positions).float()
        distance = (positions[..., :, None] - positions[..., None, :]).abs()  # [(B,) N, N]
        slopes = alibi_slopes(self.num_heads, positions.device)
        bias = -slopes[:, None, None] * distance.unsqueeze(-3)
        if self.causal:
            bias = bias + causal_mask(positions.shape[-1], positions.device)
        return bias


@register("alibi2d", ndim=2, kind="bias", trainable=False, relative=True, context=("num_heads",),
    summary="ALiBi on the Euclidean patch distance, per-head slopes", extrapolation="any grid (distance penalty)",
    reference="Press et al. 2022 (ALiBi), 2D form")
class Alibi2d(OffsetBias):
    """ALiBi on the Euclidean distance between patches: -m_h * sqrt(dy^2 + dx^2)."""

    def __init__(self, *, num_heads: int) -> None:
        super().__init__()
        self.num_heads = check_int("num_heads", num_heads, minimum=1)

    def offset_bias(self, grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
        """-> [heads, 2H-1, 2W-1] fp32, one value per offset (dy, dx)."""
        distance = offsets_2d(check_grid(grid), device).float().norm(dim=-1)  # [2H-1, 2W-1]
        return -alibi_slopes(self.num_heads, distance.device)[:, None, None] * distance

    def pair_bias(self, offsets: torch.Tensor) -> torch.Tensor:
        """The bias at offsets (dy, dx) [..., 2] in patch units, possibly fractional -> [heads, ...] fp32."""
        distance = offsets.float().norm(dim=-1)
        slopes = alibi_slopes(self.num_heads, distance.device)
        return -slopes.view(-1, *([1] * distance.dim())) * distance
