"""The timm adapter: the only part of vispos that knows timm.

- ``patching.py``: ``patch`` / ``create_model`` (which timm model families, how prefix tokens, grids and
  the model's own tables flow into ``vispos.positions.Positions``), the instance-bound replacements
  of ``_pos_embed``, ``forward_features`` and ``forward_intermediates``.
- ``attention.py``: ``PatchedAttention``, which adopts a timm attention's weights and applies the
  positions; its ``positioned`` method is the one q/k path that both ``forward`` and the diagnostics use.
"""

from __future__ import annotations

from .attention import SUPPORTED_ATTENTION, PatchedAttention
from .patching import SUPPORTED_MODELS, create_model, patch

__all__ = ["SUPPORTED_ATTENTION", "SUPPORTED_MODELS", "PatchedAttention", "create_model", "patch"]
