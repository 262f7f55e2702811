"""``vispos.patch``: the one call, for a model of any host library vispos adapts.

A transformers model goes to ``vispos.hf`` (imported then, so vispos itself needs no transformers), a diffusers
transformer or pipeline to ``vispos.diffusers`` (likewise),
anything else to ``vispos.timm``, which names what it supports when it refuses a model.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from . import timm as timm_adapter


def _is_transformers_model(model: object) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__)


def _is_diffusers_model(model: object) -> bool:
    """A diffusers model or pipeline (a pipeline is no ``nn.Module``; its transformer is patched)."""
    return any(c.__module__.startswith("diffusers.") for c in type(model).__mro__)


def patch(
    model: nn.Module, pos: str | list[str] | tuple[str, ...], *, inherit: bool = True, **options: Any
) -> nn.Module:
    """Give a ViT the positional scheme ``pos`` (one name, or at most one additive, one attention and one
    conditional scheme): in place, returning the model, which then runs at any size its patches divide.

    timm models: ``vispos.timm.patch``. transformers vision models (ViT, DeiT, DINOv2, DINOv3, CLIP, SigLIP,
    their heads and two-tower models): ``vispos.hf.patch``. Both keep a model's own positions by default
    (``inherit=True``) and say with a ``PretrainedPositionsWarning`` what another scheme discards. diffusers
    transformers (FLUX, FLUX.2, Qwen-Image, Lumina 2, SD3, PixArt, DiT) or pipelines: ``vispos.diffusers.patch``,
    which keeps their own positions for ``vispos.configure`` to scale."""
    if _is_diffusers_model(model):
        from . import diffusers  # only here: diffusers is imported when a diffusers model is patched

        return diffusers.patch(model, pos, inherit=inherit, **options)
    if _is_transformers_model(model):
        from . import hf  # only here: transformers is imported when a transformers model is patched

        return hf.patch(model, pos, inherit=inherit, **options)
    return timm_adapter.patch(model, pos, inherit=inherit, **options)
