"""Sequence layers with any 1D positional scheme: ``vispos.layers.Attention(dim, heads, pos="alibi")``."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ._state import decode, encode
from ._validate import check_bool, check_float, check_int, check_positions
from .attention import as_float_mask, combine_masks, sdpa, shaw_attention
from .encodings.alibi import causal_mask
from .encodings.rope_scaling_setting import fold_scaling_fields
from .registry import build_in_context, get_info


def fp32_region(device_type: str, enabled: bool) -> contextlib.AbstractContextManager:
    """Autocast off, so that fp32 operands stay fp32 (nothing changes when not ``enabled``)."""
    return torch.autocast(device_type, enabled=False) if enabled else contextlib.nullcontext()


class Attention(nn.Module):
    """Multi-head self-attention over [B, N, dim] tokens with a 1D positional scheme applied inside.

    RoPE / xPos rotate q and k; bias schemes (ALiBi, T5) enter SDPA as one additive mask; Shaw's scheme
    takes an explicit path for its value term. Additive schemes (sincos1d, learned1d) belong to the
    embeddings, not to attention: build them with ``vispos.create_encoding`` and add them to the tokens.
    ``causal`` masks later keys and selects the causal form of schemes that have one (ALiBi, T5).
    xPos runs in fp32 whatever the model's dtype or autocast: its scaled keys grow as zeta ** (-N / 2
    scale_base) (2.3e4 at N = 8192) and overflow fp16 where q.k, the product that decays, does not.
    Scheme options (``theta``, ``scaling``, ``num_buckets``, ...) pass through ``pos_options``; a scalable
    RoPE takes its scaling as ``vispos.configure`` does: ``scaling="yarn", factor=4.0, original_length=128``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        pos: str = "nope",
        causal: bool = False,
        qkv_bias: bool = True,
        dropout: float = 0.0,
        fused: bool = True,
        **pos_options: object,
    ) -> None:
        super().__init__()
        self.dim = check_int("dim", dim, minimum=1)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        self.head_dim = dim // num_heads
        self.causal = check_bool("causal", causal)
        self.dropout = check_float("dropout", dropout, minimum=0.0)
        self.fused = check_bool("fused", fused)
        info = get_info(pos, ndim=1)
        if info.kind == "additive":
            raise ValueError(
                f"{pos!r} is added to the token embeddings, not applied in attention; build it with "
                f"vispos.create_encoding({pos!r}, ndim=1, dim=...) and add it to the tokens"
            )
        self.kind = info.kind
        self.position_axes = info.position_axes  # ids per token: 1, or 3 for mrope (t, h, w)
        self.enabled = True  # DroPE switch (vispos.drope): False skips the positional scheme
        context = {"dim": self.head_dim, "num_heads": num_heads, "causal": causal}
        if "scaling" in info.options:
            pos_options = fold_scaling_fields(pos_options)
        self.pos = build_in_context(info, context, pos_options)
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def get_extra_state(self) -> torch.Tensor:
        return encode({"enabled": int(self.enabled)})  # a DroPE-trained layer reloads with its positions off

    def set_extra_state(self, state: torch.Tensor | dict[str, bool]) -> None:
        self.enabled = bool(decode(state)["enabled"])

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [B, N, dim]; positions [N] or [B, N] (default 0..N-1; e.g. offsets or packed sequences), for mrope
        [3, B, N] or [3, N] (t, h, w ids, e.g. from ``mrope_positions``; [N]: text);
        attn_mask: SDPA-style bool (True = attend) or float, broadcastable to [B, heads, N, N]."""
        b, n, _ = x.shape
        if positions is None:
            positions = torch.arange(n, device=x.device)
        positions = check_positions(positions, axes=self.position_axes)
        if positions.shape[-1] != n:
            raise ValueError(f"positions cover {positions.shape[-1]} tokens, the input has {n}")
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # [B, h, N, d]
        dtype = v.dtype
        kind = self.kind if self.enabled else "none"
        full_precision = False
        if kind == "rotary":
            rotary = self.pos(positions)
            full_precision = rotary.q_scale is not None  # xPos: see below
            if full_precision:
                q, k, v = q.float(), k.float(), v.float()
            q, k = rotary.rotate(q, k)
        mask = as_float_mask(attn_mask, q.dtype)
        causal_now = self.causal
        if kind == "bias":
            bias = self.pos(positions)  # [(B,) heads, N, N], causal form already masked
            mask = combine_masks(bias.to(q.dtype), mask)
        if causal_now and (mask is not None or kind == "relative_kv"):
            mask = combine_masks(mask, causal_mask(n, x.device).to(q.dtype))
            causal_now = False
        dropout_p = self.dropout if self.training else 0.0
        with fp32_region(x.device.type, full_precision):
            if kind == "relative_kv":
                out = shaw_attention(q, k, v, self.pos(positions), mask=mask, dropout_p=dropout_p)
            else:
                out = sdpa(q, k, v, mask=mask, is_causal=causal_now, dropout_p=dropout_p, fused=self.fused)
        out = out.to(dtype)
        return self.proj(out.transpose(1, 2).reshape(b, n, self.dim))
