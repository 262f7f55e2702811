"""The positional part of a patched 2D model, independent of any model library.

``Positions`` holds at most one additive, one attention and one conditional scheme and builds, once per
forward and from the actual patch grid, a ``PositionContext``: what every layer's attention needs
(rotations, additive masks, a logit scale). Hosts (the timm adapter) hand that context to their attention
layers, and apply the conditional scheme (``apply_conditional``) to the tokens after its block.

Layout: ``context`` (``PositionContext``), ``settings`` (the settings record: canonical options, saving and
loading), ``contexts`` (building the context on one grid, a token subset or a ragged batch), ``masks``
(each layer's rotation or bias mask, FlexAttention's bias), ``embedding`` (additive tables, ``embed``,
the conditional scheme) and ``module`` (``Positions``, assembled from those).
"""

from __future__ import annotations

from .context import PositionContext
from .module import Positions
from .settings import canonical_options, differing_options, own_records, plain, position_differences, same_positions

__all__ = [
    "PositionContext",
    "Positions",
    "canonical_options",
    "differing_options",
    "own_records",
    "plain",
    "position_differences",
    "same_positions",
]
