"""timm's ``VisionTransformer`` and ``Eva`` as a patched host (``patch_vit``), and the steps the other hosts
share with it: planning the schemes against a model's own positions (``plan_schemes``), building its
``Positions`` (``build_positions``) and replacing its attentions (``patch_attention``).

``patching.patch`` checks the model and dispatches here or to a host of its own (``naflex.py``, ``beit.py``,
``relpos.py``, ``swin.py``), which import this module, never ``patching``.
"""

from __future__ import annotations

from typing import Any

import torch
from timm.layers import Format
from timm.models.eva import Eva
from torch import nn

from .. import host
from ..host import HostShape, OwnRope
from ..positions import Positions
from ..registry import SchemeInfo
from .attention import PatchedAttention
from .inherit import own_rope
from .model import adopt_timm_checkpoint, after_block, patched_class


def patch_vit(model: nn.Module, pos: str | list[str] | tuple[str, ...], *, inherit: bool, **options: Any) -> nn.Module:
    """``patch`` for a checked ``VisionTransformer`` / ``Eva`` (``patching._check_model``): in place."""
    schemes, per_scheme, kept = plan_schemes(model, pos, options, inherit=inherit, table=model.pos_embed)
    table_prefix = 0 if model.no_embed_class else model.num_prefix_tokens  # prefix rows of timm's table
    model.vispos = build_positions(
        model, schemes, per_scheme, tuple(model.patch_embed.grid_size), table_prefix, kept, table=model.pos_embed
    )
    model.vispos.train(model.training)  # a model patched in eval mode stays in it (no coordinate augmentation)
    model.pos_embed = None
    if isinstance(model, Eva):
        model.rope, model.rope_mixed = None, False
    patch_attention(model)
    pe = model.patch_embed
    pe.flatten, pe.output_fmt, pe.strict_img_size = False, Format.NHWC, False  # dynamic_img_pad stays as it was
    model.dynamic_img_size = True
    model.__class__ = patched_class(type(model))
    model.register_load_state_dict_pre_hook(adopt_timm_checkpoint)
    return model


def plan_schemes(
    model: nn.Module,
    pos: str | list[str] | tuple[str, ...],
    options: dict[str, Any],
    *,
    inherit: bool,
    table: torch.Tensor | None,
) -> tuple[tuple[SchemeInfo | None, SchemeInfo | None, SchemeInfo | None], dict[str, dict[str, Any]], OwnRope | None]:
    """``vispos.host.plan_schemes`` for a timm model: its own RoPE (with ``inherit``) and learned ``table``."""
    own = own_rope(model) if inherit else None
    return host.plan_schemes(pos, options, own=own, has_table=table is not None)


def build_positions(
    model: nn.Module,
    schemes: tuple[SchemeInfo | None, SchemeInfo | None, SchemeInfo | None],
    per_scheme: dict[str, dict[str, Any]],
    grid: tuple[int, int],
    table_prefix: int,
    kept: OwnRope | None = None,
    *,
    table: torch.Tensor | None = None,
) -> Positions:
    """``vispos.host.build_positions`` for a timm model's widths, heads, depth and prefix tokens."""
    attn0 = model.blocks[0].attn
    shape = HostShape(model.embed_dim, attn0.num_heads, attn0.head_dim, len(model.blocks), model.num_prefix_tokens)
    return host.build_positions(shape, schemes, per_scheme, grid, table_prefix, kept, table=table)


def patch_attention(model: nn.Module) -> None:
    """Each block's attention becomes a ``PatchedAttention`` reading ``model.vispos``'s context; a
    conditional scheme is hooked to the output of the block it follows (every call with the context)."""
    for i, blk in enumerate(model.blocks):
        blk.attn = PatchedAttention(blk.attn, layer_idx=i)
    conditional = model.vispos.conditional
    if conditional is not None:
        model.blocks[conditional.after].register_forward_hook(after_block, with_kwargs=True)
