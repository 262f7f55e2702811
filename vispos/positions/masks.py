"""Each layer's share of the context: the attention scheme's rotation or additive bias mask (prefix tokens
included, gathered for a token subset or per token of a ragged batch), or its bias as FlexAttention takes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import FlexBias, combine_masks, offset_score_mod
from ..encodings.relbias import bias_mask, prefixed_offset_index, with_prefix_entries
from ..encodings.rope import Rotary
from ..ragged_apply import QueryScaled, concat_rotations
from .context import PositionContext


class LayerOutputs:
    """What ``PositionContext.layer`` and ``PositionContext.flex`` return (a mixin of ``Positions``)."""

    @property
    def attention_backend(self) -> str:
        """``"sdpa"`` (default) or ``"flex"`` (relative biases through FlexAttention), as ``configure`` set it."""
        return self.settings.get("attention", "sdpa")

    def _prefixed(
        self, module: nn.Module, ctx: PositionContext, dtype: torch.dtype | None = None
    ) -> Rotary | torch.Tensor:
        """One scheme module's output for all tokens, prefix tokens first: rotations with identity rows for
        them, or a bias mask [1, heads, P + HW, P + HW] (4-D: SDPA's fused CPU kernel refuses 3-D masks).
        A bias with per-offset values is gathered straight into the mask (``bias_mask``), so building it
        holds little more than the mask itself. A token subset (``ctx.tokens`` [B, M]) takes its rows:
        rotations [B, heads or 1, M, d], masks [B, heads, M, M], gathered without the full mask. ``dtype``: the
        attention's (``PositionContext.layer``), where the per-offset values may be cast before the gather."""
        grid, device, tokens = ctx.grid, ctx.device, ctx.tokens
        if ctx.ragged is not None:
            return self._gathered(module, ctx)
        if self.attention_kind in ("rotary", "query_bias", "channels"):  # awaiting the queries (or the inputs)
            out = module(grid, device).with_prefix(self.num_prefix_tokens)
            return out if tokens is None else out.take(tokens)
        if ctx.bias_index is not None:  # [P + HW, P + HW], or the subset's [B, M, M]
            values, entries = module(grid, device, per_offset=True)  # [heads, 2H-1, 2W-1], [3, heads] or None
            if dtype is not None and ctx.user_mask is None and not (torch.is_grad_enabled() and values.requires_grad):
                values = values.to(dtype)  # a cast commutes with the gather: one pass over the mask, not two
            mask = bias_mask(values, entries, ctx.bias_index)
            return mask[None] if tokens is None else mask.transpose(0, 1)
        if hasattr(module, "offset_bias"):  # no shared index (FlexAttention set, SDPA run): read through the call
            index = prefixed_offset_index(grid, self.num_prefix_tokens, device)
            mask = bias_mask(*module(grid, device, per_offset=True), index)  # [heads, P + HW, P + HW]
        else:
            mask = self._with_prefix(module(grid, device), module)  # [heads, P + HW, P + HW]
        if tokens is None:
            return mask[None]
        return mask[:, tokens[:, :, None], tokens[:, None, :]].transpose(0, 1)  # [B, heads, M, M]

    def _gathered(self, module: nn.Module, ctx: PositionContext) -> Rotary | torch.Tensor:
        """A ragged batch: the module at each distinct grid size, gathered per token: rotations [B, heads or 1,
        T, d] from one table of every size's rows, bias masks [B, heads, T, T] from one table of every size's
        per-offset values (``ctx.bias_index``)."""
        layout, p = ctx.ragged, self.num_prefix_tokens
        if self.attention_kind == "channels":  # each token's own point: its image's grid, prefix tokens at (0, 0)
            return module.ragged(layout.yx, layout.hw, layout.prefix)
        if layout.fractional:  # at each token's point (``RaggedLayout.points``), not at every cell
            if self.attention_kind == "rotary":
                rows = [
                    module(size, ctx.device, cells=layout.yx[here]).with_prefix(p)
                    for size, here in zip(layout.sizes, layout.points(), strict=True)
                ]
                return concat_rotations(rows).take(layout.point_index(p))
            return layout.pair_mask(*module(offsets=layout.offsets()))  # (bias [heads, B, T, T], prefix entries)
        if self.attention_kind == "rotary":
            rows = [module(size, ctx.device).with_prefix(p) for size in layout.sizes]
            return concat_rotations(rows).take(layout.table_index(p))
        if ctx.bias_index is None:  # FlexAttention was set, but this layer runs SDPA (CPU training)
            ctx.bias_index = layout.offset_index()
        return bias_mask(*self._size_offsets(module, ctx), ctx.bias_index).transpose(0, 1)

    @staticmethod
    def _size_offsets(module: nn.Module, ctx: PositionContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A ragged batch's per-offset bias values [heads, sum over sizes of (2H-1)(2W-1)], sizes in turn, and the
        scheme's prefix entries [3, heads] (or None), each read through the module's call."""
        per_size = [module(size, ctx.device, per_offset=True) for size in ctx.ragged.sizes]
        return torch.cat([values.flatten(1) for values, _ in per_size], dim=1), per_size[0][1]

    def _with_prefix(self, bias: torch.Tensor, module: nn.Module) -> torch.Tensor:
        """Patch bias [heads, HW, HW] -> [heads, P + HW, P + HW], for a bias scheme without ``offset_bias``.
        Prefix rows and columns take the scheme's ``prefix_bias`` [3, heads] or zero."""
        p = self.num_prefix_tokens
        entries = getattr(module, "prefix_bias", None)
        if entries is None:
            return F.pad(bias, (p, 0, p, 0))
        heads, n, _ = bias.shape
        to_patch, from_patch, among = (e.to(bias.dtype)[:, None, None] for e in entries)  # [heads, 1, 1] each
        top = torch.cat((among.expand(heads, p, p), to_patch.expand(heads, p, n)), dim=-1)  # [heads, P, P + HW]
        bottom = torch.cat((from_patch.expand(heads, n, p), bias), dim=-1)  # [heads, HW, P + HW]
        return torch.cat((top, bottom), dim=-2)

    def _bias_index(self, grid: tuple[int, int], device: torch.device) -> torch.Tensor | None:
        """The gather index of the bias masks, built once per forward and shared by every layer."""
        if self.attention_kind != "bias" or not hasattr(self._module(0), "offset_bias"):
            return None
        return prefixed_offset_index(grid, self.num_prefix_tokens, device)

    @property
    def _per_layer(self) -> bool:
        return isinstance(self.attention, nn.ModuleList)

    def _module(self, index: int) -> nn.Module:
        return self.attention[index] if self._per_layer else self.attention

    def layer(
        self, ctx: PositionContext, index: int, dtype: torch.dtype | None = None, inputs: torch.Tensor | None = None
    ) -> tuple[Rotary | QueryScaled | None, torch.Tensor | None]:
        """Layer ``index``'s rotation and additive mask (prefix tokens included); with a per-token logit scale
        (``ctx.query_scale``), the rotation is a ``QueryScaled`` that also scales q. ``dtype``: q's, where the
        caller knows it (``PositionContext.layer``); ``inputs``: the attention's input, which channels take."""
        rotary, mask = self._layer(ctx, index, dtype)
        if self.attention_kind == "channels" and rotary is not None:
            rotary = rotary.bind(inputs, ctx.logit_scale if ctx.query_scale is None else ctx.query_scale)
        return (rotary, mask) if ctx.query_scale is None else (QueryScaled(rotary, ctx.query_scale), mask)

    def _stacked(self, ctx: PositionContext) -> Rotary | None:
        """Every layer's rotation of a per-layer scheme that evaluates its layers in one go (``stacked``:
        RoPE-Mixed), prefix rows included; None where the scheme has no such form or declines this grid."""
        stack = getattr(type(self._module(0)), "stacked", None)
        if self.attention_kind != "rotary" or stack is None:
            return None
        rotation = stack(list(self.attention), ctx.grid, ctx.device)
        return None if rotation is None else rotation.with_prefix(self.num_prefix_tokens)

    def _layer(
        self, ctx: PositionContext, index: int, dtype: torch.dtype | None = None
    ) -> tuple[Rotary | None, torch.Tensor | None]:
        if ctx.ragged is not None and ctx.user_mask is None and self._flex_ready(ctx):
            if not ctx.ragged.one_image_per_row():  # set for FlexAttention, run through SDPA: its mask, once
                ctx.user_mask = ctx.ragged.structure_mask()
        if not self.enabled or self.attention is None:
            return None, ctx.user_mask
        if ctx.shared is not None:
            out = self._shared_as(ctx, dtype)
        elif ctx.stacked_layers is not None:
            out = ctx.stacked_layers[index]
            out = out if ctx.tokens is None else out.take(ctx.tokens)
        else:
            out = self._combined(self._prefixed(self._module(index), ctx, dtype), ctx.user_mask)
        return (out, ctx.user_mask) if self.attention_kind in ("rotary", "channels") else (None, out)

    @staticmethod
    def _shared_as(ctx: PositionContext, dtype: torch.dtype | None) -> Rotary | torch.Tensor:
        """The shared output; a bias mask that needs no gradient in ``dtype``, cast once per forward rather than
        by SDPA in every layer (a mask with a gradient keeps one cast per layer: its gradients sum in fp32)."""
        out = ctx.shared
        if dtype is None or not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return out
        if out.dtype == dtype or (torch.is_grad_enabled() and out.requires_grad):
            return out
        if ctx.shared_cast is None or ctx.shared_cast.dtype != dtype:
            ctx.shared_cast = out.to(dtype)
        return ctx.shared_cast

    def _flex_ready(self, ctx: PositionContext) -> bool:
        """FlexAttention is on and applies: an enabled relative bias on the whole grid or on a ragged batch of
        cells, no mask from the caller."""
        on = self.attention_backend == "flex" and self.enabled and self.attention_kind == "bias"
        if ctx.ragged is not None:
            return on and not ctx.caller_mask and not ctx.ragged.fractional
        return on and ctx.user_mask is None and ctx.tokens is None

    def flex(self, ctx: PositionContext, index: int) -> FlexBias | None:
        """Layer ``index``'s bias for FlexAttention (``PositionContext.flex``); None when SDPA is used."""
        if not self._flex_ready(ctx):
            return None
        module, layout = self._module(index), ctx.ragged
        if layout is None:
            values = with_prefix_entries(*module(ctx.grid, ctx.device, per_offset=True))
            if ctx.grid_tensor is None:  # one host-to-device copy per forward, not per layer
                ctx.grid_tensor = torch.tensor(ctx.grid, device=ctx.device)
            return FlexBias(offset_score_mod(values, ctx.grid_tensor, self.num_prefix_tokens), sized=((values, 1),))
        values = with_prefix_entries(*self._size_offsets(module, ctx))
        score_mod, sized = layout.flex_score_mod(values)  # padding and other images hidden by the score_mod
        return FlexBias(score_mod, None, sized)

    def _combined(self, out: Rotary | torch.Tensor, user: torch.Tensor | None) -> Rotary | torch.Tensor:
        """A bias mask plus the caller's mask (a rotation is returned as it is)."""
        if self.attention_kind == "query_bias":
            return out.plus(user)
        return out if self.attention_kind in ("rotary", "channels") else combine_masks(out, user)
