"""A patched timm model's forwards keep the signatures of the timm forwards they replace (``inspect.signature``,
what feature wrappers and training tools read), on every timm family patched through a class of vispos's own."""

from __future__ import annotations

import inspect

import pytest

import vispos

timm = pytest.importorskip("timm")

SMALL = dict(img_size=32, patch_size=8, depth=1, embed_dim=32, num_heads=2, num_classes=0)
MODELS = {
    "vit": lambda: timm.create_model("vit_tiny_patch16_224", **SMALL),
    "eva": lambda: timm.create_model("eva02_tiny_patch14_224", **SMALL),
    "beit": lambda: timm.create_model("beit_base_patch16_224", **SMALL),
    "relpos": lambda: timm.create_model("vit_relpos_base_patch16_224", **SMALL),
    "sam": lambda: timm.create_model("samvit_base_patch16", **SMALL, global_attn_indexes=(), neck_chans=16),
}
FORWARDS = ["forward", "forward_features", "forward_intermediates", "forward_head"]


@pytest.mark.parametrize("family", MODELS)
def test_patched_forwards_keep_timms_signatures(family) -> None:
    plain = MODELS[family]()
    model = vispos.patch(MODELS[family](), "rope2d")
    assert type(model) is not type(plain)
    for name in FORWARDS:
        assert inspect.signature(getattr(model, name)) == inspect.signature(getattr(plain, name)), name
