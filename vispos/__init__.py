"""vispos: positional encodings for Vision Transformers (and token sequences), on any timm ViT."""

from __future__ import annotations

from . import diagnostics, drope, nn  # noqa: E402  (public submodules)
from .encodings.rope_scaling import SCALING_TYPES, RopeScaling
from .patch import configure, create_model, patch, set_position_enabled
from .registry import SchemeInfo, create_encoding, describe, get_info, list_encodings

__all__ = [
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
    "list_encodings",
    "nn",
    "patch",
    "set_position_enabled",
]
__version__ = "0.1.0"
