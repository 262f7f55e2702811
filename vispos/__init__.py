"""vispos: positional encodings for Vision Transformers (and token sequences), on any timm ViT.

Layout (one idea per module; only ``vispos.timm`` imports timm):

- ``registry``: scheme name -> builder with its properties as data; ``encodings/``: the catalogue,
  one file per family, each scheme registered beside its class.
- ``attention``: SDPA / Shaw maths; ``positions``: the per-forward positional context of a 2D model;
  ``layers``: sequence attention with any 1D scheme; ``configure``: RoPE and log-n scaling, on/off
  switch, for any module tree; ``drope``: the DroPE schedule.
- ``timm``: ``patch`` / ``create_model`` and the patched attention; ``diagnostics``: logit maps and
  the relative / cross-term measures.
"""

from __future__ import annotations

from . import diagnostics, drope, layers
from .configure import configure, set_position_enabled
from .encodings.rope_scaling import SCALING_TYPES, RopeScaling
from .registry import SchemeInfo, create_encoding, describe, get_info, list_encodings
from .timm import PretrainedPositionsWarning, create_model, patch

__all__ = [
    "PretrainedPositionsWarning",
    "RopeScaling",
    "SCALING_TYPES",
    "SchemeInfo",
    "configure",
    "create_encoding",
    "create_model",
    "describe",
    "diagnostics",
    "drope",
    "get_info",
    "layers",
    "list_encodings",
    "patch",
    "set_position_enabled",
]
__version__ = "0.2.0"  # the package version (pyproject.toml reads it); CHANGELOG.md lists its changes
