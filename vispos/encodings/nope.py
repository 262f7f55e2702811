"""NoPE: no positional information (causal masking alone can still leak order in decoders)."""

from __future__ import annotations

from torch import nn


class NoPE(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, *_: object, **__: object) -> None:
        return None
