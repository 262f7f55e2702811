"""timm's SAM image encoder (``timm.models.vision_transformer_sam.VisionTransformerSAM``: ``samvit_*``) as a
patched host.

SAM keeps its tokens as NHWC grids [B, H, W, C] throughout, with no prefix token. Blocks with
``window_size > 0`` attend inside non-overlapping windows (the grid padded with zero tokens to a multiple of
the window, the padding attended to as SAM does); the blocks of ``global_attn_indexes`` attend over the whole
grid. Its own positions: an absolute ``pos_embed`` [1, H, W, C] (``use_abs_pos``; resized bicubically with
antialiasing at other sizes, ``resample_abs_pos_embed_nhwc``) and, with ``use_rel_pos``, each block's
decomposed relative tables ``attn.rel_pos_h`` / ``attn.rel_pos_w`` (of the window's size in window blocks, of
the grid in global ones; interpolated linearly at other sizes).

With ``inherit=True`` (the default) ``patch`` keeps them: the tables become ``decomposed2d`` per layer
(each layer's training grid its window, or the grid) and ``pos_embed`` becomes ``learned2d``, so the outputs
stay the same, at any input size. Another scheme discards them with a ``PretrainedPositionsWarning``;
``inherit=False`` starts fresh without one. SAM's RoPE (``use_rope``) is not inherited: such a model is
refused unless ``inherit=False``.

Every 2D scheme runs on both kinds of block: per forward the model builds two ``PositionContext``s
(``SamPositions``), one at the whole grid for the global blocks and one at the window grid, shared by every
window, for the window blocks, so attention schemes see window-local coordinates there. Additive schemes
are added to the tokens at the whole grid; a conditional scheme (peg2d) transforms the grid after its block.

What changes on the model: ``model.vispos`` holds the positions; ``pos_embed``, ``rope_global`` and
``rope_window`` become None; each block's class becomes ``PatchedSamBlock`` (its forward takes the
``SamPositions``: ``block(x, model.vispos_context(images))`` in a loop of one's own) and its ``attn`` a
``PatchedSamAttention`` (timm's ``qkv``, ``q_norm``, ``k_norm`` and ``proj`` adopted under their names, the
tables removed); the class becomes ``PatchedSam``. timm's own SAM state dict loads into a patched model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from timm.models._features import feature_take_indices
from timm.models.vision_transformer_sam import Attention as SamAttention
from timm.models.vision_transformer_sam import Block as SamBlock
from timm.models.vision_transformer_sam import VisionTransformerSAM, window_partition, window_unpartition
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import host
from .._validate import check_bool
from ..encodings.decomposed import Decomposed2d
from ..host import HostShape, OwnRope, PositionsHost
from ..positions import PositionContext, Positions
from .attention import PatchedAttention, positioned_attention
from .model import (
    LOAD_ADVICE,
    adopt_timm_checkpoint,
    embed_tokens,
    keep_signatures,
    positional_groups,
    refuse_unplaced,
    token_grid,
)
from .pruning import PrunesPositions


@dataclass
class SamPositions:
    """The positions of one SAM forward: ``whole`` at the token grid (global blocks), ``window`` at the
    window grid (window blocks; None when the model has none)."""

    whole: PositionContext
    window: PositionContext | None


def sam_positions(positions: Positions, grid: tuple[int, int], window_size: int, device: torch.device) -> SamPositions:
    """Both contexts of a forward at ``grid``: built once, the window one shared by every window."""
    window = positions.context((window_size, window_size), device) if window_size > 0 else None
    return SamPositions(positions.context(grid, device), window)


# torch.fx leaves (as in model.py: fx.wrap patches the names of the module that calls them): the grid-dependent
# steps read sizes as Python numbers, and the positions of a forward are a Python object, not a tensor
torch.fx.wrap("token_grid")
torch.fx.wrap("embed_tokens")
torch.fx.wrap("sam_positions")
torch.fx.wrap("positioned_attention")


class PatchedSamAttention(PatchedAttention):
    """timm SAM's ``Attention`` with vispos's positions, on NHWC tokens [B, H, W, C] (a window, or the grid);
    its ``rel_pos_h`` / ``rel_pos_w`` go to ``model.vispos``, its RoPE is dropped."""

    accepts = (SamAttention,)

    def __init__(self, original: nn.Module, layer_idx: int) -> None:
        super().__init__(original, layer_idx)
        for name in ("rel_pos_h", "rel_pos_w", "rope"):
            if hasattr(self, name):
                delattr(self, name)  # adopted into vispos (or discarded) by patch_sam
        self.norm = nn.Identity()  # SAM's attention has no norm before its projection

    def forward(self, x: torch.Tensor, positions: object = None) -> torch.Tensor:  # type: ignore[override]
        """x [B, H, W, C] -> [B, H, W, C]; ``positions``: the ``PositionContext`` at this (H, W)."""
        b, h, w, c = x.shape
        return positioned_attention(self, x.reshape(b, h * w, c), positions, False).view(b, h, w, -1)


class PatchedSamBlock(SamBlock):
    """timm SAM's ``Block`` whose attention takes the context of its kind of block from ``SamPositions``."""

    def forward(self, x: torch.Tensor, positions: SamPositions | None = None) -> torch.Tensor:  # type: ignore[override]
        """x [B, H, W, C] -> [B, H, W, C], as timm's block, with positions."""
        if not isinstance(positions, (SamPositions, torch.fx.Proxy)):  # a Proxy: traced by torch.fx
            raise ValueError(
                "a vispos-patched SAM block needs the positions of the forward pass: call the model, or build them "
                "with positions = model.vispos_context(images) and call each block as block(tokens, positions)"
            )
        b, h, w, _ = x.shape
        shortcut = x
        x = self.norm1(x)
        pad_hw = None
        if self.window_size > 0:
            x, pad_hw = window_partition(x, self.window_size)  # [B * windows, ws, ws, C]
        x = self.drop_path1(self.ls1(self.attn(x, positions.window if self.window_size > 0 else positions.whole)))
        if self.window_size > 0:
            x = window_unpartition(x, self.window_size, (h, w), pad_hw)
        x = shortcut + x
        x = x.reshape(b, h * w, -1)
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x.reshape(b, h, w, -1)


def after_sam_block(block: nn.Module, args: tuple, kwargs: dict[str, Any], out: torch.Tensor) -> torch.Tensor:
    """Forward hook on ``blocks[after]`` for a conditional scheme (peg2d): the block's NHWC output with the
    scheme applied at the whole grid."""
    positions = kwargs["positions"] if "positions" in kwargs else args[1] if len(args) > 1 else None
    b, h, w, c = out.shape
    ctx = positions.whole
    return ctx.positions.apply_conditional(out.reshape(b, h * w, c), ctx).reshape(b, h, w, c)


class PatchedSam(PrunesPositions, PositionsHost, VisionTransformerSAM):
    """VisionTransformerSAM with vispos positions: the grid read from the input, the contexts handed to every block."""

    def no_weight_decay(self) -> set[str]:
        own = {n for n in super().no_weight_decay() if n != "pos_embed"}  # pos_embed is gone
        return own | self.positional_no_weight_decay()

    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        return positional_groups(super().group_matcher(coarse), self.vispos)

    @property
    def vispos_window_size(self) -> int:
        """The window of the window blocks (0: every block is global)."""
        return max((blk.window_size for blk in self.blocks), default=0)

    def vispos_grid(self, image: torch.Tensor) -> tuple[int, int]:
        """The token grid the patch embedding makes of an image batch [B, C, H, W]."""
        return token_grid(self.patch_embed, image)

    def vispos_context(self, image: torch.Tensor) -> SamPositions:
        """The positions of one forward pass on ``image`` [B, C, H, W], for the blocks' ``positions``."""
        return sam_positions(self.vispos, token_grid(self.patch_embed, image), self.vispos_window_size, image.device)

    def _embedded(self, x: torch.Tensor) -> tuple[torch.Tensor, SamPositions]:
        """Images [B, C, H, W] -> tokens [B, H, W, C] with the additive positions, and the forward's positions."""
        grid = token_grid(self.patch_embed, x)  # refuses a size the patches do not divide
        x = self.patch_embed(x)  # [B, H, W, C]
        b, h, w, c = x.shape
        x = embed_tokens(self.vispos, x, []).reshape(b, h, w, c)
        x = self.norm_pre(self.patch_drop(self.pos_drop(x)))
        return x, sam_positions(self.vispos, grid, self.vispos_window_size, x.device)

    def _block(self, blk: nn.Module, x: torch.Tensor, positions: SamPositions) -> torch.Tensor:
        if self.grad_checkpointing and torch.is_grad_enabled():
            return checkpoint(blk, x, positions, use_reentrant=False)
        return blk(x, positions)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images [B, C, H, W] -> the neck's feature map [B, neck_chans, H/p, W/p], at any divisible size."""
        x, positions = self._embedded(x)
        for blk in self.blocks:
            x = self._block(blk, x, positions)
        return self.neck(x.permute(0, 3, 1, 2))

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """timm's ``VisionTransformerSAM.forward_intermediates`` (same arguments and outputs), vispos's positions."""
        if output_fmt != "NCHW":
            raise ValueError(f"output_fmt must be 'NCHW' for SAM, got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        x, positions = self._embedded(x)
        intermediates = []
        for i, blk in enumerate(self.blocks[: max_index + 1] if stop_early else self.blocks):
            x = self._block(blk, x, positions)
            if i in take_indices:
                y = x.permute(0, 3, 1, 2)
                intermediates.append(self.neck(y) if norm else y)
        if intermediates_only:
            return intermediates
        return self.neck(x.permute(0, 3, 1, 2)), intermediates


# --- what the model's own positions are ------------------------------------------------------------------


def layer_grids(model: VisionTransformerSAM) -> list[tuple[int, int]]:
    """The grid each block attends over at the model's image size: its window, or the whole grid."""
    grid = tuple(model.patch_embed.grid_size)
    return [(blk.window_size, blk.window_size) if blk.window_size > 0 else grid for blk in model.blocks]


def own_positions(model: VisionTransformerSAM) -> OwnRope | None:
    """SAM's decomposed relative tables as decomposed2d, or None when it has none (``use_rel_pos=False``)."""
    if not any(blk.attn.use_rel_pos for blk in model.blocks):
        return None
    source = "timm VisionTransformerSAM rel_pos_h / rel_pos_w"
    return OwnRope("decomposed2d", {}, source, what="decomposed relative positions")


def adopt_tables(attention: nn.ModuleList, model: VisionTransformerSAM) -> None:
    """Each block's ``rel_pos_h`` / ``rel_pos_w`` -> its decomposed2d module's (the same sizes)."""
    with torch.no_grad():
        for i, (module, blk) in enumerate(zip(attention, model.blocks, strict=True)):
            for name in ("rel_pos_h", "rel_pos_w"):
                own, table = getattr(blk.attn, name), getattr(module, name)
                if own.shape != table.shape:
                    raise ValueError(
                        f"block {i}'s {name} is {tuple(own.shape)}, its {'window' if blk.window_size else 'grid'} "
                        f"needs {tuple(table.shape)}: patch with inherit=False to start fresh tables"
                    )
                if own.is_meta:  # a model built on the meta device: the values arrive with its weights
                    setattr(module, name, nn.Parameter(table.to("meta"), requires_grad=table.requires_grad))
                else:
                    table.copy_(own)


# --- patch -----------------------------------------------------------------------------------------------


def patch_sam(
    model: nn.Module, pos: str | list[str] | tuple[str, ...], *, inherit: bool = True, **options: Any
) -> nn.Module:
    """Give a timm SAM image encoder the positional scheme ``pos`` (as ``vispos.patch``: at most one additive,
    one attention and one conditional scheme; ``inherit`` keeps the model's own positions, see the module's
    docstring). In place; returns the model."""
    if not isinstance(model, VisionTransformerSAM):
        raise TypeError(f"patch_sam takes a timm VisionTransformerSAM (samvit_*), got {type(model).__name__}")
    if isinstance(model, PatchedSam):
        raise ValueError("this SAM is already patched by vispos; patch a fresh model instead (a patched model's "
                         "weights load into a freshly patched one with load_state_dict)")  # fmt: skip
    check_bool("inherit", inherit)
    for i, blk in enumerate(model.blocks):
        if type(blk) is not SamBlock or not isinstance(blk.attn, SamAttention):
            raise TypeError(f"block {i} of this SAM is a {type(blk).__name__}; vispos supports timm SAM's Block")
    if inherit and model.rope_global is not None:
        raise ValueError(
            "this SAM has a RoPE of its own (use_rope=True), which vispos does not inherit: patch with "
            "inherit=False to replace it with a fresh scheme"
        )
    own = own_positions(model) if inherit else None
    table = model.pos_embed  # [1, H, W, C] or None
    schemes, per_scheme, kept = host.plan_schemes(pos, options, own=own, has_table=table is not None)
    additive = schemes[0]
    if inherit and own is None and table is not None and (additive is None or additive.name != "learned2d"):
        host.warn(
            f"this SAM's learned pos_embed is discarded: {additive.name if additive else 'no additive scheme'} "
            "replaces it, and the pretrained weights were trained with it. Patch with learned2d to keep it, or "
            "inherit=False to start fresh without this warning"
        )
    attn0 = model.blocks[0].attn
    shape = HostShape(model.embed_dim, attn0.num_heads, attn0.head_dim, len(model.blocks), 0)
    grid = tuple(model.patch_embed.grid_size)
    flat = None if table is None else table.flatten(1, 2)  # [1, H*W, C], as learned2d adopts it
    model.vispos = host.build_positions(
        shape, schemes, per_scheme, grid, 0, kept, table=flat, layer_grids=layer_grids(model)
    )
    if kept is not None:
        adopt_tables(model.vispos.attention, model)
    model.vispos.train(model.training)  # a model patched in eval mode stays in it
    model.pos_embed, model.rope_global, model.rope_window = None, None, None
    for i, blk in enumerate(model.blocks):
        blk.attn = PatchedSamAttention(blk.attn, layer_idx=i)
        blk.__class__ = PatchedSamBlock
    conditional = model.vispos.conditional
    if conditional is not None:
        model.blocks[conditional.after].register_forward_hook(after_sam_block, with_kwargs=True)
    model.__class__ = PatchedSam
    model.register_load_state_dict_pre_hook(adopt_sam_checkpoint)
    return model


# --- timm SAM checkpoints --------------------------------------------------------------------------------


def adopt_sam_checkpoint(model: PatchedSam, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """``load_state_dict`` pre-hook: a plain timm SAM checkpoint loads into a patched one. Its ``pos_embed``
    goes to learned2d (``adopt_timm_checkpoint``) and each block's ``rel_pos_h`` / ``rel_pos_w`` to the layer's
    decomposed2d (resized linearly when its size differs); tables the model's scheme has no place for are
    refused, or with ``strict=False`` reported as unexpected."""
    if any(k.startswith(f"{prefix}vispos.") for k in state_dict):
        return  # a vispos checkpoint: Positions checks it
    adopt_timm_checkpoint(model, state_dict, prefix)  # settings records and pos_embed
    keys = [k for k in state_dict if k.startswith(f"{prefix}blocks.") and k.endswith((".rel_pos_h", ".rel_pos_w"))]
    if not keys:
        return
    attention = model.vispos.attention
    if not (isinstance(attention, nn.ModuleList) and all(isinstance(m, Decomposed2d) for m in attention)):
        refuse_unplaced(model, "timm SAM's decomposed relative tables",
                        f"patch with decomposed2d to keep them, {LOAD_ADVICE}")  # fmt: skip
        return  # reported by load_state_dict as unexpected keys
    for key in keys:
        layer, name = key[len(f"{prefix}blocks.") :].split(".attn.")
        at = f"{prefix}vispos.attention.{layer}."
        state_dict[f"{at}{name}"] = state_dict.pop(key)
        attention[int(layer)].resample_state(state_dict, at, None, None)


__all__ = ["PatchedSam", "PatchedSamAttention", "PatchedSamBlock", "SamPositions", "patch_sam"]


keep_signatures(PatchedSam, VisionTransformerSAM)  # its forwards under timm's signatures
