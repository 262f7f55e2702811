"""Two floors of the work a positional scheme adds to a forward, and the models' geometry they need.

- one pass (``rotary_floor``, ``bias_floor``): the scheme applied as a kernel of its own.
  - rotary: one read and one write of q and k [B, heads, N, head_dim] per layer, in q's dtype, plus its table once
    (the tensors of its rotation at this grid, prefix rows left out, in the dtype it builds them: cos/sin
    [(layers, heads,) HW, head_dim], blocks [(heads,) HW, d/b, b, b], STRING's basis [heads, d, d]).
  - bias: one mask [heads, N, N] in q's dtype per forward (per layer for a per-layer table), written once and
    read once per layer (by the attention kernel).
- fused (``rotary_fused_floor``, ``bias_fused_floor``): the scheme computed inside a kernel that runs anyway (the
  rotation in the q/k projection's epilogue or the attention kernel's prologue, a bias inside the attention
  kernel, FlexAttention's ``score_mod``): what it adds is its table alone: a rotary table once; a bias's
  per-offset table [heads, (2H - 1)(2W - 1)] in q's dtype, written once per forward (per layer for a per-layer
  table) and read once per layer.
- a training step: twice the inference floor (the backward passes once over the gradients of q and k, or of the
  mask, and over the table); what a learned table's own gradient costs is left out.

Other kinds (additive, conditional, query-dependent bias, none) have no floor here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vispos.encodings.rope import Rotary

from .work_count import on_model_tensors


@dataclass(frozen=True)
class Geometry:
    """What a floor depends on: layers, heads, head size, tokens (prefix included) and the patch grid."""

    layers: int
    heads: int
    head_dim: int
    tokens: int
    grid: tuple[int, int]


def geometry(model: nn.Module) -> Geometry:
    """The geometry of a timm ViT or Eva (patched or not) at the image size it was built for."""
    attn = model.blocks[0].attn
    grid = tuple(model.patch_embed.grid_size)
    tokens = grid[0] * grid[1] + model.num_prefix_tokens
    return Geometry(len(model.blocks), attn.num_heads, attn.head_dim, tokens, grid)  # type: ignore[arg-type]


def qk_bytes(geo: Geometry, batch: int, itemsize: int) -> int:
    """One read and one write of q and k in every layer: 4 x [B, heads, N, head_dim] per layer."""
    return geo.layers * 4 * batch * geo.heads * geo.tokens * geo.head_dim * itemsize


def mask_bytes(geo: Geometry, itemsize: int) -> int:
    """One additive mask [heads, N, N]."""
    return geo.heads * geo.tokens * geo.tokens * itemsize


def rotary_floor(geo: Geometry, batch: int, itemsize: int, table: int, *, train: bool) -> int:
    """q and k read and written once per layer, the table once; twice that for a training step."""
    return (2 if train else 1) * (qk_bytes(geo, batch, itemsize) + table)


def bias_floor(geo: Geometry, itemsize: int, *, per_layer: bool, train: bool) -> int:
    """One mask per forward (per layer for a per-layer table) written once and read once per layer."""
    writes = geo.layers if per_layer else 1
    return (2 if train else 1) * mask_bytes(geo, itemsize) * (writes + geo.layers)


def rotary_fused_floor(table: int, *, train: bool) -> int:
    """The table alone, read once; twice that for a training step."""
    return (2 if train else 1) * table


def offset_table_bytes(geo: Geometry, itemsize: int) -> int:
    """One per-offset bias table [heads, (2H - 1)(2W - 1)]."""
    return geo.heads * (2 * geo.grid[0] - 1) * (2 * geo.grid[1] - 1) * itemsize


def bias_fused_floor(geo: Geometry, itemsize: int, *, per_layer: bool, train: bool) -> int:
    """A per-offset table per forward (per layer for a per-layer table) written once and read once per layer."""
    writes = geo.layers if per_layer else 1
    return (2 if train else 1) * offset_table_bytes(geo, itemsize) * (writes + geo.layers)


def rotation_bytes(rotation: Rotary) -> int:
    """Bytes of a rotation's tensors (cos/sin, xPos scales, basis, blocks)."""
    parts = (rotation.cos, rotation.sin, rotation.q_scale, rotation.k_scale, rotation.basis, rotation.blocks)
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


def vispos_table_bytes(model: nn.Module) -> int:
    """Bytes of a patched model's rotation tables at its grid, every layer's for a per-layer scheme."""
    positions = model.vispos
    modules = positions.attention if isinstance(positions.attention, nn.ModuleList) else [positions.attention]
    grid = geometry(model).grid
    with torch.no_grad(), on_model_tensors(model):
        return sum(rotation_bytes(m.eval()(grid, torch.device("cpu"))) for m in modules)


def timm_table_bytes(model: nn.Module) -> int:
    """Bytes of a timm Eva's rotary embedding at its grid (sin/cos [(layers, heads,) HW, 2 x head_dim])."""
    rope = model.rope
    with torch.no_grad(), on_model_tensors(model):
        embed = rope.get_embed() if hasattr(rope, "feat_shape") else rope.get_embed(shape=geometry(model).grid)
    tensors = embed if isinstance(embed, (tuple, list)) else (embed,)
    return sum(t.numel() * t.element_size() for t in tensors)


def mask_writes(written: dict[int, int], geo: Geometry, batch: int) -> int:
    """Kernel outputs of a mask's number of elements (``Work.written``): heads x Nq x Nk, or batch x heads x Nq x
    Nk (a mask per batch element), with Nq and Nk each the patches or the tokens (prefix rows padded or not), in
    any shape ([heads, N * N] as gathered, [B, heads, N, N]); each is a pass that writes a whole mask (building it,
    padding its prefix rows, casting it). Meant for inference: on SDPA's math path the logits have a mask's size."""
    sides = {geo.grid[0] * geo.grid[1], geo.tokens}
    sizes = {lead * nq * nk for lead in (geo.heads, batch * geo.heads) for nq in sides for nk in sides}
    return sum(count for numel, count in written.items() if numel in sizes)
