"""timm's model protocols on patched models: ``prune_intermediate_layers`` (timm's feature-extraction path:
``features_only``, detection backbones) keeps each tap as the unpruned model gives it and leaves no parameter
without a gradient (the positional modules of removed blocks or stages go with them); timm's
``reinit_non_persistent_buffers`` (after ``to_empty``) restores what a checkpoint does not hold."""

from __future__ import annotations

import copy
import inspect

import pytest
import timm
import torch
from timm.models.vision_transformer_sam import VisionTransformerSAM

import vispos

VIT = dict(pretrained=False, img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=3)
SWIN = dict(pretrained=False, img_size=56, embed_dim=16, depths=(1, 1), num_heads=(1, 2), window_size=7,
            num_classes=3)  # fmt: skip
SAM = dict(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2, window_size=2, global_attn_indexes=(1,),
           use_rel_pos=True, neck_chans=16, num_classes=3)  # fmt: skip
CASES = {  # id: (build, scheme, inherit)
    "vit-relbias2d": (lambda: timm.create_model("vit_tiny_patch16_224", **VIT), "relbias2d", False),
    "beit-inherited": (lambda: timm.create_model("beit_base_patch16_224", **VIT), "relbias2d", True),
    "relpos-inherited": (lambda: timm.create_model("vit_relpos_small_patch16_224", **VIT), "cpb2d", True),
    "sam-inherited": (lambda: VisionTransformerSAM(**SAM), ["learned2d", "decomposed2d"], True),
    "swin-inherited": (lambda: timm.create_model("swin_tiny_patch4_window7_224", **SWIN), "relbias2d", True),
    "swinv2-rope2d": (lambda: timm.create_model("swinv2_tiny_window8_256", **SWIN), "rope2d", False),
    "swinv2_cr-inherited": (lambda: timm.create_model("swinv2_cr_tiny_224", **SWIN), "cpb2d", True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pruned_patched_model_keeps_its_taps_and_uses_every_parameter(case: str) -> None:
    build, scheme, inherit = CASES[case]
    torch.manual_seed(0)
    plain = build().eval()
    model = vispos.patch(copy.deepcopy(plain), scheme, inherit=inherit)
    assert inspect.signature(model.prune_intermediate_layers) == inspect.signature(plain.prune_intermediate_layers)
    x = torch.randn(2, 3, *model.pretrained_cfg["input_size"][-2:]) if "swin" in case else torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        taps = model.forward_intermediates(x, intermediates_only=True)
    pruned = copy.deepcopy(model)
    take = pruned.prune_intermediate_layers([0])
    with torch.no_grad():
        torch.testing.assert_close(pruned.forward_intermediates(x, indices=take, intermediates_only=True)[0], taps[0])
    pruned.train()
    outputs = [*pruned.forward_intermediates(x, indices=take, intermediates_only=True), pruned.forward_features(x)]
    sum(t.sum() for t in outputs).backward()
    unused = [n for n, p in pruned.named_parameters() if p.requires_grad and p.grad is None]
    assert not unused, f"parameters without a gradient after pruning: {unused}"


def test_timms_buffer_reinit_restores_a_patched_swin_v2() -> None:
    """timm's step after ``to_empty``: load the weights, then ``reinit_non_persistent_buffers`` for the buffers a
    checkpoint does not hold. A patched Swin V2 whose buffers were left as garbage (NaN) comes back to its outputs,
    as timm's own model does."""
    from timm.models._manipulate import reinit_non_persistent_buffers

    torch.manual_seed(0)
    model = vispos.patch(timm.create_model("swinv2_tiny_window8_256", **SWIN).eval(), "rope2d", inherit=False)
    empty = copy.deepcopy(model)
    with torch.no_grad():
        for buffer in empty.buffers():
            if buffer.is_floating_point():
                buffer.fill_(float("nan"))
    empty.load_state_dict(model.state_dict())
    reinit_non_persistent_buffers(empty)
    x = torch.randn(1, 3, 56, 56)
    with torch.no_grad():
        torch.testing.assert_close(empty(x), model(x))


@pytest.mark.parametrize(
    ("name", "own"),
    [
        ("swin_tiny_patch4_window7_224", "relbias2d"),
        ("swinv2_tiny_window8_256", "cpb2d"),
        ("swinv2_cr_tiny_224", "cpb2d"),
    ],
)
def test_a_swin_built_on_the_meta_device_inherits_its_bias_and_loads(name: str, own: str) -> None:
    """timm's way of building a model before its weights: on the meta device, patched inheriting its bias, then
    ``to_empty``, the weights loaded and the non-persistent buffers reinitialised: the outputs of the model patched
    on the CPU."""
    from timm.models._manipulate import reinit_non_persistent_buffers

    torch.manual_seed(0)
    model = vispos.patch(timm.create_model(name, **SWIN).eval(), own)
    empty = vispos.patch(timm.create_model(name, device="meta", **SWIN).eval(), own).to_empty(device="cpu")
    empty.load_state_dict(model.state_dict())
    reinit_non_persistent_buffers(empty)
    x = torch.randn(1, 3, 56, 56)
    with torch.no_grad():
        torch.testing.assert_close(empty(x), model(x))


def test_a_sam_built_on_the_meta_device_inherits_its_tables_and_loads() -> None:
    """The same for SAM: its ``pos_embed`` (learned2d) and decomposed tables (decomposed2d) inherited on meta."""
    from timm.models._manipulate import reinit_non_persistent_buffers

    torch.manual_seed(0)
    own = ["learned2d", "decomposed2d"]
    model = vispos.patch(VisionTransformerSAM(**SAM).eval(), own)
    with torch.device("meta"):
        empty = VisionTransformerSAM(**SAM).eval()
    empty = vispos.patch(empty, own).to_empty(device="cpu")
    empty.load_state_dict(model.state_dict())
    reinit_non_persistent_buffers(empty)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(empty(x), model(x))
