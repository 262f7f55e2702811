"""``prune_intermediate_layers`` on a patched timm model: timm's, then the positional modules of the layers it
removed go too, so that the pruned model runs and holds no parameter its forward leaves unused.

timm truncates ``blocks`` (ViT, BEiT, relpos ViT, SAM), ``layers`` (Swin, Swin V2) or ``stages`` (Swin V2-CR);
``model.vispos`` keeps one attention module per block (per-layer schemes) or one ``Positions`` per stage (the Swin
families), truncated here to what remains."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn


def _truncated(modules: nn.Module, count: int) -> nn.Module:
    return nn.ModuleList(list(modules)[:count]) if isinstance(modules, nn.ModuleList) else modules


def prune_positions(model: nn.Module) -> None:
    """Drop ``model.vispos``'s modules of the blocks or stages timm's pruning removed."""
    positions = model.vispos
    if hasattr(positions, "stages"):  # the Swin families: one Positions per stage
        count = len(model.layers if hasattr(model, "layers") else model.stages)
        positions.stages = _truncated(positions.stages, count)
        if hasattr(positions, "follow_window"):
            positions.follow_window = positions.follow_window[:count]
        return
    positions.attention = _truncated(positions.attention, len(model.blocks))


class PrunesPositions:
    """Mixin placed before timm's class: ``prune_intermediate_layers`` prunes the positions with the layers. Each
    class made with it reports the signature of its timm class's method (its defaults differ: SAM's ``indices``)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        base = next((c for c in cls.__mro__ if c.__module__.startswith("timm.")), None)
        if base is None:
            return

        def prune_intermediate_layers(self: Any, *args: Any, **kwargs: Any) -> Any:
            return PrunesPositions.prune_intermediate_layers(self, *args, **kwargs)

        prune_intermediate_layers.__signature__ = inspect.signature(base.prune_intermediate_layers)  # type: ignore[attr-defined]
        prune_intermediate_layers.__doc__ = PrunesPositions.prune_intermediate_layers.__doc__
        prune_intermediate_layers.__qualname__ = f"{cls.__qualname__}.prune_intermediate_layers"
        cls.prune_intermediate_layers = prune_intermediate_layers  # type: ignore[method-assign]

    def prune_intermediate_layers(self, *args: Any, **kwargs: Any) -> Any:
        """timm's ``prune_intermediate_layers``; the positional modules of the removed layers go with them."""
        kept = super().prune_intermediate_layers(*args, **kwargs)  # type: ignore[misc]
        prune_positions(self)  # type: ignore[arg-type]
        return kept
