"""timm's NaFlexVit (``naflexvit_*``) as a patched host: ``patch_naflex(model, "rope2d")``.

NaFlexVit takes each image at its own size and aspect ratio: pre-patchified ``patches`` [B, N, P*P*C]
with ``patch_coord`` [B, N, 2] (integer (y, x) cells) and ``patch_valid`` [B, N] (padding), as timm's
NaFlex transform and collator make them (``{"patches", "patch_coord", "patch_valid"}``). A patched model
reads those coordinates for every scheme: ``Positions.ragged_context`` gives each token the position of
its cell in its own image's grid, padding is never attended to, and each image in a batch gives what it
gives alone. Image input [B, C, H, W] runs as a batch of full grids.

Each image's grid (H, W) is the bounding box of its valid cells (timm's own rule, ``calculate_naflex_grid_sizes``),
or ``grid_sizes`` [B, 2] when given (to ``forward`` / ``forward_features``, or as the input dict's
``"grid_sizes"``): give it whenever a row holds a subset of its image's cells (MAE-style masking, tokens
kept by a selection of one's own), since normalised coordinates, resized tables, RoPE scaling and log-n read
the grid, and the kept cells' bounding box may be smaller. timm's patch dropout needs nothing: the grid is
taken before it drops tokens.

What changes on the model: ``model.vispos`` holds the positions; the embedding's own table
(``embeds.pos_embed``, learned or factorized) and the model's RoPE are removed (the additive scheme is
added per token instead); each ``blocks[i].attn`` becomes a ``PatchedAttention``; the class becomes
``PatchedNaFlexVit``. timm's patch dropout keeps working (positions follow the kept tokens).

What is inherited, as ``vispos.patch`` inherits from other timm models: the model's RoPE (axial, mixed
or DINOv3) becomes ``rope2d`` / ``rope2d_mixed`` with its conventions (``inherit=True``, the default),
and its learned table becomes ``learned2d``'s (kept beside an inherited RoPE; adopted whenever
``learned2d`` is asked for), resampled as the model resamples it: ``resample="grid_sample"`` for
``pos_embed_use_grid_sample=True``, else ``"resize"``. On full grids and on timm's collated batches the
outputs then equal timm's own model; on a batch whose tokens are not each image's row-major grid from
position 0 (patch dropout, permuted tokens), timm's RoPE and resized table place tokens by their order,
vispos by their coordinates. A factorized table (row + column tables, resized linearly by timm) is not
inherited. ``forward_intermediates`` is not supported.
"""

from __future__ import annotations

from typing import Any

import torch
from timm.models.naflexvit import NaFlexVit
from torch import nn
from torch.utils.checkpoint import checkpoint

from .._validate import check_bool
from ..host import PositionsHost
from .attention import SUPPORTED_ATTENTION
from .inherit import warn
from .model import adopt_timm_checkpoint
from .vit import build_positions, patch_attention, plan_schemes


class PatchedNaFlexVit(PositionsHost, NaFlexVit):
    """NaFlexVit with vispos positions: ``forward_features`` builds a ragged context from the coordinates."""

    def no_weight_decay(self) -> set[str]:
        own = {n for n in super().no_weight_decay() if not n.startswith("embeds.pos_embed")}
        return own | self.positional_no_weight_decay()

    def forward_features(
        self,
        patches: torch.Tensor,
        patch_coord: torch.Tensor | None = None,
        patch_valid: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        *,
        grid_sizes: torch.Tensor | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """NaFlex input (``patch_coord`` given) -> ``{"patches": [B, P + N, C], "patch_valid": [B, N]}``;
        images [B, C, H, W] -> features [B, P + H*W, C], as timm's NaFlexVit returns them. ``grid_sizes``
        [B, 2]: each image's grid (H, W), for rows that hold a subset of its cells (default: the bounding box
        of the valid cells)."""
        naflex = patch_coord is not None
        if naflex and (patch_coord.is_floating_point() or patch_coord.is_complex() or patch_coord.dtype == torch.bool):
            raise ValueError(
                "NaFlexVit's patch_coord must be integer (y, x) cells [B, N, 2] (timm's NaFlex transforms and "
                f"collator give int64), got {patch_coord.dtype}; fractional points (merged tokens) go through "
                "model.vispos.ragged_context"
            )
        if grid_sizes is not None:
            _check_grid_sizes(grid_sizes, patch_coord)
        x, grid = self.embeds(patches, patch_coord=patch_coord, patch_valid=patch_valid)  # no positions added
        b, p = x.shape[0], self.num_prefix_tokens
        if naflex:
            coords, valid = patch_coord, patch_valid
            if valid is None:
                valid = torch.ones(coords.shape[:2], dtype=torch.bool, device=x.device)
            # before dropout: the kept tokens may not span the grid
            sizes = _bounding_grids(coords, valid) if grid_sizes is None else grid_sizes.to(x.device)
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

    def forward(
        self,
        x: torch.Tensor | dict[str, torch.Tensor],
        patch_coord: torch.Tensor | None = None,
        patch_valid: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        *,
        grid_sizes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """timm's ``NaFlexVit.forward`` (images, pre-patchified NaFlex input, or the NaFlex collator's dict, whose
        entries win over the arguments), with ``grid_sizes`` [B, 2] (or the dict's ``"grid_sizes"``) passed on
        to ``forward_features``."""
        if isinstance(x, dict):
            patches, patch_coord = x["patches"], x.get("patch_coord", patch_coord)
            patch_valid, attn_mask = x.get("patch_valid", patch_valid), x.get("attn_mask", attn_mask)
            grid_sizes = x.get("grid_sizes", grid_sizes)
        elif patch_coord is None:  # images (or patches without coordinates): timm's dense path
            if grid_sizes is not None:
                _check_grid_sizes(grid_sizes, None)
            return self.forward_head(self.forward_features(x))
        else:
            patches = x
        if patch_coord is None or patch_valid is None:
            raise ValueError("NaFlex input needs patch_coord [B, N, 2] and patch_valid [B, N], as timm's collator "
                             "gives them")  # fmt: skip
        features = self.forward_features(patches, patch_coord, patch_valid, attn_mask, grid_sizes=grid_sizes)
        return self.forward_head(**features)

    def forward_intermediates(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "forward_intermediates of a vispos-patched NaFlexVit is not supported yet; use forward_features"
        )


def _check_grid_sizes(grid_sizes: object, patch_coord: torch.Tensor | None) -> None:
    """``grid_sizes`` must be an integer tensor [B, 2] of positive (H, W), beside NaFlex ``patch_coord``."""
    if patch_coord is None:
        raise ValueError("grid_sizes gives each image's grid in a NaFlex batch (patches with patch_coord); images "
                         "[B, C, H, W] carry their own grid")  # fmt: skip
    b = patch_coord.shape[0]
    if (
        not isinstance(grid_sizes, torch.Tensor)
        or tuple(grid_sizes.shape) != (b, 2)
        or grid_sizes.is_floating_point()
        or grid_sizes.is_complex()
        or grid_sizes.dtype == torch.bool
    ):
        is_tensor = isinstance(grid_sizes, torch.Tensor)
        got = f"{grid_sizes.dtype} tensor {list(grid_sizes.shape)}" if is_tensor else repr(grid_sizes)
        raise ValueError(f"grid_sizes must be an integer tensor [B, 2] = [{b}, 2] of each image's grid (H, W), "
                         f"got {got}")  # fmt: skip
    if not torch.compiler.is_compiling() and bool((grid_sizes < 1).any()):
        raise ValueError(f"grid_sizes must be positive (H, W), got {grid_sizes.tolist()}")


def _bounding_grids(coords: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, 2]: each sample's grid, the bounding box of its valid cells (timm's rule: largest y, x + 1)."""
    return torch.where(valid[..., None], coords, 0).amax(dim=1) + 1


def patch_naflex(
    model: nn.Module, pos: str | list[str] | tuple[str, ...], *, inherit: bool = True, **options: Any
) -> nn.Module:
    """Give a timm NaFlexVit the positional scheme ``pos`` (as ``vispos.patch``: at most one additive, one
    attention and one conditional scheme; options go to the scheme that accepts them; ``inherit`` keeps
    the model's RoPE and learned table, see the module's docstring). In place; returns the model."""
    if not isinstance(model, NaFlexVit):
        raise TypeError(f"patch_naflex takes a timm NaFlexVit (naflexvit_*), got {type(model).__name__}")
    if isinstance(model, PatchedNaFlexVit):
        raise ValueError("this NaFlexVit is already patched by vispos; patch a fresh model instead")
    check_bool("inherit", inherit)
    for i, blk in enumerate(model.blocks):
        if not isinstance(getattr(blk, "attn", None), SUPPORTED_ATTENTION):
            names = ", ".join(c.__name__ for c in SUPPORTED_ATTENTION)
            raise TypeError(f"block {i} has no attention of a supported type ({names})")
    embeds = model.embeds
    table = _own_table(embeds)
    schemes, per_scheme, kept = plan_schemes(model, pos, options, inherit=inherit, table=table)
    if inherit and table is not None and "learned2d" in per_scheme:
        per_scheme["learned2d"] = _own_resampling(embeds, per_scheme["learned2d"])
    if inherit and embeds.pos_embed_type == "factorized" and "learned2d" in per_scheme:
        warn("this NaFlexVit's factorized table (row + column, resized linearly) is not inherited: learned2d "
             "starts fresh. inherit=False starts fresh without this warning")  # fmt: skip
    grid = tuple(embeds.pos_embed_grid_size)
    model.vispos = build_positions(model, schemes, per_scheme, grid, table_prefix=0, kept=kept, table=table)
    model.vispos.train(model.training)  # a model patched in eval mode stays in it
    for name in ("pos_embed", "pos_embed_y", "pos_embed_x"):
        if getattr(embeds, name, None) is not None:
            setattr(embeds, name, None)
    embeds.pos_embed_type = "none"
    model.rope, model.rope_is_mixed = None, False
    patch_attention(model)
    model.__class__ = PatchedNaFlexVit
    model.register_load_state_dict_pre_hook(adopt_timm_checkpoint)
    return model


def _own_table(embeds: nn.Module) -> torch.Tensor | None:
    """The embedding's learned table [1, H, W, C] as timm ViT's [1, H*W, C], or None (none, factorized)."""
    if embeds.pos_embed_type != "learned" or embeds.pos_embed is None:
        return None
    return embeds.pos_embed.flatten(1, 2)


def _own_resampling(embeds: nn.Module, chosen: dict[str, Any]) -> dict[str, Any]:
    """learned2d's options with the model's resampling (the user's ``resample`` wins, said if it differs).
    A resampling learned2d cannot reproduce is said too: the outputs stay timm's on the training grid only."""
    own = "grid_sample" if embeds.pos_embed_use_grid_sample else "resize"
    if chosen.get("resample", own) != own:
        warn(f"you set resample={chosen['resample']!r}, but this NaFlexVit resamples its table with {own!r}; "
             "its outputs will change off the training grid")  # fmt: skip
    differs = {
        "pos_embed_interp_mode": (embeds.pos_embed_interp_mode, "bicubic"),
        "pos_embed_ar_preserving": (embeds.pos_embed_ar_preserving, False),
        "pos_embed_align_corners": (embeds.pos_embed_align_corners, False),
    }
    if own == "resize":
        differs["pos_embed_antialias"] = (embeds.pos_embed_antialias, True)
    unlike = [f"{k}={v!r}" for k, (v, expected) in differs.items() if v != expected]
    if unlike:
        warn(f"this NaFlexVit resamples its learned table with {', '.join(unlike)}, which learned2d does not "
             "reproduce: the table is inherited, but off the training grid it is resampled as learned2d's "
             f"resample={own!r} does")  # fmt: skip
    return {"resample": own} | chosen
