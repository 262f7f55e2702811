"""A tiny causal transformer whose positional scheme is any vispos 1D scheme, switchable for DroPE."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import vispos
from vispos.drope import set_enabled
from vispos.encodings.learned import Learned1d
from vispos.layers import Attention

from .config import ModelConfig


class Block(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, *, pos: str, pos_options: dict[str, Any]) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, pos=pos, causal=True, **pos_options)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Token embedding (+ an additive 1D scheme), pre-norm blocks with ``vispos.layers.Attention``, LM head.

    Additive schemes (sincos1d, learned1d) are added to the embeddings here; every other scheme lives in
    attention. ``learned1d`` gets ``max_len`` = the training length and ``init_std`` 1 (the scale of the token
    embeddings and of sincos1d's values; vispos's ViT default 0.02 leaves it far behind in a short run)
    unless the options say otherwise.
    """

    def __init__(
        self, vocab_size: int, cfg: ModelConfig, *, pos: str, options: dict[str, Any], train_length: int
    ) -> None:
        super().__init__()
        self.pos = pos
        self.embed = nn.Embedding(vocab_size, cfg.dim)
        self.pos_embed: nn.Module | None = None
        attn_pos, attn_options = pos, dict(options)
        if vispos.get_info(pos, ndim=1).kind == "additive":
            # learned1d: a table for the training length, started at the token embeddings' scale (N(0, 1))
            extra = {"max_len": train_length, "init_std": 1.0} if pos == "learned1d" else {}
            self.pos_embed = vispos.create_encoding(pos, ndim=1, dim=cfg.dim, **(extra | attn_options))
            attn_pos, attn_options = "nope", {}
        self.additive_enabled = True  # the DroPE switch of the additive path
        self.blocks = nn.ModuleList(
            Block(cfg.dim, cfg.heads, cfg.mlp_ratio, pos=attn_pos, pos_options=attn_options) for _ in range(cfg.depth)
        )
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, N] -> logits [B, N, vocab]."""
        x = self.embed(tokens)  # [B, N, dim]
        if self.pos_embed is not None and self.additive_enabled:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = x + self.pos_embed(positions).to(x.dtype)  # [N, dim] broadcast over the batch
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def set_positions(self, enabled: bool) -> None:
        """DroPE: switch the positional scheme on or off everywhere (attention and additive)."""
        set_enabled(self, enabled)
        self.additive_enabled = enabled

    def set_out_of_range(self, rule: str) -> None:
        """learned1d's behaviour beyond its table: error, clamp or interpolate."""
        if not isinstance(self.pos_embed, Learned1d):
            raise ValueError(f"out_of_range applies to learned1d, this model uses {self.pos!r}")
        self.pos_embed.out_of_range = rule

    @property
    def head_dim(self) -> int:
        return self.blocks[0].attn.head_dim
