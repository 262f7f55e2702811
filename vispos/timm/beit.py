"""timm's BEiT and BEiT v2 (``timm.models.beit.Beit``: ``beit_*``, ``beitv2_*``) as a patched host.

BEiT's own positions are a relative position bias over the patch grid with three entries for the class
token, per layer (``use_rel_pos_bias``: ``blocks[i].attn.relative_position_bias_table``) or shared by every
layer (``use_shared_rel_pos_bias``: ``rel_pos_bias``; both at once add up), optionally with an absolute
``pos_embed`` (``use_abs_pos_emb``). Each table is [(2H-1)(2W-1) + 3, heads]: the per-offset values at
timm's ``gen_relative_position_index`` (query minus key, y first, row-major, as ``relative_index_2d``),
then class -> patch, patch -> class, class -> class, as ``prefixed_offset_index`` reads them.

With ``inherit=True`` (the default), ``patch`` keeps them: the bias becomes ``relbias2d`` (per layer, or one
shared, ``per_layer=False``) resized as BEiT resizes it (``resize="geometric"``: timm's
``resize_rel_pos_bias_table``), and ``pos_embed`` becomes ``learned2d`` beside it (bicubic with antialiasing,
as timm's ``checkpoint_filter_fn`` resamples it). Another scheme discards the bias with a
``PretrainedPositionsWarning``; ``inherit=False`` starts fresh without one.

What changes on the model: ``model.vispos`` holds the positions; ``pos_embed`` and ``rel_pos_bias`` are
removed; each ``blocks[i].attn`` becomes a ``PatchedBeitAttention`` (timm's ``qkv``, ``q_bias``, ``k_bias``
(zero, not saved), ``v_bias`` and ``proj`` adopted under their names, the table removed); the class becomes
``PatchedBeit``. BEiT's blocks pass ``shared_rel_pos_bias=`` on to their attention: the positional context
travels there (a loop of one's own calls ``block(tokens, shared_rel_pos_bias=model.vispos_context(images))``).
timm's own BEiT state dict loads into a patched model (its tables into relbias2d, resized from the
checkpoint's grid, square unless it is the model's, as timm's filter assumes).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from timm.layers import Format
from timm.models._features import feature_take_indices
from timm.models._input import update_model_input_size
from timm.models.beit import Attention as BeitAttention
from timm.models.beit import Beit
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import host
from .._validate import check_bool
from ..encodings.learned import resample_table_2d
from ..encodings.relbias import RelBias2d, resize_table
from ..host import HostShape, OwnRope, PositionsHost
from ..positions import PositionContext
from .attention import PatchedAttention, positioned_attention
from .model import (
    LOAD_ADVICE,
    adopt_timm_checkpoint,
    conditional_tokens,
    embed_tokens,
    keep_signatures,
    position_context,
    positional_groups,
    refuse_unplaced,
    token_grid,
)
from .pruning import PrunesPositions

PREFIX_ENTRIES = 3  # BEiT's class -> patch, patch -> class, class -> class, after the per-offset values


class PatchedBeitAttention(PatchedAttention):
    """timm BEiT's ``Attention`` with vispos's positions: q and v biases (k's is zero), no q/k norms; its
    relative bias table goes to ``model.vispos``. The context arrives as ``shared_rel_pos_bias``."""

    accepts = (BeitAttention,)

    def __init__(self, original: nn.Module, layer_idx: int) -> None:
        if isinstance(original, BeitAttention) and not hasattr(original, "head_dim"):  # BEiT keeps no head_dim
            original.head_dim = original.qkv.weight.shape[0] // (3 * original.num_heads)
        super().__init__(original, layer_idx)
        for name in ("relative_position_bias_table", "relative_position_index"):
            if hasattr(self, name):
                delattr(self, name)  # adopted into vispos (or discarded) by patch_beit
        self.q_norm, self.k_norm, self.norm = nn.Identity(), nn.Identity(), nn.Identity()

    def forward(self, x: torch.Tensor, shared_rel_pos_bias: object = None) -> torch.Tensor:  # type: ignore[override]
        """x [B, N, C] -> [B, N, C]; ``shared_rel_pos_bias``: the forward's ``PositionContext``."""
        return positioned_attention(self, x, shared_rel_pos_bias, False)


def after_beit_block(block: nn.Module, args: tuple, kwargs: dict[str, Any], out: torch.Tensor) -> torch.Tensor:
    """Forward hook on ``blocks[after]`` for a conditional scheme (peg2d): the block's output with the scheme
    applied at the grid of the context the block was called with (its ``shared_rel_pos_bias``)."""
    ctx = kwargs["shared_rel_pos_bias"] if "shared_rel_pos_bias" in kwargs else args[1] if len(args) > 1 else None
    return conditional_tokens(out, ctx)


class PatchedBeit(PrunesPositions, PositionsHost, Beit):
    """Beit with vispos positions: the grid read from the input, the context handed to every block."""

    def no_weight_decay(self) -> set[str]:
        own = {n for n in super().no_weight_decay() if n != "pos_embed"}  # pos_embed is gone
        return own | self.positional_no_weight_decay()

    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        return positional_groups(super().group_matcher(coarse), self.vispos)

    def vispos_grid(self, image: torch.Tensor) -> tuple[int, int]:
        """The token grid the patch embedding makes of an image batch [B, C, H, W]."""
        return token_grid(self.patch_embed, image)

    def vispos_context(self, image: torch.Tensor, attn_mask: torch.Tensor | None = None) -> PositionContext:
        """The positions of one forward pass on ``image`` [B, C, H, W], for the blocks' ``shared_rel_pos_bias``."""
        return position_context(self.vispos, token_grid(self.patch_embed, image), image, attn_mask)

    def _embedded(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, PositionContext, tuple[int, int]]:
        """Images [B, C, H, W] -> tokens [B, 1 + H*W, C] with the additive positions, the context, the grid."""
        grid = token_grid(self.patch_embed, x)  # refuses a size the patches do not divide
        tokens = self.pos_drop(embed_tokens(self.vispos, self.patch_embed(x), [self.cls_token]))
        return tokens, position_context(self.vispos, grid, tokens, attn_mask), grid

    def _block(self, blk: nn.Module, x: torch.Tensor, ctx: PositionContext) -> torch.Tensor:
        if self.grad_checkpointing and torch.is_grad_enabled():
            return checkpoint(blk, x, shared_rel_pos_bias=ctx, use_reentrant=False)
        return blk(x, shared_rel_pos_bias=ctx)

    def forward_features(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Images [B, C, H, W] -> tokens [B, 1 + H*W, C] after the blocks and the norm, at any divisible size."""
        x, ctx, _ = self._embedded(x, attn_mask)
        for blk in self.blocks:
            x = self._block(blk, x, ctx)
        return self.norm(x)

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        attn_mask: torch.Tensor | None = None,
    ) -> list[Any] | tuple[torch.Tensor, list[Any]]:
        """timm's ``Beit.forward_intermediates`` (same arguments and outputs) with vispos's positions."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        x, ctx, (h, w) = self._embedded(x, attn_mask)
        intermediates = []
        for i, blk in enumerate(self.blocks[: max_index + 1] if stop_early else self.blocks):
            x = self._block(blk, x, ctx)
            if i in take_indices:
                intermediates.append(self.norm(x) if norm else x)
        p = self.num_prefix_tokens
        prefix_tokens = [y[:, :p] for y in intermediates]
        intermediates = [y[:, p:] for y in intermediates]  # [B, H*W, C]
        if output_fmt == "NCHW":
            intermediates = [y.reshape(y.shape[0], h, w, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if return_prefix_tokens:
            intermediates = list(zip(intermediates, prefix_tokens, strict=True))
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates

    def set_input_size(
        self, img_size: int | tuple[int, int] | None = None, patch_size: int | tuple[int, int] | None = None
    ) -> None:
        """timm's ``set_input_size``: the patch embedding's size (FlexiViT resampling for a new patch size). The
        positions keep their training grid and follow any input size, so nothing of theirs is resized here."""
        self.patch_embed.set_input_size(img_size=img_size, patch_size=patch_size)
        update_model_input_size(self, self.patch_embed.img_size, patch_size=patch_size)


# torch.fx leaves (wrapped by name in the module that calls them): grid-dependent steps read sizes as numbers
for _leaf in ("positioned_attention", "token_grid", "embed_tokens", "position_context", "conditional_tokens"):
    torch.fx.wrap(_leaf)


# --- what the model's own bias is ------------------------------------------------------------------------


def own_tables(model: nn.Module, prefix: str = "") -> tuple[list[str], str]:
    """Where a BEiT state dict keeps its relative bias tables: (each block's key, the shared table's key)."""
    layers = [f"{prefix}blocks.{i}.attn.relative_position_bias_table" for i in range(len(model.blocks))]
    return layers, f"{prefix}rel_pos_bias.relative_position_bias_table"


def combined_tables(per_layer: list[torch.Tensor], shared: torch.Tensor | None) -> list[torch.Tensor]:
    """BEiT adds the shared bias to each layer's own: one table per layer when it has both, else the ones it has."""
    if per_layer and shared is not None:
        return [t + shared for t in per_layer]
    return per_layer or ([] if shared is None else [shared])


def own_bias(model: Beit) -> tuple[OwnRope, list[torch.Tensor]] | None:
    """A BEiT's relative position bias as relbias2d options, with its tables [(2H-1)(2W-1) + 3, heads] (one per
    layer, or one shared), or None when it has none."""
    per_layer = [blk.attn.relative_position_bias_table for blk in model.blocks]
    if any(t is None for t in per_layer) and any(t is not None for t in per_layer):
        raise ValueError("this BEiT has a relative position bias in some blocks only, which relbias2d cannot hold; "
                         "patch(model, ..., inherit=False) replaces it with a fresh scheme")  # fmt: skip
    shared = model.rel_pos_bias.relative_position_bias_table if model.rel_pos_bias is not None else None
    tables = combined_tables([t.detach() for t in per_layer if t is not None], shared)
    if not tables:
        return None
    h, w = model.patch_embed.grid_size
    rows = (2 * h - 1) * (2 * w - 1) + PREFIX_ENTRIES
    if tables[0].shape[0] != rows:
        raise ValueError(
            f"this BEiT's relative bias table has {tables[0].shape[0]} rows, its {h}x{w} patch grid needs {rows}: "
            "set its input size through timm (set_input_size) before patching, or patch with inherit=False"
        )
    kind = "per-layer and shared" if per_layer[0] is not None and shared is not None else (
        "per-layer" if per_layer[0] is not None else "shared")  # fmt: skip
    options = {"resize": "geometric", "per_layer": per_layer[0] is not None, "prefix_entries": True}
    source = f"timm Beit {kind} relative_position_bias_table"
    return OwnRope("relbias2d", options, source, what="relative position bias"), [t.detach() for t in tables]


def adopt_tables(attention: nn.Module | nn.ModuleList, tables: list[torch.Tensor]) -> None:
    """BEiT tables [(2H-1)(2W-1) + 3, heads] -> relbias2d's ``table`` and ``prefix_bias`` (per layer, or one)."""
    modules = list(attention) if isinstance(attention, nn.ModuleList) else [attention]
    if len(tables) > 1 and len(modules) == 1:
        raise ValueError(
            "per_layer=False shares one table, but this BEiT has one per layer: leave per_layer out to keep them, "
            "or patch with inherit=False to start a shared table fresh"
        )
    with torch.no_grad():
        for i, module in enumerate(modules):
            table = tables[i if len(tables) > 1 else 0]
            module.table.copy_(table[:-PREFIX_ENTRIES])
            if module.prefix_bias is not None:
                module.prefix_bias.copy_(table[-PREFIX_ENTRIES:])


# --- patch -----------------------------------------------------------------------------------------------


def patch_beit(
    model: nn.Module, pos: str | list[str] | tuple[str, ...], *, inherit: bool = True, **options: Any
) -> nn.Module:
    """Give a timm BEiT the positional scheme ``pos`` (as ``vispos.patch``: at most one additive, one attention
    and one conditional scheme; ``inherit`` keeps the model's relative bias and ``pos_embed``, see the module's
    docstring). In place; returns the model."""
    if not isinstance(model, Beit):
        raise TypeError(f"patch_beit takes a timm Beit (beit_*, beitv2_*), got {type(model).__name__}")
    if isinstance(model, PatchedBeit):
        raise ValueError("this BEiT is already patched by vispos; patch a fresh model instead (a patched model's "
                         "weights load into a freshly patched one with load_state_dict)")  # fmt: skip
    check_bool("inherit", inherit)
    for i, blk in enumerate(model.blocks):
        if not isinstance(getattr(blk, "attn", None), BeitAttention):
            raise TypeError(f"block {i} of this Beit has no timm BEiT Attention (got {type(blk.attn).__name__})")
    found = own_bias(model) if inherit else None
    own, tables = found if found is not None else (None, [])
    table = model.pos_embed
    schemes, per_scheme, kept = host.plan_schemes(pos, options, own=own, has_table=table is not None)
    attn0 = model.blocks[0].attn
    head_dim = attn0.qkv.weight.shape[0] // (3 * attn0.num_heads)
    shape = HostShape(model.embed_dim, attn0.num_heads, head_dim, len(model.blocks), model.num_prefix_tokens)
    grid = tuple(model.patch_embed.grid_size)
    model.vispos = host.build_positions(shape, schemes, per_scheme, grid, model.num_prefix_tokens, kept, table=table)
    if kept is not None:
        adopt_tables(model.vispos.attention, tables)
    model.vispos.train(model.training)  # a model patched in eval mode stays in it
    model.pos_embed, model.rel_pos_bias = None, None
    for i, blk in enumerate(model.blocks):
        blk.attn = PatchedBeitAttention(blk.attn, layer_idx=i)
    conditional = model.vispos.conditional
    if conditional is not None:
        model.blocks[conditional.after].register_forward_hook(after_beit_block, with_kwargs=True)
    pe = model.patch_embed
    pe.flatten, pe.output_fmt, pe.strict_img_size = False, Format.NHWC, False
    model.__class__ = PatchedBeit
    model.register_load_state_dict_pre_hook(adopt_beit_checkpoint)
    return model


# --- timm's own checkpoints ------------------------------------------------------------------------------


def checkpoint_grid(rows: int, own: tuple[int, int]) -> tuple[int, int]:
    """The grid a BEiT table of ``rows`` rows was made at: this model's when it fits, else square (timm's
    ``checkpoint_filter_fn`` assumes as much)."""
    per_offset = rows - PREFIX_ENTRIES
    if per_offset == (2 * own[0] - 1) * (2 * own[1] - 1):
        return own
    side = round(per_offset**0.5)
    if side * side != per_offset or side % 2 == 0:
        raise ValueError(f"a BEiT relative bias table of {rows} rows fits no square grid (nor this model's {own})")
    return (side + 1) // 2, (side + 1) // 2


def _resample_pos_embed(model: PatchedBeit, state_dict: dict[str, Any], key: str) -> None:
    """A checkpoint's ``pos_embed`` [1, 1 + N, C] of another (square) grid, resampled to the model's training grid
    as timm's ``checkpoint_filter_fn`` does (bicubic, antialiased; the class token's row kept)."""
    if key not in state_dict:
        return
    table = state_dict[key]
    h, w = model.vispos.train_grid
    n = table.shape[1] - model.num_prefix_tokens
    side = round(n**0.5)
    if table.dim() != 3 or n == h * w or side * side != n:
        return  # the model's grid, or no square grid: left to adopt_timm_checkpoint (which refuses what it cannot hold)
    p = model.num_prefix_tokens
    patches = resample_table_2d(table[0, p:].reshape(side, side, -1), (h, w)).reshape(1, h * w, -1)  # [1, HW, C]
    state_dict[key] = torch.cat((table[:, :p], patches), dim=1)


def adopt_beit_checkpoint(model: PatchedBeit, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """``load_state_dict`` pre-hook: a plain timm BEiT checkpoint loads into a patched one. Its relative bias
    tables become relbias2d's (per layer or shared as the model holds them, resized from the checkpoint's grid by
    relbias2d's rule) and its ``pos_embed`` learned2d's (``adopt_timm_checkpoint``); a checkpoint whose tables
    the model's scheme has no place for is refused, or with ``strict=False`` reported as unexpected."""
    if any(k.startswith(f"{prefix}vispos.") for k in state_dict):
        return  # a vispos checkpoint: Positions checks it
    _resample_pos_embed(model, state_dict, f"{prefix}pos_embed")
    adopt_timm_checkpoint(model, state_dict, prefix)  # settings records and pos_embed
    for key in [k for k in state_dict if k.endswith("relative_position_index")]:  # old checkpoints saved it
        del state_dict[key]
    layer_keys, shared_key = own_tables(model, prefix)
    keys = [k for k in (*layer_keys, shared_key) if k in state_dict]
    if not keys:
        return
    tables = combined_tables([state_dict[k] for k in layer_keys if k in state_dict], state_dict.get(shared_key))
    attention = model.vispos.attention
    modules = list(attention) if isinstance(attention, nn.ModuleList) else [attention]
    fits = (
        all(isinstance(m, RelBias2d) and m.prefix_bias is not None for m in modules)
        and len(tables) in (1, len(modules))  # a shared table fills every layer's; per-layer ones need as many
    )
    if not fits:
        refuse_unplaced(model, f"timm BEiT's relative position bias ({len(tables)} table(s))",
                        f"patch with relbias2d to keep it, {LOAD_ADVICE}")  # fmt: skip
        return  # reported by load_state_dict as unexpected keys
    for key in keys:
        del state_dict[key]
    for i, module in enumerate(modules):
        table = tables[i if len(tables) > 1 else 0]
        at = checkpoint_grid(table.shape[0], module.train_grid)
        name = f"{prefix}vispos.attention." + (f"{i}." if isinstance(attention, nn.ModuleList) else "")
        state_dict[f"{name}table"] = resize_table(table[:-PREFIX_ENTRIES], at, module.train_grid, module.resize)
        state_dict[f"{name}prefix_bias"] = table[-PREFIX_ENTRIES:]


__all__ = ["PatchedBeit", "PatchedBeitAttention", "patch_beit"]


keep_signatures(PatchedBeit, Beit)  # its forwards under timm's signatures
