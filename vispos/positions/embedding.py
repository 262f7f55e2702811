"""The token side of ``Positions``: additive tables added to patch and prefix tokens (one grid, a subset or
a ragged batch), ``embed`` as the start of a loop of one's own over the blocks, and the conditional scheme."""

from __future__ import annotations

import torch

from .._validate import check_grid
from ..ragged_apply import ragged_conditional
from .context import PositionContext


class Embedding:
    """``Positions.embed`` and the additive and conditional schemes applied to tokens (a mixin of
    ``Positions``)."""

    def add_to_patches(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """x [B, H*W, C] (patch tokens only) + the additive table, if any."""
        if self.additive is None or not self.enabled:
            return x
        return x + self.additive(grid, x.device).to(x.dtype)

    def embed(
        self,
        x: torch.Tensor,
        grid: tuple[int, int] | None = None,
        *,
        keep: torch.Tensor | None = None,
        coords: torch.Tensor | None = None,
        sizes: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
        prefix: torch.Tensor | None = None,
        user_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, PositionContext]:
        """Patch tokens -> (rows [B, P + N, C] with every position they carry, the context each block takes as
        ``attn_mask``): the start of a loop of one's own over the blocks. The blocks apply the attention
        schemes; an additive table (learned2d, sincos2d) is added here, to each token at its own cell.

        One grid (``grid`` = (H, W), as ``context``): x [B, H*W, C] row-major, or [B, K, C] holding the cells
        ``keep`` [B, K]. A ragged or packed batch (``coords`` [B, N, 2], with ``sizes``, ``valid``, ``segments``
        as ``ragged_context`` takes them): x [B, N, C]. ``prefix`` [B or 1, P, C]: the model's P prefix tokens
        (class token, registers), put first with the additive scheme's prefix rows; required when P > 0."""
        if (grid is None) == (coords is None):
            raise ValueError(
                "embed takes grid= (one grid, optionally with keep=) or coords= (a ragged batch), exactly one of them"
            )
        if coords is None and any(v is not None for v in (sizes, valid, segments)):
            raise ValueError("sizes, valid and segments describe a ragged batch: pass them with coords=, not grid=")
        if coords is not None and keep is not None:
            raise ValueError("keep selects cells of one grid (grid=); a ragged batch lists its cells in coords=")
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"embed takes patch tokens x [B, N, C], got {got}")
        p, given = self.num_prefix_tokens, None if prefix is None else tuple(prefix.shape)
        if (p or prefix is not None) and (given is None or len(given) != 3 or given[1] != p):
            raise ValueError(
                f"this model has {p} prefix token(s) (class token, registers): pass them as "
                f"prefix=[B or 1, {p}, C]" + ("" if p else ", or no prefix") + f", got {given}"
            )
        if coords is None:
            grid = check_grid(grid, "grid")
            ctx = self.context(grid, x.device, user_mask, keep)  # (checks keep: indices or a bool mask)
            kept = None if ctx.tokens is None else ctx.tokens[:, p:] - p  # [B, K]: the rows' patch indices
            n = grid[0] * grid[1] if kept is None else kept.shape[1]
            if x.shape[1] != n:
                if kept is None:
                    held = "the H*W cells of the grid"
                elif keep.dtype == torch.bool:
                    held = "one token per kept cell (keep, a bool mask [B, H*W]: its True cells per row)"
                else:
                    held = "one token per kept cell (keep [B, K])"
                raise ValueError(f"x holds {x.shape[1]} tokens per row; {held} is {n}")
            if self.additive is not None and self.enabled:
                table = self.additive(grid, x.device).to(x.dtype)  # [H*W, C]
                x = x + (table if kept is None else table[kept])  # [B, N, C]
        else:
            ctx = self.ragged_context(coords, sizes, valid=valid, segments=segments, user_mask=user_mask)
            if x.shape[:2] != coords.shape[:2]:
                raise ValueError(
                    f"x [B, N, C] has {tuple(x.shape[:2])} rows and tokens; coords [B, N, 2] "
                    f"{tuple(coords.shape[:2])}: one cell per token"
                )
            x = self.add_to_ragged(x, ctx)
        if prefix is None:
            return x, ctx
        return torch.cat((self.add_to_prefix(prefix.to(x.dtype).expand(x.shape[0], -1, -1)), x), dim=1), ctx

    def apply_conditional(self, x: torch.Tensor, ctx: PositionContext) -> torch.Tensor:
        """Tokens [B, P + H*W, C] (or the row's subset, ``ctx.tokens``) after block ``conditional.after``
        -> the conditional scheme's output at the context's grid (unchanged when there is none, or disabled)."""
        if self.conditional is None or not self.enabled:
            return x
        if ctx.ragged is not None:  # each image on its own grid
            return ragged_conditional(self.conditional, x, ctx.ragged)
        return self.conditional(x, ctx.grid, self.num_prefix_tokens, ctx.tokens)

    def add_to_ragged(self, x: torch.Tensor, ctx: PositionContext) -> torch.Tensor:
        """Patch tokens x [B, N, C] of a ragged batch (``ragged_context``) + the additive table of each
        token's own image size at its cell; padding is left unchanged."""
        if self.additive is None or not self.enabled:
            return x
        layout, p = ctx.ragged, self.num_prefix_tokens
        if layout.fractional:  # the table at each token's point
            points = zip(layout.sizes, layout.points(), strict=True)
            table = torch.cat([self.additive(size, x.device, cells=layout.yx[here]) for size, here in points])
            index = layout.point_index(0)[:, p:]
        else:
            table = torch.cat([self.additive(size, x.device) for size in layout.sizes])  # [sum HW, C]
            index = layout.table_index(0)[:, p:]  # [B, N]
        table, valid = table.to(x.dtype), layout.valid[:, p:, None]  # [B, N, 1]
        return torch.where(valid, x + table[index], x)

    def add_to_prefix(self, tokens: torch.Tensor) -> torch.Tensor:
        """Prefix tokens [B, P, C] + the additive scheme's prefix rows (``prefix`` [P, C]), if it has them."""
        if getattr(self.additive, "prefix", None) is None or not self.enabled:
            return tokens
        return tokens + self.additive(None, prefix=True).to(tokens.dtype)
