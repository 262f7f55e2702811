"""Building the per-forward context of ``Positions``: on one dense grid (optionally a token subset,
``keep``) or on a ragged / packed batch given by per-token coordinates."""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from ..attention import as_float_mask, combine_masks
from ..ragged import ragged_layout
from ..registry import get_info
from .context import PositionContext


def _kept_indices(mask: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """A bool keep mask [B, H*W] (True: the patch is kept) -> its kept patch indices [B, K], ascending (the
    order ``x[mask].view(B, K, C)`` leaves the tokens in). Every row must keep as many patches."""
    b, n = mask.shape
    if n != grid[0] * grid[1]:
        raise ValueError(
            f"a bool keep mask must be [B, H*W] = [B, {grid[0] * grid[1]}] for the {grid[0]}x{grid[1]} grid "
            f"(True: kept), got [{b}, {n}]; pass kept patch indices [B, K] otherwise"
        )
    counts = mask.sum(dim=1)
    if not torch.compiler.is_compiling() and bool((counts != counts[:1]).any()):
        raise ValueError(f"a bool keep mask must keep as many patches in every row, got {counts.tolist()}")
    return mask.nonzero()[:, 1].view(b, -1)  # [B, K]: row-major, as the mask is read


class Contexts:
    """``Positions.context`` and ``Positions.ragged_context`` (a mixin of ``Positions``)."""

    def context(
        self,
        grid: tuple[int, int],
        device: torch.device,
        user_mask: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ) -> PositionContext:
        """What every layer needs at this grid. A scheme shared by all layers is evaluated here, once; a
        per-layer scheme when its layer asks (``PositionContext.layer``), so in inference at most one
        layer's bias mask exists at a time, except rotations a scheme stacks over its layers (``_stacked``).

        ``keep`` [B, K]: each row holds only these patch tokens (row-major indices into the H x W grid, in
        the order the row holds them; the prefix tokens stay first), as timm's patch dropout or an MAE
        encoder's random masking leaves them. Every token keeps the position of its place in the grid."""
        tokens = None if keep is None else self._subset(keep, grid, device)
        user = as_float_mask(user_mask, torch.float32)
        ctx = PositionContext(self, grid, device, user, None, self.logit_scale(grid), None, tokens)
        if self.enabled and self.attention is not None and not self._flex_ready(ctx):
            index = self._bias_index(grid, device)  # no dense mask is built for FlexAttention
            if index is not None and tokens is not None:
                index = index[tokens[:, :, None], tokens[:, None, :]]  # [B, M, M]
            ctx.bias_index = index
            if not self._per_layer:
                ctx.shared = self._combined(self._prefixed(self.attention, ctx), user)
            else:  # RoPE-Mixed: every layer's rotation in one product (``_stacked``)
                ctx.stacked = self._stacked(ctx)
                ctx.stacked_layers = None if ctx.stacked is None else ctx.stacked.layers()
        return ctx

    def ragged_context(
        self,
        coords: torch.Tensor,
        sizes: torch.Tensor | None = None,
        *,
        valid: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
        user_mask: torch.Tensor | None = None,
        separate: bool = False,
    ) -> PositionContext:
        """The context of a ragged or packed batch: rows of P prefix tokens then N patch tokens, patch token n
        of row b at the integer cell ``coords[b, n]`` = (y, x) of its own image's grid (timm NaFlex's
        ``patch_coord``), ``valid`` [B, N] False for padding; one image per row of size ``sizes`` [B, 2], or
        several packed in a row (``segments`` [B, N], ``sizes`` [B, S, 2], no prefix tokens). Without
        ``sizes``, each image's grid is the bounding box of its cells (``vispos.ragged.ragged_layout``).

        Each image gets exactly what it gets alone at its own size: every scheme is computed once per
        distinct size and gathered per token, anything that depends on the size (normalised coordinates,
        RoPE scaling, resized tables, log-n scaling, folded into q per token) uses the image's own, and the
        additive mask handed to each layer ([B, heads or 1, T, T], with ``user_mask`` added) hides padding
        keys and other images' tokens. Additive tables: ``add_to_ragged``. With FlexAttention configured, a
        relative bias on integer cells attends through it instead, without a mask: a score_mod computes each
        pair's offset index from the two tokens' cells and a block mask hides padding and other images
        (``PositionContext.flex``); a mask of the caller's or fractional points keep SDPA. ``ctx.grid`` is
        the largest (H, W) in the batch.

        ``coords`` of a floating dtype are points in patch units, possibly fractional (a merged token at the
        mean of its cells): every scheme defined between grid cells is evaluated at each token's point
        (``ragged_layout``); relbias2d's integer table and peg2d's convolution refuse fractional points.
        DINOv3's coordinate augmentation (training mode) is drawn per image.

        ``separate=True``: the caller keeps the segments apart itself, attending each alone (Qwen2-VL's tower,
        frame by frame) or with a block mask of its own (Pixtral's), so no mask hiding the other segments is built
        here (a bias scheme's masks still span the row)."""
        if self.attention_kind == "query_bias":
            name = next(n for n in self.settings["pos"] if get_info(n, ndim=2).kind == "query_bias")
            raise ValueError(
                f"{name}: a query-dependent bias is built for one grid; ragged and packed batches are not supported: "
                "run each image size as a batch of its own"
            )
        layout = ragged_layout(coords, sizes, valid=valid, segments=segments, num_prefix_tokens=self.num_prefix_tokens,
                               per_image=self._draws_per_forward())  # fmt: skip
        if layout.fractional and (needs := self._needs_cells()) is not None:
            layout = layout.as_cells()
            if layout is None:
                raise ValueError(needs)
        ctx = PositionContext(self, layout.grid, coords.device, None, None, 1.0, None, None, layout)
        ctx.caller_mask = user_mask is not None
        if not self._flex_ready(ctx):  # FlexAttention: a block mask instead, the dense one only on fallback
            alone = separate or layout.one_image_per_row()
            structure = None if alone else layout.structure_mask()  # [B, 1, T, T]
            ctx.user_mask = combine_masks(structure, as_float_mask(user_mask, torch.float32))
        user = ctx.user_mask
        if self.log_n_tokens is not None:  # per token: SDPA takes one scale for the whole batch
            ratio = layout.patch_counts().log() / math.log(self.log_n_tokens)
            ctx.query_scale = ratio.clamp(min=1.0)[:, None, :, None]  # [B, 1, T, 1]
        if self.enabled and self.attention is not None and not self._flex_ready(ctx):  # (flex: no dense mask)
            if self.attention_kind == "bias" and not layout.fractional:
                if not hasattr(self._module(0), "offset_bias"):
                    raise ValueError(f"{self.settings['pos']}: a ragged batch needs a bias given per offset")
                ctx.bias_index = layout.offset_index()  # [B, T, T], shared by every layer
            if not self._per_layer:
                ctx.shared = self._combined(self._prefixed(self.attention, ctx), user)
        return ctx

    def _draws_per_forward(self) -> bool:
        """A scheme draws at random in this forward (DINOv3's coordinate augmentation, training mode): a ragged
        batch then evaluates it per image, so that each image gets a draw of its own."""
        return self.training and any(getattr(getattr(m, "augment", None), "active", False) for m in self.modules())

    def _needs_cells(self) -> str | None:
        """Why this model's positions need integer cells (a scheme not defined between them), or None."""
        schemes = {"additive": self.additive, "attention": self.attention}
        for role, module in schemes.items():
            module = module[0] if isinstance(module, nn.ModuleList) else module
            if module is None or not self.enabled or (role == "attention" and self.attention_kind == "none"):
                continue
            why = getattr(module, "cells_only", None)  # a reason of the scheme's own, or None
            if role == "attention" and self.attention_kind == "bias":
                takes = hasattr(module, "pair_bias") and why is None
            else:
                takes = "cells" in inspect.signature(module.forward).parameters
            if not takes:
                kind = "additive" if role == "additive" else self.attention_kind
                name = next(n for n in self.settings["pos"] if get_info(n, ndim=2).kind == kind)
                why = why or "its table holds one value per integer offset"
                return (
                    f"{name} is defined at integer grid cells only ({why}): "
                    "fractional coordinates are refused; round them to cells, or use a scheme defined between "
                    "cells (cpb2d, alibi2d, lookhere2d, irpe2d_bias, pape2d, the rotary schemes, sincos2d, learned2d)"
                )
        if self.conditional is not None and self.enabled:
            return (
                "peg2d convolves the tokens laid on their image's grid, where a fractional point has no cell: "
                "fractional coordinates are refused; round them to cells, or patch without peg2d"
            )
        return None

    def _subset(self, keep: torch.Tensor, grid: tuple[int, int], device: torch.device) -> torch.Tensor:
        """Kept patch indices [B, K] (or a bool mask [B, H*W], True = kept, the row holding them in grid
        order) -> the rows' token indices [B, P + K], prefix tokens first."""
        if not isinstance(keep, torch.Tensor) or keep.dim() != 2 or keep.is_floating_point() or keep.is_complex():
            got = f"{keep.dtype} tensor of shape {tuple(keep.shape)}" if isinstance(keep, torch.Tensor) else keep
            raise ValueError(
                f"keep must be an integer tensor [B, K] of patch indices or a bool mask [B, H*W] (True: kept), "
                f"got {got}"
            )
        n = grid[0] * grid[1]
        if keep.dtype == torch.bool:  # a mask, never indices 0 and 1
            keep = _kept_indices(keep, grid)
        if not torch.compiler.is_compiling() and keep.numel() and (keep.min() < 0 or keep.max() >= n):
            raise ValueError(f"keep holds patch indices outside the {grid[0]}x{grid[1]} grid (0 to {n - 1})")
        p = self.num_prefix_tokens
        prefix = torch.arange(p, device=device).expand(keep.shape[0], p)
        return torch.cat((prefix, keep.to(device) + p), dim=1)
