"""A patched model's weights go wherever timm's go: EMA, safetensors, timm's loaders, higher-resolution
fine-tuning and moving a backbone from one scheme to another."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import safetensors.torch
import timm
import timm.models
import torch
from timm.utils import ModelEma, ModelEmaV2, ModelEmaV3

import vispos
from vispos._state import decode

SCHEMES_2D = [*vispos.list_encodings(2), ["learned2d", "rope2d_mixed"]]


def ids(scheme: str | list[str]) -> str:
    return scheme if isinstance(scheme, str) else "+".join(scheme)


def make(pos: str | list[str], *, img_size: int = 32, depth: int = 1, num_classes: int = 3, seed: int = 0, **options):
    torch.manual_seed(seed)
    model = timm.create_model("vit_tiny_patch16_224", img_size=img_size, depth=depth, num_classes=num_classes)
    return vispos.patch(model, pos, **options).eval()


def perturb(model: torch.nn.Module, seed: int = 1) -> None:
    """Move every floating weight, positional ones included, so that copies that missed an update differ."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))


def images(h: int = 32, w: int = 48) -> torch.Tensor:
    return torch.randn(2, 3, h, w, generator=torch.Generator().manual_seed(3))


# --- the state dict holds tensors only -------------------------------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES_2D, ids=ids)
def test_every_state_dict_value_is_a_tensor(scheme: str | list[str]) -> None:
    model = make(scheme)
    kinds = {k: type(v).__name__ for k, v in model.state_dict().items() if not isinstance(v, torch.Tensor)}
    assert not kinds
    names = [scheme] if isinstance(scheme, str) else scheme
    assert decode(model.state_dict()["vispos._extra_state"])["settings"]["pos"] == names


def test_a_sequence_model_state_dict_holds_tensors_only() -> None:
    layer = vispos.layers.Attention(dim=32, num_heads=4, pos="rope")
    vispos.configure(layer, scaling="yarn", original_length=16)
    vispos.set_position_enabled(layer, False)
    state = layer.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    fresh = vispos.layers.Attention(dim=32, num_heads=4, pos="rope")
    fresh.load_state_dict(state)
    assert fresh.enabled is False and fresh.pos.scaling == vispos.RopeScaling("yarn", original_length=16)


def test_the_settings_record_keeps_its_shape_when_the_position_switch_flips() -> None:
    """A model and its EMA copy differ in the DroPE switch once the schedule has dropped positions: their
    records must still have one shape, or an EMA's copy_ between them fails."""
    model = make("rope2d")
    on = model.state_dict()["vispos._extra_state"]
    vispos.set_position_enabled(model, False)
    off = model.state_dict()["vispos._extra_state"]
    assert on.shape == off.shape and not torch.equal(on, off)


# --- timm's EMA ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ema_class", [ModelEma, ModelEmaV2, ModelEmaV3], ids=lambda c: c.__name__)
@pytest.mark.parametrize("scheme", SCHEMES_2D, ids=ids)
def test_timm_ema_updates_and_evaluates_a_patched_model(scheme: str | list[str], ema_class: type) -> None:
    model = make(scheme)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # ModelEma (V1) is deprecated in timm
        ema = ema_class(model, decay=0.0)  # decay 0: after an update the average is the model itself
    average = ema.module if hasattr(ema, "module") else ema.ema
    perturb(model)
    vispos.set_position_enabled(model, False)  # DroPE has dropped positions on the model, not on the copy
    ema.update(model)
    vispos.set_position_enabled(model, True)
    with torch.no_grad():
        out = average(images())
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, model(images()), rtol=0, atol=1e-6)


# --- safetensors and timm's loaders ----------------------------------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES_2D, ids=ids)
def test_safetensors_round_trip_restores_outputs_exactly(scheme: str | list[str], tmp_path: Path) -> None:
    model = make(scheme)
    perturb(model)
    safetensors.torch.save_file(model.state_dict(), tmp_path / "w.safetensors")
    fresh = make(scheme, seed=5)
    fresh.load_state_dict(safetensors.torch.load_file(tmp_path / "w.safetensors"))  # strict
    with torch.no_grad():
        torch.testing.assert_close(fresh(images()), model(images()), rtol=1e-5, atol=1e-6)


def test_safetensors_save_model_keeps_the_inference_settings(tmp_path: Path) -> None:
    model = make("rope2d", theta=10.0)
    perturb(model)
    vispos.configure(model, scaling="yarn", log_n_attention=True)
    safetensors.torch.save_model(model, tmp_path / "w.safetensors")
    fresh = make("rope2d", theta=10.0, seed=5)
    missing, unexpected = safetensors.torch.load_model(fresh, tmp_path / "w.safetensors")
    assert not missing and not unexpected
    assert fresh.vispos_cfg == model.vispos_cfg and fresh.vispos.log_n_tokens == 4
    with torch.no_grad():
        torch.testing.assert_close(fresh(images(64, 48)), model(images(64, 48)), rtol=1e-5, atol=1e-6)


def test_timm_load_checkpoint_reads_a_patched_safetensors_file(tmp_path: Path) -> None:
    model = make(["learned2d", "relbias2d"])
    perturb(model)
    safetensors.torch.save_file(model.state_dict(), tmp_path / "w.safetensors")
    fresh = make(["learned2d", "relbias2d"], seed=5)
    timm.models.load_checkpoint(fresh, str(tmp_path / "w.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(fresh(images()), model(images()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
@pytest.mark.parametrize("how", ["pretrained_cfg_overlay", "checkpoint_path"])
def test_create_model_loads_a_patched_checkpoint_through_timm(how: str, suffix: str, tmp_path: Path) -> None:
    model = make("rope2d_mixed")
    perturb(model)
    file = tmp_path / f"w{suffix}"
    if suffix == ".safetensors":
        safetensors.torch.save_file(model.state_dict(), file)
    else:
        torch.save(model.state_dict(), file)
    kwargs = dict(img_size=32, depth=1, num_classes=3)
    if how == "checkpoint_path":
        kwargs["checkpoint_path"] = str(file)
    else:
        kwargs |= dict(pretrained=True, pretrained_cfg_overlay=dict(file=str(file), num_classes=3))
    loaded = vispos.create_model("vit_tiny_patch16_224", pos="rope2d_mixed", **kwargs).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(images()), model(images()), rtol=1e-5, atol=1e-6)


def test_pretrained_loading_with_another_class_count_drops_only_the_classifier(tmp_path: Path) -> None:
    """timm's rule for fine-tuning on another dataset: the head starts fresh, every other weight loads."""
    model = make("relbias2d")
    perturb(model)
    safetensors.torch.save_file(model.state_dict(), tmp_path / "w.safetensors")
    overlay = dict(file=str(tmp_path / "w.safetensors"), num_classes=3)
    loaded = vispos.create_model(
        "vit_tiny_patch16_224", pos="relbias2d", img_size=32, depth=1, num_classes=7, pretrained=True,
        pretrained_cfg_overlay=overlay,
    )  # fmt: skip
    source, target = model.state_dict(), loaded.state_dict()
    assert target["head.weight"].shape == (7, 192)
    for key, value in source.items():
        if not key.startswith("head."):
            torch.testing.assert_close(target[key], value, rtol=0, atol=0, msg=key)


# --- settings are compared in canonical form -------------------------------------------------------------
@pytest.mark.parametrize(
    ("saved", "loading"),
    [
        ({"theta": 100.0}, {}),  # the default, written out
        ({}, {"theta": 100}),  # an int for a float
        ({"scaling": "linear"}, {"scaling": {"type": "linear"}}),  # one scaling, two spellings
        ({"axes": "xy", "layout": "half"}, {}),
    ],
)
def test_equivalent_settings_load(saved: dict, loading: dict) -> None:
    model = make("rope2d", **saved)
    perturb(model)
    fresh = make("rope2d", seed=5, **loading)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fresh(images()), model(images()), rtol=1e-5, atol=1e-6)


def test_a_real_mismatch_is_still_refused_with_both_settings_named() -> None:
    state = make("rope2d", theta=10.0).state_dict()
    with pytest.raises(ValueError, match=r"are rope2d\(theta=10.0\) at a 2x2 .*; this model's are rope2d\(\) at a 2x2"):
        make("rope2d").load_state_dict(state)


# --- a checkpoint made at another grid: timm's higher-resolution fine-tuning path ------------------------
@pytest.mark.parametrize("scheme", SCHEMES_2D, ids=ids)
def test_a_checkpoint_from_a_smaller_grid_loads_resampled_and_computes_what_it_computed(scheme) -> None:
    """224 -> 384 (14x14 -> 24x24 tokens): learned tables are resampled as timm resamples pos_embed, Swin
    tables as Swin's loader does, cpb2d keeps the offsets its MLP learned on; so the loaded model computes
    at 384 exactly what the checkpoint's model computed at 384, and its training grid is its own."""
    small = make(scheme, img_size=224)
    perturb(small)
    large = make(scheme, img_size=384, seed=5)
    large.load_state_dict(small.state_dict())  # strict
    assert large.vispos.train_grid == (24, 24)
    assert tuple(large.vispos_cfg["train_grid"]) == (24, 24)
    x = images(384, 384)[:1]
    with torch.no_grad():
        torch.testing.assert_close(large(x), small(x), rtol=1e-5, atol=1e-5)
    resaved = make(scheme, img_size=384, seed=6)
    resaved.load_state_dict(large.state_dict())  # and the fine-tuned model saves and reloads at its own grid
    with torch.no_grad():
        torch.testing.assert_close(resaved(x), large(x), rtol=0, atol=0)


def test_a_plain_timm_checkpoint_of_another_size_loads_as_timms_filter_loads_it() -> None:
    """An unpatched model's 32 px checkpoint (2 x 2 grid) into a learned2d model patched at 64 px (4 x 4): its
    pos_embed resampled as timm's checkpoint_filter_fn resamples it for timm's model at 64 px."""
    torch.manual_seed(0)
    small = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=1, num_classes=3).eval()
    perturb(small)
    checkpoint = small.state_dict()
    reference = timm.create_model("vit_tiny_patch16_224", img_size=64, depth=1, num_classes=3).eval()
    reference.load_state_dict(timm.models.vision_transformer.checkpoint_filter_fn(checkpoint, reference))
    model = make("learned2d", img_size=64, seed=5)
    model.load_state_dict(checkpoint)  # strict
    x = images(64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no place for"):  # not a square grid: which one is unknowable
        make("learned2d", img_size=64).load_state_dict(checkpoint | {"pos_embed": checkpoint["pos_embed"][:, :4]})


def test_learned_tables_are_resampled_as_timm_resamples_pos_embed() -> None:
    small = make("learned2d", img_size=224)
    perturb(small)
    large = make("learned2d", img_size=384, seed=5)
    large.load_state_dict(small.state_dict())
    table = small.vispos.additive.table.detach().reshape(1, 14 * 14, -1)
    expected = timm.layers.resample_abs_pos_embed(table, new_size=[24, 24], num_prefix_tokens=0)
    torch.testing.assert_close(large.vispos.additive.table.reshape(1, 24 * 24, -1), expected, rtol=1e-5, atol=1e-6)


# --- moving a backbone from one scheme to another --------------------------------------------------------
def test_a_learned_ape_backbone_moves_to_rope_mixed_with_strict_false() -> None:
    """RoPE-ViT's recipe: a ViT trained with a learned pos_embed, fine-tuned as RoPE-Mixed. Every weight
    outside the positions loads; the positional parameters keep their initialisation; both are reported."""
    torch.manual_seed(1)
    ape = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=2, num_classes=3)
    perturb(ape)
    model = make("rope2d_mixed", depth=2, seed=5)
    initial = {k: v.clone() for k, v in model.vispos.state_dict().items()}
    result = model.load_state_dict(ape.state_dict(), strict=False)
    assert result.unexpected_keys == ["pos_embed"]
    assert sorted(result.missing_keys) == ["vispos.attention.0.freqs", "vispos.attention.1.freqs"]
    for key, value in ape.state_dict().items():
        if key != "pos_embed":
            torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=key)
    for key, value in model.vispos.state_dict().items():
        torch.testing.assert_close(value, initial[key], rtol=0, atol=0, msg=key)


def test_a_patched_backbone_moves_to_another_scheme_with_strict_false() -> None:
    source = make(["learned2d", "relbias2d"], depth=2)
    perturb(source)
    target = make("rope2d", depth=2, seed=5)
    with pytest.raises(ValueError, match=r"learned2d \+ relbias2d\(\) .*; this model's are rope2d\(\).*strict=False"):
        target.load_state_dict(source.state_dict())
    result = target.load_state_dict(source.state_dict(), strict=False)
    assert set(result.unexpected_keys) == {k for k in source.state_dict() if k.startswith("vispos.")}
    assert target.vispos_cfg["pos"] == ["rope2d"]
    for key, value in source.state_dict().items():
        if not key.startswith("vispos."):
            torch.testing.assert_close(target.state_dict()[key], value, rtol=0, atol=0, msg=key)


# --- no silent wrong results -----------------------------------------------------------------------------
def test_blocks_called_without_the_positional_context_refuse() -> None:
    model = make("rope2d", depth=2)
    x = images(32, 32)
    tokens = model._pos_embed(model.patch_embed(x))
    with pytest.raises(ValueError, match=r"needs the positional context.*model\.vispos_context"):
        model.blocks(tokens)
    ctx = model.vispos_context(x)
    out = tokens
    with torch.no_grad():  # both paths at inference (eager RoPE rotates in place there, not under autograd)
        for block in model.blocks:
            out = block(out, attn_mask=ctx)
        torch.testing.assert_close(model.norm(out), model.forward_features(x), rtol=0, atol=0)


@pytest.mark.parametrize("inherit", ["no", 0, None])
def test_inherit_takes_only_a_bool(inherit: object) -> None:
    model = timm.create_model("vit_small_patch16_rope_224", img_size=32, depth=1, num_classes=3)
    with pytest.raises(TypeError, match="inherit must be a bool"):
        vispos.patch(model, "rope2d", inherit=inherit)
    with pytest.raises(TypeError, match="inherit must be a bool"):
        vispos.create_model("vit_tiny_patch16_224", pos="rope2d", inherit=inherit, img_size=32, depth=1)


def test_a_checkpoint_in_the_dict_format_of_vispos_0_1_still_loads() -> None:
    model = make("rope2d", theta=10.0)
    perturb(model)
    state = model.state_dict()
    state["vispos._extra_state"] = {
        "settings": {"pos": ["rope2d"], "options": {"theta": 10.0}, "train_grid": [2, 2]},
        "enabled": False,
        "log_n_tokens": None,
    }
    state["vispos.attention._extra_state"] = {"train_grid": [2, 2], "scaling": None}
    fresh = make("rope2d", theta=10.0, seed=5)
    fresh.load_state_dict(state)
    assert fresh.vispos.enabled is False


def test_a_vispos_0_1_checkpoint_with_a_scaling_record_still_loads() -> None:
    """0.1 wrote YaRN's beta defaults into every type's record; a linear record must still load."""
    model = make("rope2d", theta=10.0)
    vispos.configure(model, scaling="linear")
    state = model.state_dict()
    old = {"type": "linear", "factor": None, "original_length": 2, "beta_fast": 32.0, "beta_slow": 1.0}
    state["vispos.attention._extra_state"] = {"train_grid": [2, 2], "scaling": old}
    fresh = make("rope2d", theta=10.0, seed=5)
    fresh.load_state_dict(state)
    assert fresh.vispos.attention.scaling_y == vispos.RopeScaling("linear", original_length=2)
