"""A model vispos.patch does not take is refused with the full list of what it takes, NaFlexVit included."""

from __future__ import annotations

import pytest
import timm
import torch

import vispos

EVERY_HOST = (
    r"supports timm VisionTransformer, timm Eva, timm NaFlexVit, timm Beit, timm VisionTransformerSAM "
    r"\(and subclasses such as DeiT\)"
)


def test_an_unsupported_class_is_told_every_supported_one() -> None:
    with pytest.raises(TypeError, match=EVERY_HOST + "; got Linear"):
        vispos.patch(torch.nn.Linear(3, 3), "rope2d")


def test_a_model_with_its_own_relative_bias_is_told_every_supported_one() -> None:
    model = timm.create_model("vit_relpos_small_patch16_224", pretrained=False, depth=1, embed_dim=64, num_heads=2)
    own = r"VisionTransformerRelPos \(vit_relpos_\* / vit_srelpos_\*\) has a relative position bias .*"
    with pytest.raises(TypeError, match=own + EVERY_HOST):
        vispos.patch(model, "rope2d")


def test_every_model_the_message_names_is_patched() -> None:
    """The names come from the classes patch accepts: a NaFlexVit, a BEiT and a SAM are patched, not refused."""
    for name in ("naflexvit_base_patch16_gap", "beit_base_patch16_224", "samvit_base_patch16_224"):
        model = timm.create_model(name, pretrained=False, depth=1, embed_dim=64, num_heads=2)
        assert vispos.patch(model, "relbias2d", inherit=False) is model and hasattr(model, "vispos")
