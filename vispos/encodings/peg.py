"""CPVT's positional encoding generator (PEG): conditional positions from a depthwise conv on the token grid.

After a transformer block, the patch tokens are laid back on their (H, W) grid and a depthwise k x k
convolution (zero padding, stride 1) of them is added: x + DWConv(x) (Chu et al. 2023, CPVT; Twins
and PVT v2 use it, timm as ``twins.PosConv``). Positions come from the zero padding at the borders, so
the encoding is defined on any grid (resolution-agnostic by construction), but it is not relative: a
token near a border sees the padding. Prefix tokens (cls, registers) pass unchanged, as in CPVT.

``peg2d`` is the catalogue's ``conditional`` kind: it acts on the tokens between blocks, not on the
embedding or inside attention, so it sits beside at most one additive and one attention scheme
(``vispos.patch(model, "peg2d", after=0)``, ``vispos.patch(model, ["peg2d", "rope2d"])``); ``after``
is the block it follows (CPVT's place: the first, 0).

A row holding only some patch tokens (timm's patch dropout, an MAE encoder's kept tokens: ``tokens``)
has them laid at their own places on a zero grid: a dropped patch reads as zero padding, as the border.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .._validate import _symbolic, check_dim, check_grid, check_int
from ..registry import register


def peg_2d(x: torch.Tensor, grid: tuple[int, int], weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Patch tokens x [B, H*W, C] (row-major) -> x + depthwise conv(x) [B, H*W, C].

    ``weight`` [C, 1, k, k] (groups = C), ``bias`` [C]; zero padding k // 2, stride 1.
    """
    h, w = grid
    feat = rearrange(x, "b (h w) c -> b c h w", h=h, w=w)
    out = F.conv2d(feat, weight.to(x.dtype), None if bias is None else bias.to(x.dtype),
                   padding=weight.shape[-1] // 2, groups=feat.shape[1])  # fmt: skip
    return rearrange(out + feat, "b c h w -> b (h w) c")


def peg_2d_subset(
    x: torch.Tensor, keep: torch.Tensor, grid: tuple[int, int], weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Some patch tokens x [B, K, C] at distinct grid places ``keep`` [B, K] (row-major) -> x + depthwise
    conv [B, K, C], the missing patches read as zeros (``peg_2d`` of the zero grid holding x, at ``keep``)."""
    b, _, c = x.shape
    index = keep[:, :, None].expand(-1, -1, c)  # [B, K, C]
    full = x.new_zeros(b, grid[0] * grid[1], c).scatter(1, index, x)  # [B, H*W, C]
    return peg_2d(full, grid, weight, bias).gather(1, index)


class TokenConv(nn.Conv2d):
    """PEG's depthwise convolution, called on patch tokens: its weights are read in its own call (where offloading
    hooks bring them in). x [B, H*W, C] -> x + conv(x); ``keep`` [B, K]: x [B, K, C] holds only those cells."""

    def forward(self, x: torch.Tensor, grid: tuple[int, int], keep: torch.Tensor | None = None) -> torch.Tensor:
        if keep is None:
            return peg_2d(x, grid, self.weight, self.bias)
        return peg_2d_subset(x, keep, grid, self.weight, self.bias)


@register("peg2d", ndim=2, kind="conditional", trainable=True, relative=False, context=("dim",),
    summary="CPVT's PEG: x + depthwise k x k conv of the patch tokens on their grid, after block `after`; "
    "equals timm's twins.PosConv (tested)",
    extrapolation="any grid (the same conv; positions from the zero padding at the borders)",
    reference="Chu et al. 2023 (CPVT); timm twins.PosConv")  # fmt: skip
class Peg2d(nn.Module):
    """PEG: tokens [B, P + H*W, C] -> the same with x + DWConv(x) on the patch tokens; prefix untouched.

    ``proj`` is a ``Conv2d(dim, dim, kernel_size, padding=kernel_size // 2, groups=dim)`` (``TokenConv``), as timm's
    ``PosConv.proj[0]``, so weights move between the two as they are. ``after``: the block whose output
    it transforms (read by the host: ``vispos.patch``).
    """

    def __init__(self, *, dim: int, kernel_size: int = 3, after: int = 0) -> None:
        super().__init__()
        self.dim = check_dim(dim, 1, "peg2d", what="token width")
        self.kernel_size = check_int("kernel_size", kernel_size, minimum=1)
        if self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd (the grid keeps its size), got {kernel_size}")
        self.after = check_int("after", after, minimum=0)
        k = self.kernel_size
        self.proj = TokenConv(self.dim, self.dim, k, padding=k // 2, groups=self.dim, bias=True)

    def forward(
        self,
        x: torch.Tensor,
        grid: tuple[int, int],
        num_prefix_tokens: int = 0,
        tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, P + H*W, C] -> [B, P + H*W, C]. ``tokens`` [B, P + K]: the row holds only these of the
        P + H*W tokens (``PositionContext.tokens``: the prefix first, then K distinct patches), x [B, P + K, C]."""
        h, w = check_grid(grid)
        p = num_prefix_tokens
        expected = p + h * w if tokens is None else tokens.shape[1]
        if not (_symbolic(x.shape[1]) or _symbolic(expected)) and x.shape[1] != expected:
            held = f"{h}x{w} grid" if tokens is None else f"subset of {expected - p} patches"
            raise ValueError(f"{x.shape[1]} tokens do not fit {p} prefix tokens + a {held}")
        prefix, patches = x[:, :p], x[:, p:]
        out = self.proj(patches, (h, w), None if tokens is None else tokens[:, p:] - p)
        return torch.cat((prefix, out), dim=1)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, kernel_size={self.kernel_size}, after={self.after}"
