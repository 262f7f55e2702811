"""Attention maths shared by the sequence module (``vispos.nn.Attention``) and patched timm blocks.

Every path ends in ``F.scaled_dot_product_attention`` unless the caller asks for the eager reference
(``fused=False``) or the scheme needs the attention weights themselves (Shaw's value term).
Masks follow SDPA: a bool mask is True where attention is allowed; a float mask is added to the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .encodings.rope import Rotary
from .encodings.shaw import ShawTables


def as_float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Bool (True = attend) or float mask -> additive float mask in ``dtype``."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


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
    """softmax(q k^T * scale + mask) v for q, k, v [B, heads, N, head_dim]; fused or the eager reference."""
    mask = as_float_mask(mask, q.dtype)
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


@dataclass
class PositionContext:
    """Per-layer positional tensors for one forward pass at one grid (prefix tokens included)."""

    rotary: tuple[Rotary | None, ...]  # cos/sin [N, d] or [heads, N, d]
    masks: tuple[torch.Tensor | None, ...]  # additive [heads, N, N] or the user's mask
    logit_scale: float = 1.0  # extra temperature on every logit (log-n attention scaling)


class PatchedAttention(torch.nn.Module):
    """Drop-in for timm's ``Attention``, ``AttentionRope`` and ``EvaAttention`` that applies vispos's positions.

    It adopts the original module's parameters and submodules under their original names, so the
    state dict keys and tensors (``qkv``, ``q_norm``, ``k_norm``, ``proj``, Eva's ``q_bias``...) are the
    same objects as before. Blocks hand it a ``PositionContext`` through their ``attn_mask`` argument.
    """

    def __init__(self, original: torch.nn.Module, layer_idx: int) -> None:
        super().__init__()
        for name, child in original.named_children():
            self.add_module(name, child)
        for name, param in original.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in original.named_buffers(recurse=False):
            self.register_buffer(name, buf, persistent=name not in original._non_persistent_buffers_set)
        for name in ("q_bias", "k_bias", "v_bias", "q_proj", "k_proj", "v_proj", "qkv", "gate"):
            if not hasattr(self, name):
                setattr(self, name, getattr(original, name, None))
        self.num_heads: int = original.num_heads
        self.num_kv_heads: int = getattr(original, "num_kv_heads", original.num_heads)
        self.head_dim: int = original.head_dim
        self.scale: float = original.scale
        self.fused_attn: bool = original.fused_attn
        self.qkv_bias_separate: bool = getattr(original, "qkv_bias_separate", False)
        self.layer_idx = layer_idx

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, N, C] -> q, k, v [B, heads, N, head_dim], exactly as timm computes them."""
        b, n, _ = x.shape
        if self.qkv is not None:
            if self.q_bias is None:
                qkv = self.qkv(x)
            else:
                bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
                qkv = self.qkv(x) + bias if self.qkv_bias_separate else F.linear(x, self.qkv.weight, bias)
            return qkv.reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q = self.q_proj(x).reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = (
            p(x).reshape(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2) for p in (self.k_proj, self.v_proj)
        )
        if self.num_kv_heads != self.num_heads:  # grouped-query attention: share each k/v head
            groups = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: object = None,
        is_causal: bool = False,
        rope: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if rope is not None:
            raise ValueError("a vispos-patched attention takes its positions from vispos, not from rope=")
        b, n, _ = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        q, k, v = self.project(x)
        q, k = self.q_norm(q), self.k_norm(k)
        scale = self.scale
        if isinstance(attn_mask, PositionContext):
            rotary, mask = attn_mask.rotary[self.layer_idx], attn_mask.masks[self.layer_idx]
            scale = scale * attn_mask.logit_scale
        else:
            rotary, mask = None, attn_mask
        if rotary is not None:
            q, k = rotary.rotate(q, k)
        out = sdpa(
            q,
            k,
            v,
            mask=mask,
            is_causal=is_causal,
            fused=self.fused_attn,
            scale=scale,
            dropout_p=self.attn_drop.p if self.training else 0.0,
        )
        out = self.norm(out.transpose(1, 2).reshape(b, n, -1))
        if gate is not None:
            out = out * gate
        return self.proj_drop(self.proj(out))
