"""The positional context of one forward pass: what every layer's attention takes (``PositionContext``),
built by ``Positions.context`` (one grid, a token subset) or ``Positions.ragged_context`` (a ragged batch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..attention import FlexBias
from ..encodings.rope import Rotary
from ..ragged import RaggedLayout
from ..ragged_apply import QueryScaled


@dataclass
class PositionContext:
    """The positions of one forward pass at one grid; ``layer(i)`` gives layer i's rotation and mask."""

    positions: nn.Module  # the Positions that built it (.module imports this module, not the other way)
    grid: tuple[int, int]
    device: torch.device
    user_mask: torch.Tensor | None  # the caller's attn_mask, as an additive float mask
    shared: Rotary | torch.Tensor | None  # the output of a scheme shared by every layer, computed once
    logit_scale: float = 1.0  # extra temperature on every logit (log-n attention scaling)
    bias_index: torch.Tensor | None = None  # where each token pair reads its bias (bias schemes), int32
    tokens: torch.Tensor | None = None  # [B, M]: which of the P + HW tokens each row holds (a subset), or all
    ragged: RaggedLayout | None = None  # per-token images, cells and grid sizes (``Positions.ragged_context``)
    query_scale: torch.Tensor | None = None  # [B, 1, T, 1]: per-token logit scale (log-n, ragged batches)
    caller_mask: bool = False  # the caller gave a mask of its own (a ragged context keeps FlexAttention off)
    grid_tensor: torch.Tensor | None = None  # (H, W) on the device, for FlexAttention's score_mod: made once
    stacked: Rotary | None = None  # a per-layer rotation evaluated for every layer at once, [layers, ...]
    stacked_layers: list[Rotary] | None = None  # ``stacked`` taken apart per layer (``Rotary.layers``), with it
    shared_cast: torch.Tensor | None = None  # ``shared`` (a bias mask) in the attention's dtype, cast once

    def layer(
        self, index: int, dtype: torch.dtype | None = None, inputs: torch.Tensor | None = None
    ) -> tuple[Rotary | QueryScaled | None, torch.Tensor | None]:
        """(rotation: cos/sin [(heads,) N, d] or None, additive mask [1, heads, N, N] or the caller's mask; a
        query-dependent bias comes as a ``QueryBias`` in the mask's place, ``query_mask`` gives its mask).
        For a token subset (``tokens``) or a ragged batch (``ragged``), rotations [B, heads or 1, M, d] and
        masks [B, heads or 1, M, M]; a per-token logit scale comes as a ``QueryScaled`` rotation.
        ``dtype``: q's, where the caller knows it (bf16 under autocast): a bias mask that needs no gradient is
        then made in it (gathered from values cast first; a shared mask cast once per forward), so that SDPA's
        cast to q's dtype is not one more pass over every mask. The same values as casting the fp32 mask.
        ``inputs`` [B, N, C]: the attention's input, which a scheme of channels computes from (pape2d: its
        ``ParabolaChannels`` comes in the rotation's place, ``rotate(q, k)`` appends them)."""
        return self.positions.layer(self, index, dtype, inputs)

    def flex(self, index: int) -> FlexBias | None:
        """Layer ``index``'s relative bias as FlexAttention takes it (a score_mod reading the bias per offset,
        a block mask for ragged batches) when it attends through FlexAttention (``vispos.configure(model,
        attention="flex")``); None when it uses SDPA."""
        return self.positions.flex(self, index)

    def check_tokens(self, x: torch.Tensor) -> None:
        """Refuse tokens x [B, T, C] this context was not built for: another number of tokens per row, or
        (a ragged batch, a token subset: built per row) another number of rows."""
        p = self.positions.num_prefix_tokens
        if self.ragged is not None:
            rows, count = self.ragged.image.shape
        elif self.tokens is not None:
            rows, count = self.tokens.shape
        else:
            rows, count = None, p + self.grid[0] * self.grid[1]
        b, t = x.shape[0], x.shape[1]
        if t != count or (rows is not None and b != rows):
            # formatted only here: under torch.compile a size formatted into a string is specialised (a recompile
            # at every new size with dynamic=True)
            if self.ragged is not None:
                built = f"a ragged batch of {rows} row(s) of {count} tokens"
            elif self.tokens is not None:
                built = f"a token subset of {rows} row(s) of {count} tokens ({p} prefix + {count - p} kept)"
            else:
                built = f"{count} tokens ({p} prefix + a {self.grid[0]}x{self.grid[1]} grid)"
            raise ValueError(
                f"the positional context was built for {built}, the attention got {b} row(s) of {t} tokens: build "
                "the context for the tokens the blocks see (the grid, keep= or the ragged batch of these rows)"
            )
