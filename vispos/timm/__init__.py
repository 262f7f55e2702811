"""The timm adapter: the only part of vispos that knows timm.

- ``patching.py``: ``patch`` / ``create_model``: which timm model families are accepted, and how their
  prefix tokens, grids and own tables flow into ``vispos.positions.Positions``.
- ``model.py``: ``PatchedViT``, the class a patched model takes (its ``_pos_embed``, ``forward_features``
  and ``forward_intermediates``), made once per timm class and found again by pickle.
- ``inherit.py``: a timm model's own RoPE (RoPE-ViT, EVA-02, DINOv3, PE) as ``rope2d`` / ``rope2d_mixed``
  options, which ``patch`` keeps by default, and the warnings when options or schemes discard it.
- ``attention.py``: ``PatchedAttention``, which adopts a timm attention's weights and applies the
  positions; its ``positioned`` method is the one q/k path that both ``forward`` and the diagnostics use.
"""

from __future__ import annotations

from .attention import SUPPORTED_ATTENTION, PatchedAttention
from .inherit import PretrainedPositionsWarning
from .model import PatchedViT, patched_class
from .patching import SUPPORTED_MODELS, create_model, patch

__all__ = [
    "PretrainedPositionsWarning",
    "SUPPORTED_ATTENTION", "SUPPORTED_MODELS", "PatchedAttention", "PatchedViT", "create_model", "patch",
    "patched_class",
]  # fmt: skip
