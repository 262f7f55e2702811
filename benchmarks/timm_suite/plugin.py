"""A pytest plugin that runs timm's own model tests (its repository's ``tests/test_models.py``, from a local
checkout, unmodified) on vispos-patched models.

Loaded with ``-p benchmarks.timm_suite.plugin`` (``make timm-tests TIMM_SRC=...``), it wraps
``timm.create_model`` before timm's test module is collected (that module imports the name), so that every
model of the families below comes back patched. ``VISPOS_SCHEME`` picks the scheme: ``inherit`` (the default)
gives each model the scheme its own positions are (Swin: relbias2d, Swin V2: cpb2d, BEiT: relbias2d, relpos
ViT: relbias2d or cpb2d, Eva: its RoPE, ViT: learned2d); any other name replaces them."""

from __future__ import annotations

import fnmatch
import functools
import os
from typing import Any

import pytest
import timm
from torch import nn

import vispos

FAMILIES = ("swin_*", "swinv2_*", "beit*", "vit_relpos_*", "vit_srelpos_*", "vit_*", "deit*", "eva*")


def own_scheme(model: nn.Module) -> str:
    """The vispos scheme a timm model's own positions are."""
    from timm.models.beit import Beit
    from timm.models.vision_transformer_relpos import VisionTransformerRelPos

    from vispos.timm.beit import own_bias
    from vispos.timm.inherit import own_rope
    from vispos.timm.relpos import own_relative_bias
    from vispos.timm.swin import OWN_BIAS

    if type(model) in OWN_BIAS:
        return OWN_BIAS[type(model)][0]
    if isinstance(model, Beit):
        own = own_bias(model)
        return own[0].scheme if own is not None else "learned2d"
    if isinstance(model, VisionTransformerRelPos):
        return own_relative_bias(model).scheme
    own = own_rope(model)
    return own.scheme if own is not None else "learned2d"


def patched(create: Any, name: str, *args: Any, **kwargs: Any) -> nn.Module:
    chosen = any(fnmatch.fnmatch(name, f) for f in FAMILIES)
    if chosen and kwargs.get("features_only"):  # timm's feature wrapper, not a model vispos patches
        pytest.skip("features_only: timm wraps the model in a feature net, which vispos.patch does not take")
    model = create(name, *args, **kwargs)
    if not chosen:
        return model
    scheme = os.environ.get("VISPOS_SCHEME", "inherit")
    return vispos.patch(model, own_scheme(model) if scheme == "inherit" else scheme)


def pytest_configure(config: pytest.Config) -> None:  # noqa: ARG001
    wrapped = functools.wraps(timm.create_model)(functools.partial(patched, timm.create_model))
    timm.create_model = wrapped
    timm.models.create_model = wrapped
