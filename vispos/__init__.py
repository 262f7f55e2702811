"""vispos: positional encodings for Vision Transformers (and token sequences), on timm and transformers ViTs and
diffusers' diffusion transformers.

Layout (one idea per module; only ``vispos.timm`` imports timm, only ``vispos.hf`` transformers, only
``vispos.diffusers`` diffusers):

- ``registry``: scheme name -> builder with its properties as data; ``encodings/``: the catalogue,
  one file per family, each scheme registered beside its class.
- ``attention``: SDPA / Shaw maths; ``positions/``: the per-forward positional context of a 2D model
  (the context, the settings record, context building, per-layer masks, token embedding);
  ``layers``: sequence attention with any 1D scheme; ``configure``: RoPE and log-n scaling, on/off
  switch, for any module tree; ``drope``: the DroPE schedule.
- ``api``: ``patch`` for any host; ``host``: what the adapters share (scheme planning, building
  ``Positions``); ``timm``: ``patch`` / ``create_model`` and the patched attention on timm models; ``hf``:
  the same on transformers vision models (imported when one is patched); ``diffusers``: diffusion transformers'
  own positions kept and scaled (per-axis RoPE scaling, DyPE, sin-cos interpolation; imported when one is
  patched); ``diagnostics``: logit maps and the relative / cross-term measures.
"""

from __future__ import annotations

from . import diagnostics, drope, layers
from .api import patch
from .configure import configure, set_position_enabled
from .encodings.rope_scaling_setting import SCALING_TYPES, RopeScaling
from .host import PretrainedPositionsWarning
from .registry import SchemeInfo, create_encoding, describe, get_info, list_encodings
from .timm import create_model

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
