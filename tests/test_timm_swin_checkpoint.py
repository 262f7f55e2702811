"""Plain timm Swin / Swin V2 checkpoints into patched models (vispos/timm/swin_checkpoint.py): the same window,
another window (Swin's tables resized as timm's checkpoint_filter_fn does), and refusal without inheritance."""

from __future__ import annotations

import pytest
import timm
import timm.models.swin_transformer as swin_v1
import timm.models.swin_transformer_v2 as swin_v2
import torch

import vispos

V1, V2 = "swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256"
OWN = {V1: "relbias2d", V2: "cpb2d"}
FILTER = {V1: swin_v1.checkpoint_filter_fn, V2: swin_v2.checkpoint_filter_fn}


def build(name: str, img: int, window: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, img_size=img, window_size=window, embed_dim=32, depths=(2, 2),
                              num_heads=(2, 4), num_classes=0).eval()  # fmt: skip
    return model


def plain_checkpoint(name: str, img: int = 64, window: int = 4) -> dict[str, torch.Tensor]:
    """An unpatched model's state dict, relative tables / cpb MLPs and norms random so nothing is trivial."""
    model = build(name, img, window, seed=1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "relative_position_bias_table" in n or "cpb_mlp" in n or "logit_scale" in n:
                p.copy_(torch.randn_like(p) * 0.5)
            elif ".norm1.weight" in n or ".norm2.weight" in n:
                p.fill_(1.0)
    return model.state_dict()


def out(model: torch.nn.Module, img: int) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.randn(2, 3, img, img, generator=torch.Generator().manual_seed(img)))


@pytest.mark.parametrize("name", [V1, V2])
@pytest.mark.parametrize(("img", "window"), [(64, 4), (96, 6)], ids=["same-window", "other-window"])
def test_a_plain_timm_checkpoint_gives_timms_outputs(name, img, window):
    state = plain_checkpoint(name)
    reference = build(name, img, window)
    reference.load_state_dict(FILTER[name](dict(state), reference))
    model = vispos.patch(build(name, img, window), OWN[name])
    model.load_state_dict(dict(state))
    assert (out(reference, img) - out(model, img)).abs().max().item() <= 1e-5
    zeroed = {k: torch.zeros_like(v) if "relative_position_bias_table" in k or "cpb_mlp" in k else v
              for k, v in state.items()}  # fmt: skip
    control = vispos.patch(build(name, img, window), OWN[name])
    control.load_state_dict(zeroed)
    assert (out(reference, img) - out(control, img)).abs().max().item() > 1e-3  # the tables matter


@pytest.mark.parametrize("name", [V1, V2])
def test_a_vispos_checkpoint_still_loads(name):
    model = vispos.patch(build(name, 64, 4), OWN[name])
    model.load_state_dict(plain_checkpoint(name))
    other = vispos.patch(build(name, 64, 4, seed=3), OWN[name])
    other.load_state_dict(model.state_dict())
    assert (out(model, 64) - out(other, 64)).abs().max().item() == 0.0


def test_timms_bias_without_inheritance_is_refused_or_reported_unexpected():
    state = plain_checkpoint(V1)
    model = vispos.patch(build(V1, 64, 4), "rope2d", inherit=False)
    with pytest.raises(ValueError, match="has no place for"):
        model.load_state_dict(dict(state))
    result = model.load_state_dict(dict(state), strict=False)
    assert any("relative_position_bias_table" in k for k in result.unexpected_keys)
