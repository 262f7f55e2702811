"""Attention maths shared by the sequence layer (``vispos.layers.Attention``) and patched timm blocks.

Every path ends in ``F.scaled_dot_product_attention`` unless the caller asks for the eager reference
(``fused=False``) or the scheme needs the attention weights themselves (Shaw's value term).
Masks follow SDPA: a bool mask is True where attention is allowed; a float mask is added to the logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .encodings.shaw import ShawTables


def as_float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Bool (True = attend) or float mask -> additive float mask in ``dtype``."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def as_4d(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A mask broadcastable to [B, heads, N, N] as a 4-D view (leading dims of size 1 added)."""
    if mask is None or mask.dim() >= 4:
        return mask
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def combine_masks(*masks: torch.Tensor | None) -> torch.Tensor | None:
    """Sum of the given additive masks (broadcast), None when there are none."""
    out = None
    for m in masks:
        if m is not None:
            out = m if out is None else out + m
    return out


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    fused: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for q, k, v [B, heads, N, head_dim]; fused or the eager reference.

    A float mask goes to SDPA as 4-D in q's dtype: with a 3-D mask PyTorch's CPU dispatcher leaves the
    fused kernel for the math path (several times slower)."""
    mask = as_4d(as_float_mask(mask, q.dtype))
    if fused:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = (q * scale) @ k.transpose(-2, -1)  # [B, heads, N, N]
    if is_causal:
        n = q.shape[-2]
        logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if mask is not None:
        logits = logits + mask
    probs = logits.softmax(dim=-1)
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p)
    return probs @ v


def shaw_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: ShawTables,
    *,
    mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Shaw et al.: e_ij = q_i (k_j + aK_ij) / sqrt(d), out_i = sum_j a_ij (v_j + aV_ij).

    The relative terms go through the (2k + 1)-row tables: q @ aK^T is gathered into an [N, N] bias, and
    the weights are summed per offset bucket before meeting aV, so no [N, N, head_dim] tensor is built.
    """
    b, h, n, _ = q.shape
    scale = 1.0 / math.sqrt(q.shape[-1])
    index = tables.index.expand(b, n, n)[:, None].expand(b, h, n, n)  # [B, heads, N, N]
    q_rel = q @ tables.key_table.to(q.dtype).T  # [B, heads, N, 2k+1]
    rel_bias = torch.gather(q_rel, -1, index) * scale
    mask = combine_masks(rel_bias, as_float_mask(mask, q.dtype))
    if tables.value_table is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    probs = ((q * scale) @ k.transpose(-2, -1) + mask).softmax(dim=-1)
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p)
    buckets = torch.zeros_like(q_rel).scatter_add_(-1, index, probs)  # weight per offset bucket
    return probs @ v + buckets @ tables.value_table.to(q.dtype)


_compiled_flex = torch.compile(flex_attention, dynamic=False)  # compiled on first use, once per shape


def offset_score_mod(
    per_offset: torch.Tensor, grid: tuple[int, int], num_prefix_tokens: int, prefix_bias: torch.Tensor | None
):  # noqa: ANN201  (a FlexAttention score_mod)
    """FlexAttention score_mod adding a relative 2D bias looked up per offset, so no [heads, N, N] mask exists.

    ``per_offset`` [heads, 2H-1, 2W-1] holds the bias of offset (dy, dx) = query - key at
    [dy + H - 1, dx + W - 1]; tokens are P prefix tokens then the grid, row-major. Prefix rows and columns
    take ``prefix_bias`` [3, heads] (prefix->patch, patch->prefix, prefix->prefix) or zero.
    """
    h, w = grid
    p = num_prefix_tokens

    def score_mod(score, b, head, q_idx, kv_idx):  # noqa: ANN001, ANN202
        qp, kp = (q_idx - p).clamp(min=0), (kv_idx - p).clamp(min=0)  # patch index (prefix: clamped, unused)
        bias = per_offset[head, qp // w - kp // w + h - 1, qp % w - kp % w + w - 1]
        if p:
            to_patch, from_patch, among = (
                (prefix_bias[i, head] for i in range(3)) if prefix_bias is not None else (0.0, 0.0, 0.0)
            )
            from_prefix = torch.where(kv_idx < p, among, to_patch)
            bias = torch.where(q_idx < p, from_prefix, torch.where(kv_idx < p, from_patch, bias))
        return score + bias.to(score.dtype)

    return score_mod


@dataclass
class FlexBias:
    """A relative bias as FlexAttention takes it: a ``score_mod`` adding each pair's bias, and a block mask
    (padding and other images' tokens hidden, ragged batches) or None (every pair attends)."""

    score_mod: Callable
    block_mask: BlockMask | None = None


def flex_bias_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: FlexBias, *, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale + relative bias) v through FlexAttention (compiled, fused) for q, k, v
    [B, heads, N, head_dim]; equal to ``sdpa`` with the dense mask, without building it."""
    attend = flex_attention if torch.compiler.is_compiling() else _compiled_flex
    return attend(q, k, v, score_mod=bias.score_mod, block_mask=bias.block_mask, scale=scale)
