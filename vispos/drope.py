"""DroPE: train with positions, then drop them for the last part of training (any scheme).

The idea (from the "train short, test long" literature): positional information speeds up learning,
but a model that finishes training without it no longer depends on positions it has never seen.
``DroPE`` is a tiny schedule any loop can call once per step:

    drope = vispos.drope.DroPE(model, drop_at=int(0.8 * total_steps))
    for step in range(total_steps):
        drope.step(step)
        ...

It works on timm models patched by vispos and on any module tree containing ``vispos.layers.Attention``
layers; evaluation after training keeps positions off.
"""

from __future__ import annotations

from torch import nn

from ._validate import check_int
from .layers import Attention
from .positions import Positions


def set_enabled(module: nn.Module, enabled: bool) -> int:
    """Switch every vispos positional scheme under ``module``; returns how many were switched."""
    count = 0
    for m in module.modules():
        if isinstance(m, (Positions, Attention)):
            m.enabled = enabled
            count += 1
    return count


class DroPE:
    """Positions on before step ``drop_at``, off from it on."""

    def __init__(self, model: nn.Module, *, drop_at: int) -> None:
        self.model = model
        self.drop_at = check_int("drop_at", drop_at, minimum=0)
        if set_enabled(model, True) == 0:
            raise ValueError("no vispos positional scheme found in the model (patch it or use vispos.layers.Attention)")

    def step(self, step: int) -> bool:
        """Apply the schedule for ``step``; returns whether positions are on."""
        enabled = check_int("step", step, minimum=0) < self.drop_at
        set_enabled(self.model, enabled)
        return enabled
