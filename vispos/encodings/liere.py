"""LieRE (Ostmeier et al. 2025): rotations R(p) = exp(sum_k p_k A_k) of learned skew-symmetric generators.

The generators are block-diagonal, as in the LieRE code: head channels split into blocks of b, block m
of axis k holding its own b x b skew matrix A_km. A token at coordinates p [A] turns block m by
exp(sum_k p_k A_km). Generators of different axes need not commute, so in general
R(p)^T R(p') != R(p' - p): LieRE is *not* exactly relative (ComRoPE, ``comrope.py``, restores that by
making the generators commute). ``generator_rotations`` is the shared maths of both.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._validate import check_choice, check_dim, check_float, check_grid, check_int
from ..registry import register
from .rope import Rotary
from .rope2d import COORDS, grid_coords


def generator_rotations(coords: torch.Tensor, generators: torch.Tensor) -> torch.Tensor:
    """Block rotations exp(sum_k p_k A_km): coords [N, A] x generators [(heads,) A, M, b, b] (skew) ->
    [(heads,) N, M, b, b], in fp32 (``torch.linalg.matrix_exp``)."""
    with torch.autocast(coords.device.type, enabled=False):  # autocast would run the einsum in bf16 / fp16
        summed = torch.einsum("na,...amij->...nmij", coords.float(), generators.float())  # [(heads,) N, M, b, b]
        return torch.linalg.matrix_exp(summed.contiguous())


def upper_skew(raw: torch.Tensor) -> torch.Tensor:
    """LieRE's parametrisation: U - U^T with U the strict upper triangle of raw [..., b, b]."""
    upper = torch.triu(raw, diagonal=1)
    return upper - upper.transpose(-1, -2)


def xy_coords(
    grid: tuple[int, int], coords: str, device: torch.device | None, cells: torch.Tensor | None = None
) -> torch.Tensor:
    """(x, y) patch coordinates [H*W, 2] (or of ``cells`` [M, 2]): indices (``pixel``) or centres in [-1, 1]."""
    return grid_coords(check_grid(grid), coords, device, cells=cells).flip(-1)


@register("liere2d", ndim=2, kind="rotary", trainable=True, relative=False, context=("dim", "num_heads"),
    per_layer=True,
    summary="LieRE: block rotations exp(x A_x + y A_y) of learned skew generators per head (not relative)",
    extrapolation="normalized coords: any grid maps into [-1, 1]; not translation invariant (tested)",
    reference="Ostmeier et al. 2025 (LieRE)")
class Liere2d(nn.Module):
    """LieRE on a patch grid: generators [heads, 2 (x, y), d/b, b, b], one module per layer.

    As LieRE's code: the raw parameters start uniform in [0, ``init_range``) (2 pi), the generators are
    their strict upper triangle minus its transpose. Coordinates: ``normalized`` (default; patch centres
    in [-1, 1], where LieRE uses [0, 1]: twice the span, so generators of half the size give the same
    rotations up to a fixed offset) or ``pixel`` (integer indices). Prefix tokens are not rotated.
    """

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        block_size: int = 4,
        coords: str = "normalized",
        init_range: float = 2 * math.pi,
    ) -> None:
        super().__init__()
        self.block_size = check_int("block_size", block_size, minimum=2)
        self.dim = check_dim(dim, self.block_size, "liere2d", what=f"head dimension (blocks of {block_size})")
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.coords = check_choice("coords", coords, COORDS)
        self.init_range = check_float("init_range", init_range, positive=True)
        b = self.block_size
        self.raw = nn.Parameter(torch.rand(self.num_heads, 2, self.dim // b, b, b) * self.init_range)

    def generators(self) -> torch.Tensor:
        """Skew-symmetric generators [heads, 2 (x, y), d/b, b, b]."""
        return upper_skew(self.raw)

    def forward(
        self, grid: tuple[int, int], device: torch.device | None = None, *, cells: torch.Tensor | None = None
    ) -> Rotary:
        """The rotations of the patches of ``grid``, or of the points ``cells`` [M, 2] of an image of that grid."""
        xy = xy_coords(grid, self.coords, device or self.raw.device, cells)  # [HW or M, 2]
        return Rotary(None, None, blocks=generator_rotations(xy, self.generators()))  # [heads, HW, d/b, b, b]

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, block_size={self.block_size}, coords={self.coords!r}"
