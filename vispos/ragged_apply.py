"""Positions applied to a ragged batch's tokens (the layout: ``vispos.ragged``): rotations of every grid size
in one table (``concat_rotations``), the per-token logit scale SDPA cannot take (``QueryScaled``), and a
conditional scheme run on each image's own grid (``ragged_conditional``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from .encodings.rope import Rotary
from .ragged import RaggedLayout


def concat_rotations(rotations: list[Rotary]) -> Rotary:
    """Rotations of several grids -> one Rotary whose token axis holds each in turn (cos/sin/scales along
    their token axis -2, block rotations along -4). A basis (STRING) is the module's, the same for all."""

    def cat(name: str, axis: int) -> torch.Tensor | None:
        parts = [getattr(r, name) for r in rotations]
        return None if parts[0] is None else torch.cat(parts, dim=axis)

    first = rotations[0]
    return replace(
        first,
        cos=cat("cos", -2),
        sin=cat("sin", -2),
        q_scale=cat("q_scale", -2),
        k_scale=cat("k_scale", -2),
        blocks=cat("blocks", -4),
        temperature=1.0,  # each size's attention factor is already folded into its rows
    )


@dataclass
class QueryScaled:
    """A rotation (or none) followed by a per-token scale of q: ``scale`` [B, 1, T, 1] multiplies every
    logit of a query (log-n attention scaling with each image's own token count), which SDPA's single
    ``scale`` cannot hold. Used by the attention wherever a ``Rotary`` is (``rotate(q, k)``)."""

    rotary: Rotary | None
    scale: torch.Tensor

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotary is not None:
            q, k = self.rotary.rotate(q, k)
        return (q.float() * self.scale).to(q.dtype), k


def ragged_conditional(module: nn.Module, x: torch.Tensor, layout: RaggedLayout) -> torch.Tensor:
    """A conditional scheme (PEG: ``module(tokens [n, H*W, C], (H, W), 0)``) on a ragged batch x [B, T, C]:
    per grid size, each image's tokens are laid at their cells on a zero canvas of its own grid (missing
    cells read as zeros, as a border), transformed, and read back. Prefix tokens and padding are unchanged."""
    b, t, c = x.shape
    patches = layout.valid & ~layout.prefix
    out = x
    for u, (h, w) in enumerate(layout.sizes):
        here = patches & (layout.group == u)  # [B, T]
        images, slot = torch.unique(layout.image[here], return_inverse=True)
        place = slot * (h * w) + layout.cells()[here]  # each token's row on the stacked canvases
        if not torch.compiler.is_compiling() and place.unique().numel() != place.numel():
            raise ValueError("two tokens of one image share a grid cell; a conditional scheme needs distinct cells")
        canvas = x.new_zeros(images.numel() * h * w, c).index_copy(0, place, x[here])
        done = module(canvas.view(images.numel(), h * w, c), (h, w), 0).reshape(-1, c)
        out = out.masked_scatter(here[..., None], done[place])
    return out
