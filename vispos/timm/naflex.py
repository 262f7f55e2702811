"""timm's NaFlexVit (``naflexvit_*``) as a patched host: ``patch_naflex(model, "rope2d")``.

NaFlexVit takes each image at its own size and aspect ratio: pre-patchified ``patches`` [B, N, P*P*C]
with ``patch_coord`` [B, N, 2] (integer (y, x) cells) and ``patch_valid`` [B, N] (padding), as timm's
NaFlex transform and collator make them (``{"patches", "patch_coord", "patch_valid"}``). A patched model
reads those coordinates for every scheme: ``Positions.ragged_context`` gives each token the position of
its cell in its own image's grid (the grid: the bounding box of the image's valid cells, timm's own
rule), padding is never attended to, and each image in a batch gives what it gives alone. Image input
[B, C, H, W] runs as a batch of full grids.

What changes on the model: ``model.vispos`` holds the positions; the embedding's own table
(``embeds.pos_embed``, learned or factorized) and the model's RoPE are removed (the additive scheme is
added per token instead); each ``blocks[i].attn`` becomes a ``PatchedAttention``; the class becomes
``PatchedNaFlexVit``. timm's patch dropout keeps working (positions follow the kept tokens). Not
supported yet: inheriting the model's own RoPE or learned table (patch with fresh positions, load the
rest of a checkpoint with ``strict=False``), ``forward_intermediates``.
"""

from __future__ import annotations

from typing import Any

import torch
from timm.models.naflexvit import NaFlexVit
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..positions import Positions
from ..registry import split_options
from .attention import SUPPORTED_ATTENTION
from .patching import _resolve_schemes, build_positions, patch_attention


class PatchedNaFlexVit(NaFlexVit):
    """NaFlexVit with vispos positions: ``forward_features`` builds a ragged context from the coordinates."""

    vispos: Positions

    @property
    def vispos_cfg(self) -> dict[str, Any]:
        return self.vispos.settings

    def no_weight_decay(self) -> set[str]:
        own = {n for n in super().no_weight_decay() if not n.startswith("embeds.pos_embed")}
        return own | {f"vispos.{name}" for name, _ in self.vispos.named_parameters()}

    def forward_features(
        self,
        patches: torch.Tensor,
        patch_coord: torch.Tensor | None = None,
        patch_valid: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """NaFlex input (``patch_coord`` given) -> ``{"patches": [B, P + N, C], "patch_valid": [B, N]}``;
        images [B, C, H, W] -> features [B, P + H*W, C], as timm's NaFlexVit returns them."""
        naflex = patch_coord is not None
        x, grid = self.embeds(patches, patch_coord=patch_coord, patch_valid=patch_valid)  # no positions added
        b, p = x.shape[0], self.num_prefix_tokens
        if naflex:
            coords, valid = patch_coord, patch_valid
            if valid is None:
                valid = torch.ones(coords.shape[:2], dtype=torch.bool, device=x.device)
            sizes = _bounding_grids(coords, valid)  # before dropout: the kept tokens may not span the grid
        else:
            h, w = grid
            cells = torch.cartesian_prod(torch.arange(h, device=x.device), torch.arange(w, device=x.device))
            coords, valid = cells.expand(b, -1, -1), None
            sizes = torch.tensor([h, w], device=x.device).expand(b, 2)
        if self.training and self.patch_drop is not None:
            x, keep = self.patch_drop(x)
            coords = coords.gather(1, keep[..., None].expand(-1, -1, 2))
            valid = None if valid is None else valid.gather(1, keep)
            patch_valid = valid
        ctx = self.vispos.ragged_context(coords, sizes, valid=valid, user_mask=attn_mask)
        x = torch.cat((self.vispos.add_to_prefix(x[:, :p]), self.vispos.add_to_ragged(x[:, p:], ctx)), dim=1)
        x = self.norm_pre(x)
        for blk in self.blocks:
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = checkpoint(blk, x, attn_mask=ctx, use_reentrant=False)
            else:
                x = blk(x, attn_mask=ctx)
        x = self.norm(x)
        return {"patches": x, "patch_valid": patch_valid} if naflex else x

    def forward_intermediates(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "forward_intermediates of a vispos-patched NaFlexVit is not supported yet; use forward_features"
        )


def _bounding_grids(coords: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, 2]: each sample's grid, the bounding box of its valid cells (timm's rule: largest y, x + 1)."""
    return torch.where(valid[..., None], coords, 0).amax(dim=1) + 1


def patch_naflex(model: nn.Module, pos: str | list[str] | tuple[str, ...], **options: Any) -> nn.Module:
    """Give a timm NaFlexVit the positional scheme ``pos`` (as ``vispos.patch``: at most one additive, one
    attention and one conditional scheme; options go to the scheme that accepts them). In place; returns
    the model. Its own table and RoPE are replaced, not inherited (``inherit=False`` in ``vispos.patch``'s
    terms)."""
    if not isinstance(model, NaFlexVit):
        raise TypeError(f"patch_naflex takes a timm NaFlexVit (naflexvit_*), got {type(model).__name__}")
    if isinstance(model, PatchedNaFlexVit):
        raise ValueError("this NaFlexVit is already patched by vispos; patch a fresh model instead")
    for i, blk in enumerate(model.blocks):
        if not isinstance(getattr(blk, "attn", None), SUPPORTED_ATTENTION):
            names = ", ".join(c.__name__ for c in SUPPORTED_ATTENTION)
            raise TypeError(f"block {i} has no attention of a supported type ({names})")
    additive, attention, conditional = _resolve_schemes(pos)
    used = [i for i in (additive, attention, conditional) if i is not None]
    per_scheme = dict(zip([i.name for i in used], split_options(used, options), strict=True))
    embeds = model.embeds
    model.vispos = build_positions(
        model, (additive, attention, conditional), per_scheme, tuple(embeds.pos_embed_grid_size), table_prefix=0
    )
    for name in ("pos_embed", "pos_embed_y", "pos_embed_x"):
        if getattr(embeds, name, None) is not None:
            setattr(embeds, name, None)
    embeds.pos_embed_type = "none"
    model.rope, model.rope_is_mixed = None, False
    patch_attention(model)
    model.__class__ = PatchedNaFlexVit
    return model
