"""ComRoPE (Yu et al. 2025): block rotations exp(sum_k p_k A_k) with learned, pairwise commuting generators.

Commuting generators make the rotation a group morphism, R(p)^T R(p') = R(p' - p), so logits depend on
offsets alone. The head channels split into M blocks of b; block m of axis k holds B_km, skew
(ComRoPE's two solutions, as in its code):

- ``ap`` (axis partition): B_km = P_m - P_m^T when m = k (mod A), else 0: each block turns with one axis
  only, so blocks of different axes act on different channels and commute.
- ``ld`` (linearly dependent): B_km = theta_km (P_m - P_m^T): one base matrix per block, a learned
  scale per axis (shared by the heads, as in the code); multiples of one matrix commute.

With b = 2 both reduce to RoPE with learned frequencies (``ap``: axial; ``ld``: RoPE-Mixed's directions).
Defaults as the official code: coordinates (i + 0.5) / n in [0, 1] per axis (``coords="unit"``), the
parameters drawn N(0, 1), blocks of 8 channels, one set per layer and head.
"""

from __future__ import annotations

import torch
from torch import nn

from .._validate import check_choice, check_dim, check_float, check_int
from ..registry import register
from ._cache import InferenceCache
from .liere import generator_rotations, xy_coords
from .rope import Rotary

VARIANTS: tuple[str, ...] = ("ap", "ld")
COORDS: tuple[str, ...] = ("unit", "normalized", "pixel")  # ``liere.xy_coords``
AXES = 2  # x, y


def axis_partition_mask(num_axes: int, num_blocks: int) -> torch.Tensor:
    """[A, M, 1, 1]: 1 where block m turns with axis k (m = k mod A), else 0."""
    m = torch.arange(num_blocks)
    return (m[None] % num_axes == torch.arange(num_axes)[:, None]).float()[..., None, None]


@register("comrope2d", ndim=2, kind="rotary", trainable=True, relative=True, context=("dim", "num_heads"),
    per_layer=True,
    summary="ComRoPE: block rotations exp(x B_x + y B_y) of learned commuting skew generators (AP or LD)",
    extrapolation="coords (i + 0.5) / n as the official code: any grid maps into [0, 1] (interpolation); "
    "exactly relative (tested)",
    reference="Yu et al. 2025 (ComRoPE, CVPR)")
class ComRope2d(nn.Module):
    """ComRoPE on a patch grid: ``variant`` ``ap`` or ``ld``, blocks of ``block_size`` channels.

    Parameters as ComRoPE's code: ``base`` [heads, d/b, b, b] drawn N(0, ``init_std``); for ``ld`` the
    axis scales ``scale`` [2 (x, y), d/b] drawn N(0, 1). ``ap`` needs an even number of blocks (half per
    axis). Coordinates: ``unit`` (default; patch centres (i + 0.5) / n in [0, 1], as the official code),
    ``normalized`` (centres in [-1, 1]: twice the offsets, so the rotations of generators twice as large),
    or ``pixel``. Prefix tokens are not rotated (ComRoPE places its cls token at the centre
    instead). Generators are indexed (x, y); the official code's axis 0 is the row (y).
    """

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        variant: str = "ap",
        block_size: int = 8,
        coords: str = "unit",
        init_std: float = 1.0,
    ) -> None:
        super().__init__()
        self.variant = check_choice("variant", variant, VARIANTS)
        self.block_size = check_int("block_size", block_size, minimum=2)
        multiple = self.block_size * (AXES if self.variant == "ap" else 1)
        what = f"head dimension ({'two axes x ' if self.variant == 'ap' else ''}blocks of {block_size})"
        self.dim = check_dim(dim, multiple, f"comrope2d ({self.variant})", what=what)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.coords = check_choice("coords", coords, COORDS)
        self.init_std = check_float("init_std", init_std, positive=True)
        b, blocks = self.block_size, self.dim // self.block_size
        self.base = nn.Parameter(torch.randn(self.num_heads, blocks, b, b) * self.init_std)
        if self.variant == "ld":
            self.scale = nn.Parameter(torch.randn(AXES, blocks))
        else:
            self.register_buffer("mask", axis_partition_mask(AXES, blocks), persistent=False)  # [2, M, 1, 1]
        self.cache = InferenceCache()  # the rotations of the last grids, at inference

    @torch.no_grad()
    def init_non_persistent_buffers(self) -> None:
        """timm's protocol for buffers a checkpoint does not hold (``reinit_non_persistent_buffers``, after
        ``to_empty``): the axis partition of the generator blocks (comrope-ap) is set again from the options."""
        if self.variant == "ap":
            self.mask.copy_(axis_partition_mask(AXES, self.dim // self.block_size))

    def generators(self) -> torch.Tensor:
        """Pairwise commuting skew generators [heads, 2 (x, y), d/b, b, b]."""
        skew = (self.base - self.base.transpose(-1, -2))[:, None]  # [heads, 1, M, b, b]
        if self.variant == "ld":
            return skew * self.scale[..., None, None]  # theta_km (P_m - P_m^T)
        return skew * self.mask

    def forward(
        self, grid: tuple[int, int], device: torch.device | None = None, *, cells: torch.Tensor | None = None
    ) -> Rotary:
        """The rotations of the patches of ``grid``, or of the points ``cells`` [M, 2] of an image of that grid
        (a grid's: computed once at inference, ``InferenceCache``)."""
        device = device or self.base.device

        def rotation() -> Rotary:
            xy = xy_coords(grid, self.coords, device, cells)  # [HW or M, 2]
            return Rotary(None, None, blocks=generator_rotations(xy, self.generators()))  # [heads, HW, d/b, b, b]

        return rotation() if cells is not None else self.cache.get(self, (tuple(grid), str(device)), rotation)

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, num_heads={self.num_heads}, variant={self.variant!r}, "
            f"block_size={self.block_size}, coords={self.coords!r}"
        )
