"""Any vispos 2D scheme inside a diffusion transformer's self-attention: ``vispos.patch(transformer, pos,
inherit=False)`` on DiT and PixArt, whose blocks attend over the image tokens alone (``attn1``; PixArt's
cross-attention to text, ``attn2``, keeps diffusers' processor).

What changes on the one transformer (diffusers' classes never): each block's ``attn1`` takes a
``SchemeAttnProcessor`` through diffusers' processor API (``Attention.set_processor``); the patch embedding drops the
model's sin-cos table and adds the scheme's additive table, if any (``modules.SchemePatchEmbed``); the transformer's
forward builds the positional context once per forward at the latent's token grid and, for a rope2d under DyPE's
schedule, hands it the noise level of its ``timestep`` (``modules.SchemeTransformer``). The schemes are the
catalogue's, built by ``host.build_positions`` as for timm and transformers models: rotary (rope2d, rope2d_mixed,
the learned bases), biases (alibi2d, relbias2d, cpb2d, LookHere, FIRE), query-dependent biases (iRPE,
decomposed2d), PaPE's channels, additive tables (sincos2d, learned2d) and nope.

The processor is diffusers' ``AttnProcessor2_0`` for these blocks (projections, optional q / k norms, SDPA, output
projection) with the scheme's rotation and mask applied to q and k before SDPA: with ``nope`` its outputs are
diffusers' (``tests/test_diffusers_schemes.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention import query_mask, sdpa
from ..encodings.rope2d import Rope2d
from ..host import HostShape, build_positions, plan_schemes
from ..positions import PositionContext, Positions
from .families import Family
from .modules import SchemePatchEmbed, SchemeTransformer, adopt_positions, patched


class SchemeAttnProcessor:
    """Self-attention over the image tokens of one block (``layer``) with the positions of the forward in progress
    (``positions.current``, built by the transformer's forward)."""

    def __init__(self, positions: Positions, layer: int) -> None:
        self.positions = positions
        self.layer = layer

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None,
                 **kwargs: Any) -> torch.Tensor:  # fmt: skip
        if encoder_hidden_states is not None:
            raise ValueError("vispos's attention processor is for self-attention over the image tokens; this call "
                             "passed encoder_hidden_states (cross-attention keeps diffusers' processor)")  # fmt: skip
        ctx = self.positions.__dict__.get("current")
        if not isinstance(ctx, PositionContext):
            raise ValueError(
                "this attention takes its positions from the transformer's forward (vispos.patch(..., inherit=False)); "
                "call the transformer, not the block or the attention alone"
            )
        ctx.check_tokens(hidden_states)
        b, n, _ = hidden_states.shape
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        heads = attn.heads
        q, k, v = (t.view(b, n, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        rotary, mask = ctx.layer(self.layer, q.dtype, hidden_states)
        if rotary is not None:
            q, k = rotary.rotate(q, k)
        mask = query_mask(mask, q)
        if attention_mask is not None:  # diffusers' mask, prepared as its processor prepares it
            user = attn.prepare_attention_mask(attention_mask, n, b).view(b, heads, -1, attention_mask.shape[-1])
            mask = user if mask is None else mask + user
        width = v.shape[-1]
        out = sdpa(q, k, v, mask=mask, scale=attn.scale * ctx.logit_scale)
        out = out.transpose(1, 2).reshape(b, n, heads * width).to(q.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        if attn.residual_connection:
            out = out + hidden_states
        return out / attn.rescale_output_factor


def self_attentions(transformer: nn.Module, family: Family) -> list[nn.Module]:
    """Each block's self-attention over the image tokens (``attn1``), checked to be the plain form the processor
    reproduces."""
    attentions = [block.attn1 for block in transformer.transformer_blocks]
    for i, attn in enumerate(attentions):
        extra = [name for name in ("spatial_norm", "group_norm") if getattr(attn, name, None) is not None]
        if attn.is_cross_attention or extra:
            said = "is a cross-attention" if attn.is_cross_attention else f"has {', '.join(extra)}"
            raise ValueError(f"{family.name}: block {i}'s attn1 {said}; vispos's processor takes plain "
                             "self-attention over the image tokens")  # fmt: skip
    return attentions


def patch_schemes(transformer: nn.Module, family: Family, pos: Any, options: dict[str, Any]) -> Positions:
    """Put ``pos`` (with ``options``) into every block's self-attention and patch embedding of a DiT or PixArt
    ``transformer``; the model's sin-cos table is removed. Returns the transformer's ``Positions``."""
    schemes, per_scheme, _ = plan_schemes(pos, options, own=None, has_table=False)
    additive, attention, conditional = schemes
    if conditional is not None:
        raise ValueError(
            f"{conditional.name} on {family.name}: a conditional scheme acts on the tokens between blocks, which "
            "diffusers' block loop does not expose; use an additive or attention scheme"
        )
    embed = transformer.pos_embed
    attentions = self_attentions(transformer, family)
    heads = attentions[0].heads
    shape = HostShape(embed_dim=embed.proj.out_channels, num_heads=heads, head_dim=attentions[0].inner_dim // heads,
                      depth=len(attentions), num_prefix_tokens=0)  # fmt: skip
    grid = (int(embed.height), int(embed.width))
    positions = build_positions(shape, schemes, per_scheme, grid, table_prefix=0)
    for module in positions.modules():
        if isinstance(module, Rope2d):
            module.timestep_aware = True  # its forward gives the noise level: DyPE's schedule applies
    for layer, attn in enumerate(attentions):
        attn.set_processor(SchemeAttnProcessor(positions, layer))
    embed.pos_embed = None  # the model's own table: the scheme's additive table takes its place
    embed.__dict__["_vispos_positions"] = positions
    embed.__class__ = patched(type(embed), SchemePatchEmbed)
    adopt_positions(transformer, positions, family.name, SchemeTransformer)
    return positions
