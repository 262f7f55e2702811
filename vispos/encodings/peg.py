"""CPVT's positional encoding generator (PEG): conditional positions from a depthwise conv on the token grid.

After a transformer block, the patch tokens are laid back on their (H, W) grid and a depthwise k x k
convolution (zero padding, stride 1) of them is added: x + DWConv(x) (Chu et al. 2023, CPVT; Twins
and PVT v2 use it, timm as ``twins.PosConv``). Positions come from the zero padding at the borders, so
the encoding is defined on any grid (resolution-agnostic by construction), but it is not relative: a
token near a border sees the padding. Prefix tokens (cls, registers) pass unchanged, as in CPVT.

``add_peg(model, after=0)`` puts one after block ``after`` of a ``vispos.patch``-ed timm ViT (CPVT's
place: after the first block), as a forward hook on that block that reads the grid from vispos's
positional context; its weights are ``model.peg.*`` in the state dict.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .._validate import check_dim, check_grid, check_int


def peg_2d(x: torch.Tensor, grid: tuple[int, int], weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Patch tokens x [B, H*W, C] (row-major) -> x + depthwise conv(x) [B, H*W, C].

    ``weight`` [C, 1, k, k] (groups = C), ``bias`` [C]; zero padding k // 2, stride 1.
    """
    h, w = grid
    feat = rearrange(x, "b (h w) c -> b c h w", h=h, w=w)
    out = F.conv2d(feat, weight.to(x.dtype), None if bias is None else bias.to(x.dtype),
                   padding=weight.shape[-1] // 2, groups=feat.shape[1])  # fmt: skip
    return rearrange(out + feat, "b c h w -> b (h w) c")


class Peg2d(nn.Module):
    """PEG: tokens [B, P + H*W, C] -> the same with x + DWConv(x) on the patch tokens; prefix untouched.

    ``proj`` is a ``Conv2d(dim, dim, kernel_size, padding=kernel_size // 2, groups=dim)``, as timm's
    ``PosConv.proj[0]``, so weights move between the two as they are.
    """

    def __init__(self, *, dim: int, kernel_size: int = 3) -> None:
        super().__init__()
        self.dim = check_dim(dim, 1, "peg2d", what="token width")
        self.kernel_size = check_int("kernel_size", kernel_size, minimum=1)
        if self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd (the grid keeps its size), got {kernel_size}")
        k = self.kernel_size
        self.proj = nn.Conv2d(self.dim, self.dim, k, padding=k // 2, groups=self.dim, bias=True)

    def forward(self, x: torch.Tensor, grid: tuple[int, int], num_prefix_tokens: int = 0) -> torch.Tensor:
        h, w = check_grid(grid)
        if x.shape[1] != num_prefix_tokens + h * w:
            raise ValueError(f"{x.shape[1]} tokens do not fit {num_prefix_tokens} prefix tokens + a {h}x{w} grid")
        prefix, patches = x[:, :num_prefix_tokens], x[:, num_prefix_tokens:]
        return torch.cat((prefix, peg_2d(patches, (h, w), self.proj.weight, self.proj.bias)), dim=1)

    def after_block(self, block: nn.Module, args: tuple, kwargs: dict[str, Any], out: torch.Tensor) -> torch.Tensor:
        """Forward hook of the block the PEG follows: its output, with the PEG applied at the context's grid.
        (A bound method, so ``copy.deepcopy`` and pickling of the model carry it to the copy's PEG.)"""
        ctx = kwargs.get("attn_mask", args[1] if len(args) > 1 else None)
        if not hasattr(ctx, "grid"):
            raise RuntimeError("the PEG needs vispos's positional context: call the patched model's forward")
        return self(out, ctx.grid, ctx.positions.num_prefix_tokens)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, kernel_size={self.kernel_size}"


def add_peg(model: nn.Module, *, after: int = 0, kernel_size: int = 3) -> nn.Module:
    """Add a PEG after block ``after`` of a ``vispos.patch``-ed timm ViT (in place; returns the model).

    The PEG is ``model.peg``; a forward hook on ``model.blocks[after]`` applies it to the block's output
    with the grid and prefix count of the forward's positional context. Combine with any vispos scheme
    (CPVT: ``pos="nope"``, the PEG alone).
    """
    if not hasattr(getattr(model, "vispos", None), "context"):
        raise ValueError("add_peg needs a model patched by vispos (vispos.patch(model, ...)) for its token grid")
    if getattr(model, "peg", None) is not None:
        raise ValueError("this model already has a PEG (model.peg)")
    depth = len(model.blocks)
    after = check_int("after", after, minimum=0)
    if after >= depth:
        raise ValueError(f"after={after} is out of range; the model has {depth} blocks (0 to {depth - 1})")
    model.peg = Peg2d(dim=model.embed_dim, kernel_size=kernel_size).to(next(model.parameters()).device)
    model.blocks[after].register_forward_hook(model.peg.after_block, with_kwargs=True)
    return model
