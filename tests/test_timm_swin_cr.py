"""timm's Swin V2-CR patched by vispos (vispos/timm/swin_cr.py): its meta_mlp inherited as cpb2d.

Reference: timm's own model on the same weights (inheritance, set_input_size, intermediates)."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import timm
import torch

import vispos
from vispos.timm import PretrainedPositionsWarning

NAME = "swinv2_cr_tiny_ns_224"


def tiny(**kwargs) -> torch.nn.Module:
    """A two-stage Swin V2-CR at 56 px (14 x 14 patches, 7 x 7 windows, shifted in stage 0), meta MLPs, logit
    scales and biases random; the res-post-norms (init_values) set to 1 so that no block is an identity."""
    torch.manual_seed(0)
    kwargs = dict(pretrained=False, img_size=56, window_size=7, embed_dim=32, depths=(2, 2), num_heads=(2, 4),
                  init_values=1.0, num_classes=3) | kwargs  # fmt: skip
    model = timm.create_model(NAME, **kwargs).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "meta_mlp" in n or "logit_scale" in n:
                p.normal_(std=0.5)
            elif n.endswith(".bias") or n.startswith("head"):  # timm zeroes the head and every Linear's bias
                p.normal_(std=0.1)
    return model


def pair(**kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    original = tiny(**kwargs)
    return original, copy.deepcopy(original)


def max_diff(a: torch.nn.Module, b: torch.nn.Module, size: int = 56) -> float:
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(size))
    with torch.no_grad():
        return (a(x) - b(x)).abs().max().item()


def test_inherited_meta_mlp_gives_timms_outputs():
    original, model = pair()
    fresh = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inheriting says nothing
        vispos.patch(model, "cpb2d")
        vispos.patch(fresh, "cpb2d", inherit=False)
    assert max_diff(original, model) <= 1e-5
    assert max_diff(original, fresh) > 1e-3  # negative control: fresh MLPs change the outputs
    cfg = model.vispos_cfg
    assert cfg["inherited"]["from"] == "timm SwinTransformerV2Cr: Swin V2-CR's meta_mlp"
    assert cfg["options"] | {"coords": "log", "output": "linear", "out_bias": True, "hidden": 384} == cfg["options"]
    kept = {k for k in original.state_dict() if "meta_mlp" not in k}
    assert kept <= set(model.state_dict())  # timm's keys (logit_scale included) stay


def test_set_input_size_gives_timms_outputs_after_the_same_call():
    original, model = pair()
    vispos.patch(model, "cpb2d")
    for m in (original, model):
        m.set_input_size(img_size=(84, 84), window_size=6)
    assert model.vispos_cfg["windows"] == [(6, 6), (6, 6)]
    assert max_diff(original, model, 84) <= 1e-5


@pytest.mark.parametrize("other", ["rope2d", "relbias2d", "learned2d"])
def test_another_scheme_says_the_bias_is_discarded(other):
    _, model = pair()
    with pytest.warns(PretrainedPositionsWarning, match="own relative position bias .*meta_mlp.* is discarded"):
        vispos.patch(model, other)
    _, fresh = pair()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vispos.patch(fresh, other, inherit=False)


def test_a_changed_option_starts_cpb2d_fresh_with_a_warning():
    original, model = pair()
    with pytest.warns(PretrainedPositionsWarning, match="starts fresh"):
        vispos.patch(model, "cpb2d", hidden=64)
    assert "inherited" not in model.vispos_cfg and max_diff(original, model) > 1e-3


@pytest.mark.parametrize("scheme", vispos.list_encodings(ndim=2))
def test_every_2d_scheme_runs_at_two_sizes(scheme):
    _, model = pair()
    vispos.patch(model, scheme, inherit=False)
    model.train()
    for size in (56, 84):  # 84: 21 x 21 patches, windows padded
        out = model(torch.randn(2, 3, size, size))
        assert out.shape == (2, 3) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n.startswith("vispos.") and p.requires_grad
               and "conditional" not in n)  # fmt: skip


def test_forward_intermediates_are_timms():
    original, model = pair()
    vispos.patch(model, "cpb2d")
    x = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        want_final, want = original.forward_intermediates(x)
        got_final, got = model.forward_intermediates(x)
        torch.testing.assert_close(got_final, want_final, atol=1e-5, rtol=0)
        assert [t.shape for t in got] == [t.shape for t in want]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
        assert len(model.forward_intermediates(x, indices=[0], stop_early=True, intermediates_only=True)) == 1


def test_the_inherited_state_dict_loads_into_cpb2d_with_its_options_and_pickles():
    """The options recorded are the meta MLP's: a model patched fresh with them takes the inherited weights and gives
    timm's outputs; deep copy and pickle keep the class and the outputs."""
    original, model = pair()
    vispos.patch(model, "cpb2d")
    _, fresh = pair()
    vispos.patch(fresh, "cpb2d", inherit=False, **model.vispos_cfg["options"])
    fresh.load_state_dict(model.state_dict())
    assert max_diff(original, fresh) <= 1e-5
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(clone) is type(model) and max_diff(model, clone) == 0.0


@pytest.mark.parametrize("size", [56, 112], ids=["same-size", "112px"])
def test_a_plain_timm_checkpoint_loads_at_its_size_and_another(size):
    """timm's state dict of the 56 px model into a patched model built at ``size`` (windows of 7 either way): its
    meta MLPs go to cpb2d, and the outputs are timm's model at ``size`` that loaded the same state dict."""
    checkpoint = tiny().state_dict()
    reference = tiny(img_size=size)
    reference.load_state_dict(checkpoint)
    model = vispos.patch(copy.deepcopy(reference), "cpb2d")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.startswith("vispos."):
                p.zero_()  # the control: loading must bring the meta MLPs back
    assert max_diff(reference, model, size) > 1e-3
    model.load_state_dict(checkpoint)  # strict
    assert max_diff(reference, model, size) <= 1e-5


def test_a_plain_timm_checkpoint_is_refused_without_a_place_for_its_meta_mlp():
    checkpoint = tiny().state_dict()
    model = vispos.patch(tiny(), "rope2d", inherit=False)
    with pytest.raises(ValueError, match="Swin V2-CR's meta_mlp, which this model .* has no place for"):
        model.load_state_dict(checkpoint)
    result = model.load_state_dict(checkpoint, strict=False)
    assert "stages.0.blocks.0.attn.meta_mlp.fc1.weight" in result.unexpected_keys


def test_fx_feature_extraction():
    from timm.models import create_feature_extractor

    _, model = pair()
    vispos.patch(model, "rope2d_mixed", inherit=False)
    extractor = create_feature_extractor(model, return_nodes={"run_stage": "stage0", "permute_2": "out"})
    x = torch.randn(1, 3, 56, 56)
    with torch.no_grad():
        out = extractor(x)
        torch.testing.assert_close(out["out"], model.forward_features(x), rtol=0, atol=0)
        assert out["stage0"].shape == (1, 14, 14, 32)
