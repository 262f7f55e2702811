"""Former name of ``vispos.layers`` (it read like ``torch.nn`` when imported as ``nn``); kept as an alias."""

from __future__ import annotations

from .layers import Attention

__all__ = ["Attention"]
