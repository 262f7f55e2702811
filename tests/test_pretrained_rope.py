"""Pretrained RoPE models keep what they learned: ``vispos.patch`` inherits a timm model's own RoPE.

Every timm RoPE family (random init, layer scales set to 1 so positions matter) must give the original
model's features after patching, at the native size, at 1.5x and at a non-square size; a fresh RoPE
must not (so the comparison can fail). Overrides and discarded positions are said by warnings, checked
by their text.
"""

from __future__ import annotations

import warnings

import pytest
import timm
import torch

import vispos
from vispos import PretrainedPositionsWarning

# (model, image size, patch size): small images and two blocks keep the suite fast; the RoPE settings
# (axis order, layout, theta, offsets, reference grid, APE, prefix tokens) are each family's own.
FAMILIES = [
    ("vit_small_patch16_rope_224", 64, 16),  # RoPE-ViT axial: x first, interleaved, theta 100
    ("vit_small_patch16_rope_ape_224", 64, 16),  # ... with a learned APE (no class-token entry)
    ("vit_small_patch16_rope_mixed_224", 64, 16),  # RoPE-Mixed: learned per-layer frequencies
    ("vit_small_patch16_rope_mixed_ape_224", 64, 16),
    ("eva02_tiny_patch14_224", 56, 14),  # EVA-02: y first, theta 1e4, reference grid 16 (here != the grid)
    ("vit_medium_patch16_rope_reg1_gap_256", 64, 16),  # timm's Eva RoPE with a register token
    ("vit_small_patch16_dinov3", 64, 16),  # DINOv3: normalized coords, y first, half layout, 4 registers
    ("vit_pe_core_tiny_patch16_384", 64, 16),  # PE core: x first, grid offset 1, APE with a class entry
    ("vit_pe_spatial_tiny_patch16_512", 64, 16),  # PE spatial
]


def layer_scales_to_one(model: torch.nn.Module) -> torch.nn.Module:
    """timm initialises layer scales at 1e-5, which would hide any difference in the attention."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("gamma_1", "gamma_2", "ls1.gamma", "ls2.gamma")):
                param.fill_(1.0)
    return model


def timm_pair(name: str, img: int, **kwargs: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The original and an identical copy (same weights) to patch."""
    torch.manual_seed(0)
    make = dict(depth=2, img_size=img, num_classes=0, dynamic_img_size=True) | kwargs
    original = layer_scales_to_one(timm.create_model(name, **make)).eval()
    copy = timm.create_model(name, **make).eval()
    copy.load_state_dict(original.state_dict())
    return original, copy


def scheme_of(name: str) -> str:
    return "rope2d_mixed" if "mixed" in name else "rope2d"


def sizes(img: int, patch: int) -> list[tuple[int, int]]:
    up = img * 3 // 2 // patch * patch
    return [(img, img), (up, up), (img // 2 // patch * patch or patch, img)]


def max_difference(a: torch.nn.Module, b: torch.nn.Module, size: tuple[int, int]) -> float:
    torch.manual_seed(1)
    image = torch.randn(2, 3, *size)
    with torch.no_grad():
        return (a.forward_features(image) - b.forward_features(image)).abs().max().item()


@pytest.mark.parametrize(("name", "img", "patch"), FAMILIES)
def test_inherited_rope_reproduces_the_original_at_every_size(name, img, patch):
    original, model = timm_pair(name, img)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inheriting says nothing
        vispos.patch(model, scheme_of(name))
    for size in sizes(img, patch):
        assert max_difference(original, model, size) <= 1e-5, size


@pytest.mark.parametrize(("name", "img", "patch"), FAMILIES)
def test_a_fresh_rope_differs_so_the_comparison_can_fail(name, img, patch):
    original, model = timm_pair(name, img)
    vispos.patch(model, scheme_of(name), inherit=False)
    assert max_difference(original, model, (img, img)) > 1e-2


def test_the_user_path_pretrained_weights_from_a_local_file(tmp_path):
    """timm.create_model(pretrained=True) from a local file (nothing downloaded), then patch: still equal,
    and on the static model timm builds (no dynamic_img_size) at its native size."""
    name = "vit_small_patch16_rope_mixed_224"
    torch.manual_seed(0)
    trained = layer_scales_to_one(timm.create_model(name, depth=2, img_size=64, num_classes=4)).eval()
    torch.save(trained.state_dict(), tmp_path / "weights.pth")
    overlay = dict(file=str(tmp_path / "weights.pth"), num_classes=4)  # else timm drops the "mismatched" head
    loaded = timm.create_model(
        name, pretrained=True, pretrained_cfg_overlay=overlay, depth=2, img_size=64, num_classes=4
    ).eval()
    model = vispos.patch(loaded, "rope2d_mixed")
    image = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(image), trained(image), atol=1e-5, rtol=0)


def test_what_was_inherited_is_visible():
    _, model = timm_pair("eva02_tiny_patch14_224", 56)
    vispos.patch(model, "rope2d")
    cfg = model.vispos_cfg
    assert cfg["pos"] == ["learned2d", "rope2d"]  # EVA-02's APE stays beside its RoPE
    assert cfg["inherited"] == {"from": "timm RotaryEmbeddingCat"}
    assert cfg["options"] | {"ref_grid": tuple(cfg["options"]["ref_grid"])} == dict(
        theta=10000.0, coords="pixel", axes="yx", layout="interleaved", offset=0.0, ref_grid=(16, 16)
    )
    assert "inherited from timm RotaryEmbeddingCat" in repr(model.vispos)
    assert "axes='yx'" in repr(model.vispos.attention) and "ref_grid=(16, 16)" in repr(model.vispos.attention)


def test_mixed_frequencies_are_adopted_per_layer():
    original, model = timm_pair("vit_small_patch16_rope_mixed_224", 64)
    vispos.patch(model, "rope2d_mixed")
    for i, layer in enumerate(model.vispos.attention):
        torch.testing.assert_close(layer.freqs, original.rope.freqs[:, i], atol=0, rtol=0)


def test_an_explicit_option_wins_with_one_warning_naming_what_the_weights_assume():
    original, model = timm_pair("vit_small_patch16_rope_224", 64)
    with pytest.warns(PretrainedPositionsWarning) as record:
        vispos.patch(model, "rope2d", layout="half", theta=100.0)  # theta agrees: not mentioned
    assert len(record) == 1
    assert str(record[0].message) == (
        "you set layout='half', but this model's pretrained weights assume layout='interleaved' "
        "(timm RotaryEmbeddingCat); its outputs will change. Drop those options to keep what the model learned"
    )
    assert model.vispos.attention.layout == "half"
    assert max_difference(original, model, (64, 64)) > 1e-2


@pytest.mark.parametrize(
    ("name", "pos", "message"),
    [
        ("vit_small_patch16_rope_224", "alibi2d", r"own RoPE \(timm RotaryEmbeddingCat: rope2d\(theta=100.0, "
         r"coords='pixel', axes='xy', layout='interleaved', offset=0.0, ref_grid=None\)\) is discarded: alibi2d "
         r"replaces it, and the pretrained weights were trained with it. Patch with 'rope2d' to keep it"),
        ("vit_small_patch16_rope_224", "learned2d", r"is discarded: no attention scheme replaces it"),
        ("vit_small_patch16_rope_mixed_224", "rope2d", r"RotaryEmbeddingMixed: rope2d_mixed\(.*\)\) is discarded: "
         r"rope2d replaces it.* Patch with 'rope2d_mixed' to keep it"),
        ("vit_small_patch16_rope_ape_224", ["sincos2d", "rope2d"], r"learned pos_embed \(beside its RoPE\) is "
         r"discarded: sincos2d replaces it"),
    ],
)  # fmt: skip
def test_discarding_the_pretrained_positions_warns(name, pos, message):
    _, model = timm_pair(name, 64)
    with pytest.warns(PretrainedPositionsWarning, match=message):
        vispos.patch(model, pos)


def test_inherit_false_starts_fresh_silently():
    _, model = timm_pair("vit_small_patch16_rope_224", 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vispos.patch(model, "rope2d", inherit=False, layout="half")
    assert model.vispos.attention.layout == "half" and "inherited" not in model.vispos_cfg


def test_training_mode_coordinate_augmentation_matches_timm_draw_for_draw():
    """DINOv3 trained with rescale/jitter/shift: inherited, and the same random draws under one seed."""
    aug = dict(rope_rescale_coords=2.0, rope_jitter_coords=1.2, rope_shift_coords=0.1, drop_path_rate=0.0)
    original, model = timm_pair("vit_small_patch16_dinov3", 64, **aug)
    vispos.patch(model, "rope2d")
    assert model.vispos_cfg["options"]["rescale_coords"] == 2.0
    original.train(), model.train()
    image = torch.randn(2, 3, 64, 64)
    torch.manual_seed(5)
    expected = original.forward_features(image)
    torch.manual_seed(5)
    torch.testing.assert_close(model.forward_features(image), expected, atol=1e-5, rtol=0)
    torch.manual_seed(6)  # another draw: another output (the augmentation is live in training)
    assert (model.forward_features(image) - expected).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("name", "scheme"),
    [("vit_small_patch16_rope_mixed_ape_224", "rope2d_mixed"), ("vit_small_patch16_rope_ape_224", "rope2d")],
)
def test_a_plain_timm_checkpoint_loads_into_an_inherited_model(name: str, scheme: str):
    """Patch first, load timm's state dict after: pos_embed and rope.freqs land in vispos's modules, whose
    settings records (not in timm's checkpoint) stay the model's own."""
    original, model = timm_pair(name, 64)
    model = vispos.patch(timm.create_model(name, depth=2, img_size=64, num_classes=0, dynamic_img_size=True).eval(),
                         scheme)  # fmt: skip
    model.load_state_dict(original.state_dict())
    assert max_difference(original, model, (96, 96)) <= 1e-5


def test_an_inherited_model_saves_and_reloads_into_a_freshly_patched_one():
    original, model = timm_pair("vit_small_patch16_dinov3", 64)
    vispos.patch(model, "rope2d")
    _, fresh = timm_pair("vit_small_patch16_dinov3", 64)
    vispos.patch(fresh, "rope2d")
    fresh.load_state_dict(model.state_dict())
    assert max_difference(original, fresh, (80, 48)) <= 1e-5


def test_scaling_an_inherited_rope_vit_changes_only_larger_grids():
    original, model = timm_pair("vit_small_patch16_rope_224", 64)
    vispos.patch(model, "rope2d")
    vispos.configure(model, scaling="linear")
    assert max_difference(original, model, (64, 64)) <= 1e-5
    assert max_difference(original, model, (128, 128)) > 1e-3


def test_scaling_refuses_eva02_whose_reference_grid_already_rescales():
    _, model = timm_pair("eva02_tiny_patch14_224", 56)
    vispos.patch(model, "rope2d")
    with pytest.raises(ValueError, match="does not combine with ref_grid"):
        vispos.configure(model, scaling="linear")


def test_scaling_an_inherited_dinov3_acts_in_its_training_frame():
    """DINOv3's normalized coordinates are position interpolation by construction: linear scaling (which
    measures coordinates at the training spacing, then divides by the size ratio) gives the original at every
    size; NTK and YaRN give it at the training grid and something else above it."""
    original, model = timm_pair("vit_small_patch16_dinov3", 64)
    vispos.patch(model, "rope2d")
    vispos.configure(model, scaling="linear")
    for size in ((64, 64), (128, 128), (96, 160), (48, 64)):
        assert max_difference(original, model, size) <= 1e-4, size
    for kind in ("ntk", "yarn"):
        vispos.configure(model, scaling=kind)
        assert max_difference(original, model, (64, 64)) <= 1e-5, kind
        assert max_difference(original, model, (128, 128)) > 1e-3, kind


def test_inherited_dinov3_with_xy_indexing_reproduces_the_original():
    """DINOv3's RoPE with ``rope_grid_indexing="xy"``: timm < 1.0.31 puts y first anyway, 1.0.31 puts x
    first; the inherited axes follow the installed timm, so the features match on either."""
    original, model = timm_pair("vit_small_patch16_dinov3", 64, rope_grid_indexing="xy")
    vispos.patch(model, "rope2d")
    for size in sizes(64, 16):
        assert max_difference(original, model, size) <= 1e-5, size


def test_a_model_patched_in_eval_mode_draws_no_coordinate_augmentation() -> None:
    """DINOv3's augmentation is inherited (rescale_coords) and drawn in training mode only: a model patched in eval
    mode gives its unpatched outputs, the same at every call."""
    model = timm.create_model("vit_base_patch16_dinov3", img_size=64, embed_dim=64, depth=2, num_heads=4,
                              num_classes=0, rope_rescale_coords=2.0).eval()  # fmt: skip
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        want = model(x)
        vispos.patch(model, "rope2d")
        assert model.vispos_cfg["options"]["rescale_coords"] == 2.0 and not model.vispos.training
        torch.testing.assert_close(model(x), want, rtol=0, atol=1e-5)
        torch.testing.assert_close(model(x), want, rtol=0, atol=1e-5)
