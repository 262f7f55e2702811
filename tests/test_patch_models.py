"""Which timm models patch, which are refused, and the edge cases a user hits around them."""

from __future__ import annotations

import pytest
import timm
import torch

import vispos

SCHEMES = ["rope2d", "relbias2d", "learned2d", "alibi2d"]


def tiny(name: str, **kwargs: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, depth=2, num_classes=3, **kwargs).eval()


# --- hybrid ViTs: the token grid is the backbone's feature map, not image / patch_size -------------------
@pytest.mark.parametrize("name", ["vit_tiny_r_s16_p8_224", "vitamin_small_224"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_hybrid_vits_take_their_grid_from_the_backbone(name: str, scheme: str) -> None:
    model = vispos.patch(tiny(name, img_size=128), scheme)
    stride = model.patch_embed.feat_ratio(as_scalar=False)  # 32 pixels per token, not patch_size (1 or 8)
    assert model.vispos.train_grid == (128 // stride[0], 128 // stride[1])
    for h, w in ((128, 128), (192, 128)):
        image = torch.randn(1, 3, h, w)
        tokens = model.patch_embed(image)  # [1, gh, gw, C]
        assert model.vispos_grid(image) == tuple(tokens.shape[1:3])
        with torch.no_grad():
            assert model(image).isfinite().all()


def test_learned2d_on_a_hybrid_keeps_its_outputs_at_the_native_size() -> None:
    original = tiny("vit_tiny_r_s16_p8_224", img_size=128)
    image = torch.randn(2, 3, 128, 128)
    with torch.no_grad():
        expected = original(image)
        torch.testing.assert_close(vispos.patch(original, "learned2d")(image), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["vit_base_patch16_xp_224", "vit_small_patch16_18x2_224"])
def test_parallel_block_vits_are_refused_naming_what_is_accepted(name: str) -> None:
    model = timm.create_model(name, img_size=64, depth=1, num_classes=3)
    with pytest.raises(TypeError, match=r"block 0 is a Parallel\w+Block.*supports blocks with an attn of type Attent"):
        vispos.patch(model, "rope2d")


# --- sizes and patch embeddings --------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES)
def test_an_empty_batch_gives_an_empty_output_like_timm(scheme: str) -> None:
    model = vispos.patch(tiny("vit_small_patch16_224", img_size=64), scheme)
    with torch.no_grad():
        assert model(torch.randn(0, 3, 64, 64)).shape == (0, 3)
        assert model(torch.randn(0, 3, 96, 64)).shape == (0, 3)


def test_dynamic_img_pad_models_keep_padding_sizes_the_patch_does_not_divide() -> None:
    model = vispos.patch(tiny("vit_small_patch16_224", img_size=64, dynamic_img_pad=True), "rope2d")
    image = torch.randn(1, 3, 70, 50)
    assert model.vispos_grid(image) == (5, 4) == tuple(model.patch_embed(image).shape[1:3])
    with torch.no_grad():
        assert model(image).isfinite().all()
    strict = vispos.patch(tiny("vit_small_patch16_224", img_size=64), "rope2d")
    with pytest.raises(ValueError, match="input size 70x50 is not divisible by the patch size 16x16"):
        strict(image)


@pytest.mark.parametrize("scheme", ["rope2d", "learned2d", "relbias2d"])
def test_flexivit_patch_size_change_keeps_positions_in_step(scheme: str) -> None:
    model = vispos.patch(tiny("vit_small_patch16_224", img_size=64), scheme)
    model.set_input_size(patch_size=8)  # timm resamples the patch embedding; the grid doubles
    image = torch.randn(1, 3, 64, 64)
    assert model.vispos_grid(image) == (8, 8) == tuple(model.patch_embed(image).shape[1:3])
    with torch.no_grad():
        assert model(image).shape == (1, 3)


# --- BEiT's class-token entries for relative biases ------------------------------------------------------
@pytest.mark.parametrize("scheme", ["relbias2d", "cpb2d"])
def test_prefix_entries_let_the_last_layer_bias_learn_under_token_pooling(scheme: str) -> None:
    def last_layer_grads(**options: object) -> dict[str, torch.Tensor]:
        model = vispos.patch(tiny("vit_small_patch16_224", img_size=64, global_pool="token"), scheme, **options)
        model(torch.randn(2, 3, 64, 64)).sum().backward()
        return {n: p.grad for n, p in model.vispos.attention[-1].named_parameters()}

    with_entries, without = last_layer_grads(), last_layer_grads(prefix_entries=False)
    assert with_entries["prefix_bias"].abs().sum() > 0  # the class token's row reaches the output
    assert all(g is None or g.abs().sum() == 0 for g in without.values())  # the problem they solve


def test_prefix_entries_fill_the_prefix_rows_and_columns_and_keep_patches_relative() -> None:
    model = vispos.patch(tiny("deit_tiny_distilled_patch16_224", img_size=64), "relbias2d")  # cls + dist
    layer = model.vispos.attention[0]
    with torch.no_grad():
        layer.prefix_bias.copy_(torch.tensor([[1.0], [2.0], [3.0]]).expand(3, 3))
    mask = model.vispos.context((3, 4), torch.device("cpu")).layer(0)[1][0]  # [heads, 2 + 12, 2 + 12]
    assert torch.equal(mask[:, :2, :2], torch.full((3, 2, 2), 3.0))  # prefix -> prefix
    assert torch.equal(mask[:, :2, 2:], torch.full((3, 2, 12), 1.0))  # prefix -> patch
    assert torch.equal(mask[:, 2:, :2], torch.full((3, 12, 2), 2.0))  # patch -> prefix
    torch.testing.assert_close(mask[:, 2:, 2:], layer((3, 4)), rtol=0, atol=0)
    without = vispos.patch(tiny("deit_tiny_distilled_patch16_224", img_size=64), "relbias2d", prefix_entries=False)
    assert without.vispos.attention[0].prefix_bias is None
    assert vispos.patch(tiny("vit_small_patch16_224", img_size=64, class_token=False, global_pool="avg"),
                        "relbias2d").vispos.attention[0].prefix_bias is None  # no prefix tokens: nothing to add


# --- clear refusals ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("pos", [None, 123, [], ["rope2d", 4]])
def test_a_scheme_that_is_not_a_name_is_refused(pos: object) -> None:
    with pytest.raises(TypeError, match="pos must be a scheme name or a list of names"):
        vispos.patch(tiny("vit_small_patch16_224", img_size=64), pos)


def test_configure_with_a_scaling_of_the_wrong_type_says_what_is_accepted() -> None:
    model = vispos.patch(tiny("vit_small_patch16_224", img_size=64), "rope2d")
    with pytest.raises(TypeError, match="scaling must be None, a type name, a dict or RopeScaling; got int"):
        vispos.configure(model, scaling=123)
