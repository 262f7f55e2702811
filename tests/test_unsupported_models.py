"""A model vispos.patch does not take is refused with the full list of what it takes, NaFlexVit included."""

from __future__ import annotations

import pytest
import timm
import torch

import vispos

EVERY_HOST = (
    r"supports timm VisionTransformer, timm Eva, timm NaFlexVit, timm Beit, timm VisionTransformerRelPos, "
    r"timm SwinTransformer, timm SwinTransformerV2, timm SwinTransformerV2Cr, timm VisionTransformerSAM "
    r"\(and subclasses such as DeiT\)"
)


def test_an_unsupported_class_is_told_every_supported_one() -> None:
    with pytest.raises(TypeError, match=EVERY_HOST + "; got Linear"):
        vispos.patch(torch.nn.Linear(3, 3), "rope2d")


def test_every_model_the_message_names_is_patched() -> None:
    """The names come from the classes patch accepts: NaFlexVit, BEiT, relpos ViT, Swin, Swin V2, V2-CR and SAM are
    patched."""
    for name in ("naflexvit_base_patch16_gap", "beit_base_patch16_224", "vit_relpos_small_patch16_224"):
        model = timm.create_model(name, pretrained=False, depth=1, embed_dim=64, num_heads=2)
        assert vispos.patch(model, "relbias2d") is model and hasattr(model, "vispos")
    for name in ("swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256", "swinv2_cr_tiny_ns_224"):
        model = timm.create_model(name, pretrained=False, depths=(1,), num_heads=(2,), embed_dim=32, img_size=64)
        assert vispos.patch(model, "rope2d", inherit=False) is model and hasattr(model, "vispos")
    model = timm.create_model("samvit_base_patch16_224", pretrained=False, depth=1, embed_dim=64, num_heads=2)
    assert vispos.patch(model, "relbias2d", inherit=False) is model and hasattr(model, "vispos")
