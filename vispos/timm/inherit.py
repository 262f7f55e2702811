"""What a timm model's own RoPE is, in vispos's options: the conventions its pretrained weights assume.

timm's RoPE families differ in axis order, pair layout, coordinates and frequencies (read from timm's
``layers/pos_embed_sincos.py``); each maps onto ``rope2d`` / ``rope2d_mixed`` options:

- ``RotaryEmbeddingCat`` on an index grid -> ``rope2d`` with ``coords="pixel"``: RoPE-ViT axial (x
  first), EVA-02 and timm's ``vit_*_rope_reg*`` (y first, reference grid), PE (x first, offset 1,
  reference grid).
- ``RotaryEmbeddingDinoV3`` -> ``rope2d`` with ``coords="normalized"`` (DINOv3).
- ``RotaryEmbeddingMixed`` -> ``rope2d_mixed`` with the learned ``freqs`` (RoPE-ViT mixed).

timm's ``grid_indexing="ij"`` puts y first (``axes="yx"``), ``"xy"`` puts x first; ``rotate_half``
selects the half layout, otherwise pairs are interleaved.
"""

from __future__ import annotations

from typing import Any

import timm
import torch
from timm.layers.pos_embed_sincos import (
    RotaryEmbedding,
    RotaryEmbeddingCat,
    RotaryEmbeddingDinoV3,
    RotaryEmbeddingMixed,
)
from torch import nn

from ..host import OwnRope, PretrainedPositionsWarning, adopt_freqs, merge_options, warn

__all__ = ["OwnRope", "PretrainedPositionsWarning", "adopt_freqs", "merge_options", "own_rope", "timm_freqs", "warn"]

# timm < 1.0.31's RotaryEmbeddingDinoV3 puts y first whatever its grid_indexing; 1.0.31 honours "xy"
_DINOV3_HONOURS_XY = tuple(int(p) for p in timm.__version__.split(".")[:3] if p.isdigit()) >= (1, 0, 31)


def _augmentation(rope: nn.Module) -> dict[str, float]:
    names = ("shift_coords", "jitter_coords", "rescale_coords")
    return {n: float(getattr(rope, n)) for n in names if getattr(rope, n, None) is not None}


def _axes(rope: nn.Module) -> str:
    return "yx" if rope.grid_indexing == "ij" else "xy"


def own_rope(model: nn.Module) -> OwnRope | None:
    """The RoPE a timm model (``Eva`` family) carries, or None. Raises for a RoPE vispos cannot reproduce."""
    rope = getattr(model, "rope", None)
    if rope is None:
        return None
    source = f"timm {type(rope).__name__}"
    if isinstance(rope, (RotaryEmbeddingCat, RotaryEmbedding)):
        grid_type = getattr(rope, "grid_type", "index")  # timm < 1.0.31 has index grids only
        if grid_type != "index":
            raise ValueError(
                f"this model's RoPE ({source} with grid_type={grid_type!r}, pixel-frequency bands) has no "
                "vispos equivalent; patch(model, ..., inherit=False) replaces it with a fresh scheme"
            )
        options: dict[str, Any] = {
            "theta": float(rope.temperature),
            "coords": "pixel",
            "axes": _axes(rope),
            "layout": "half" if rope.rotate_half else "interleaved",
            "offset": float(rope.grid_offset),
            "ref_grid": None if rope.ref_feat_shape is None else tuple(int(s) for s in rope.ref_feat_shape),
        }
        return OwnRope("rope2d", options | _augmentation(rope), source)
    if isinstance(rope, RotaryEmbeddingDinoV3):
        options = {
            "coords": "normalized",
            "axes": _axes(rope) if _DINOV3_HONOURS_XY else "yx",
            "layout": "half" if rope.rotate_half else "interleaved",
            "offset": float(rope.grid_offset),
            "normalize": rope.normalize_coords,
        }
        if rope.min_period is not None and rope.max_period is not None:
            options |= {"min_period": float(rope.min_period), "max_period": float(rope.max_period)}
        else:
            options["theta"] = float(rope.temperature)
        return OwnRope("rope2d", options | _augmentation(rope), source)
    if isinstance(rope, RotaryEmbeddingMixed):
        order = _axes(rope)
        options = {"theta": float(rope.temperature), "coords": "pixel", "layout": "interleaved", "offset": 0.0}
        return OwnRope("rope2d_mixed", options | _augmentation(rope), source, timm_freqs(rope.freqs, order), order)
    raise ValueError(
        f"this model's RoPE ({source}) has no vispos equivalent; "
        "patch(model, ..., inherit=False) replaces it with a fresh scheme"
    )


def timm_freqs(freqs: torch.Tensor, order: str) -> torch.Tensor:
    """timm's RoPE-Mixed ``freqs`` [2, depth, heads, d/2] in vispos's (x, y) component order."""
    freqs = freqs.detach()
    return freqs.flip(0) if order == "yx" else freqs
