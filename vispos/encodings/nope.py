"""NoPE: no positional information (causal masking alone can still leak order in decoders)."""

from __future__ import annotations

from torch import nn

from ..registry import register


@register("nope", ndim=1, kind="none", trainable=False, relative=False, summary="no positional information",
    extrapolation="task-dependent (causal mask carries order)", reference="Kazemnejad et al. 2023")
@register("nope", ndim=2, kind="none", trainable=False, relative=False, summary="no positional information",
    extrapolation="nothing to extrapolate")
class NoPE(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, *_: object, **__: object) -> None:
        return None
