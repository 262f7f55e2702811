"""vispos.patch on timm ViTs: every supported model x every 2D scheme, weights, prefix tokens, errors."""

from __future__ import annotations

import copy
import math

import pytest
import timm
import torch
from timm.models.vision_transformer import VisionTransformer

import vispos
from vispos.timm import PatchedAttention

IMG = 64  # 4 x 4 patches of 16 px: small and fast, still a real grid

MODELS = {
    "vit_tiny": lambda: timm.create_model("vit_tiny_patch16_224", img_size=IMG, depth=2, num_classes=5),
    "vit_small_cls": lambda: timm.create_model("vit_small_patch16_224", img_size=IMG, depth=2, num_classes=5),
    "deit_distilled": lambda: timm.create_model(
        "deit_tiny_distilled_patch16_224", img_size=IMG, depth=2, num_classes=5
    ),
    "deit3_no_embed_class": lambda: timm.create_model("deit3_small_patch16_224", img_size=IMG, depth=2, num_classes=5),
    "registers_gap": lambda: timm.create_model("vit_little_patch16_reg4_gap_256", img_size=IMG, depth=2, num_classes=5),
    "no_cls_avg": lambda: VisionTransformer(
        img_size=IMG, patch_size=16, embed_dim=96, depth=2, num_heads=3, class_token=False, global_pool="avg",
        num_classes=5,
    ),
    "eva_rope": lambda: timm.create_model("vit_small_patch16_rope_224", img_size=IMG, depth=2, num_classes=5),
}  # fmt: skip
SCHEMES = vispos.list_encodings(ndim=2)
SIZES = [(IMG, IMG), (IMG * 3 // 2, IMG * 3 // 2), (IMG, IMG + 32)]  # native, 1.5x, non-square


def make(model: str, pos: str | list[str], **options: object) -> torch.nn.Module:
    return vispos.patch(MODELS[model](), pos, **options)


def randomize_positions(model: torch.nn.Module) -> None:
    """Move every positional parameter off its init so round trips prove something."""
    with torch.no_grad():
        for p in model.vispos.parameters():
            p.add_(torch.randn_like(p) * 0.1)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_patched_model_runs_at_native_larger_and_non_square_sizes(model_name: str, scheme: str) -> None:
    model = make(model_name, scheme).train()
    for h, w in SIZES:
        out = model(torch.randn(2, 3, h, w))
        assert out.shape == (2, 5) and torch.isfinite(out).all()
    out.sum().backward()
    for name, p in model.named_parameters():
        if name.startswith("vispos.") or "attn.qkv" in name:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
    positional = list(model.vispos.parameters())
    assert bool(positional) == vispos.get_info(scheme, 2).trainable


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_state_dict_round_trip_reproduces_outputs_exactly(model_name: str, scheme: str) -> None:
    source = make(model_name, scheme).eval()
    randomize_positions(source)
    torch.manual_seed(123)  # a different init for the target
    target = make(model_name, scheme).eval()
    target.load_state_dict(source.state_dict(), strict=True)
    x = torch.randn(2, 3, IMG, IMG + 16)
    assert torch.equal(source(x), target(x))
    assert target.vispos_cfg == source.vispos_cfg


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("model_name", ["vit_small_cls", "registers_gap", "eva_rope"])
def test_fused_and_eager_attention_agree(model_name: str, scheme: str) -> None:
    fused = make(model_name, scheme).eval()
    randomize_positions(fused)
    eager = copy.deepcopy(fused)
    for blk in eager.blocks:
        blk.attn.fused_attn = False
    x = torch.randn(2, 3, IMG + 32, IMG)
    torch.testing.assert_close(fused(x), eager(x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("model_name", list(MODELS))
def test_weights_outside_the_positional_path_are_the_same_tensors(model_name: str) -> None:
    model = MODELS[model_name]()
    before = {n: p for n, p in model.named_parameters() if "pos_embed" not in n and "rope" not in n}
    vispos.patch(model, "rope2d")
    after = dict(model.named_parameters())
    for name, param in before.items():
        assert after[name] is param, name
    assert all(isinstance(b.attn, PatchedAttention) for b in model.blocks)


@pytest.mark.parametrize("model_name", ["vit_small_cls", "deit_distilled", "deit3_no_embed_class", "registers_gap"])
def test_learned2d_keeps_the_models_own_table(model_name: str) -> None:
    model = MODELS[model_name]().eval()
    with torch.no_grad():
        model.pos_embed.normal_()  # a table worth keeping
    x = torch.randn(2, 3, IMG, IMG)
    expected = model(x)
    vispos.patch(model, "learned2d")
    assert torch.equal(model(x), expected)


@pytest.mark.parametrize("scheme", ["rope2d", "rope2d_mixed"])
def test_rope_leaves_prefix_tokens_unrotated(scheme: str) -> None:
    model = make("registers_gap", scheme)  # 4 register tokens, no class token
    prefix = model.num_prefix_tokens
    assert prefix == 4
    ctx = model.vispos.context((4, 5), torch.device("cpu"))
    q, k = torch.randn(2, model.blocks[0].attn.num_heads, prefix + 20, 64).unbind(0)
    q, k = q[None], k[None]
    q_rot, k_rot = ctx.layer(0)[0].rotate(q, k)
    assert torch.equal(q_rot[..., :prefix, :], q[..., :prefix, :])
    assert torch.equal(k_rot[..., :prefix, :], k[..., :prefix, :])
    assert not torch.allclose(q_rot[..., prefix + 1 :, :], q[..., prefix + 1 :, :])


@pytest.mark.parametrize("scheme", ["relbias2d", "cpb2d", "alibi2d"])
def test_bias_is_one_mask_shared_across_the_batch_with_zero_prefix_entries(scheme: str) -> None:
    model = make("deit_distilled", scheme)
    ctx = model.vispos.context((3, 4), torch.device("cpu"))
    n = 2 + 12
    heads = model.blocks[0].attn.num_heads
    for layer in range(len(model.blocks)):
        mask = ctx.layer(layer)[1]
        assert mask.shape == (1, heads, n, n)  # one mask for the whole batch, 4-D for SDPA's fused kernels
        assert torch.equal(mask[0, :, :2, :], torch.zeros(heads, 2, n))
        assert torch.equal(mask[0, :, :, :2], torch.zeros(heads, n, 2))
        assert mask[0, :, 2:, 2:].abs().sum() > 0


def test_combined_additive_and_attention_scheme() -> None:
    model = make("vit_small_cls", ["learned2d", "rope2d"], theta=10.0)
    assert model.vispos.additive is not None and model.vispos.attention.theta == 10.0
    assert torch.isfinite(model(torch.randn(1, 3, IMG * 2, IMG))).all()
    assert model.vispos_cfg["pos"] == ["learned2d", "rope2d"]


def test_forward_features_intermediates_and_checkpointing() -> None:
    model = make("vit_small_cls", "rope2d_mixed").eval()
    x = torch.randn(2, 3, IMG, IMG + 16)
    feats = model.forward_features(x)
    assert feats.shape == (2, 1 + 4 * 5, 384)
    final, inter = model.forward_intermediates(x, indices=2)
    torch.testing.assert_close(final, feats)
    assert [t.shape for t in inter] == [(2, 384, 4, 5)] * 2
    model.set_grad_checkpointing(True)
    model.train()
    x.requires_grad_(True)
    out = model.forward_features(x)
    torch.testing.assert_close(out, feats)
    out.sum().backward()
    assert all(p.grad is not None for p in model.vispos.parameters())


def test_position_switch_turns_the_scheme_off_and_back_on() -> None:
    model = make("vit_small_cls", "rope2d").eval()
    x = torch.randn(1, 3, IMG, IMG)
    with_pos = model(x)
    vispos.set_position_enabled(model, False)
    without = model(x)
    reference = make("vit_small_cls", "nope").eval()  # the same weights, without the rope2d settings
    reference.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("vispos.")})
    torch.testing.assert_close(without, reference(x))
    assert not torch.allclose(with_pos, without)
    vispos.set_position_enabled(model, True)
    assert torch.equal(model(x), with_pos)


@pytest.mark.parametrize("method", ["linear", "ntk", "yarn"])
def test_configure_scaling_changes_only_larger_grids(method: str) -> None:
    model = make("vit_small_cls", "rope2d").eval()
    native, larger = torch.randn(1, 3, IMG, IMG), torch.randn(1, 3, IMG * 2, IMG)
    base_native, base_larger = model(native), model(larger)
    vispos.configure(model, scaling=method)
    assert torch.equal(model(native), base_native)  # factor 1 at the training grid
    assert not torch.allclose(model(larger), base_larger)
    vispos.configure(model, scaling=None)
    assert torch.equal(model(larger), base_larger)


def test_create_model_records_the_scheme() -> None:
    model = vispos.create_model("vit_tiny_patch16_224", pos="relbias2d", img_size=IMG, depth=1, num_classes=3)
    assert model.vispos_cfg["pos"] == ["relbias2d"] and model.vispos_cfg["train_grid"] == (4, 4)
    assert model(torch.randn(1, 3, IMG, IMG)).shape == (1, 3)


BF16_TOL = 0.02  # relative error of the features, ||a - b|| / ||b||; bf16 keeps 8 bits (0.4 %) per value


@pytest.mark.parametrize(
    "scheme", [s for s in SCHEMES if s != "nope"]
)
def test_bf16_autocast_error_is_below_a_tolerance_that_tells_the_scheme_from_no_positions(scheme: str) -> None:
    """Under bf16 autocast the features move by less than BF16_TOL; the same weights without positions
    (``nope``) move them by more, so the tolerance would catch positions lost or garbled in bf16. The qkv
    weights are scaled x4 so attention depends on positions, as in a trained model (at timm's
    initialisation it is nearly uniform and no scheme changes the features by more than 1 %)."""
    torch.manual_seed(0)
    base = MODELS["vit_small_cls"]().eval()
    with torch.no_grad():
        for blk in base.blocks:
            blk.attn.qkv.weight.mul_(4.0)
    model = vispos.patch(copy.deepcopy(base), scheme).eval()
    randomize_positions(model)
    nope = vispos.patch(copy.deepcopy(base), "nope").eval()
    x = torch.randn(2, 3, IMG, IMG)
    with torch.no_grad():
        ref = model.forward_features(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model.forward_features(x)
        without = nope.forward_features(x)
    assert torch.isfinite(low).all()
    bf16_error = ((low.float() - ref).norm() / ref.norm()).item()
    position_effect = ((without - ref).norm() / ref.norm()).item()
    assert 0 < bf16_error < BF16_TOL < position_effect, (bf16_error, position_effect)  # 0 <: bf16 did run


# --- bad input ----------------------------------------------------------------------------------


def test_unknown_scheme_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown scheme 'rope3d'; known: .*rope2d"):
        make("vit_tiny", "rope3d")


def test_1d_scheme_is_refused_with_the_2d_names() -> None:
    with pytest.raises(ValueError, match="no 2D form; 2D schemes: .*rope2d"):
        make("vit_tiny", "t5")


def test_unsupported_model_class_names_what_is_supported() -> None:
    with pytest.raises(TypeError, match="supports timm VisionTransformer, timm Eva"):
        vispos.patch(torch.nn.Linear(3, 3), "rope2d")


def test_head_dim_not_divisible_by_4_is_refused_at_patch_time() -> None:
    model = VisionTransformer(img_size=32, patch_size=16, embed_dim=24, depth=1, num_heads=4)  # head dim 6
    with pytest.raises(ValueError, match="divisible by 4, got 6"):
        vispos.patch(model, "rope2d")


def test_patching_twice_is_refused() -> None:
    model = make("vit_tiny", "rope2d")
    with pytest.raises(ValueError, match="already patched"):
        vispos.patch(model, "alibi2d")


def test_input_not_divisible_by_patch_size_fails_before_the_model_runs() -> None:
    model = make("vit_tiny", "relbias2d")
    with pytest.raises(ValueError, match="input size 64x70 is not divisible by the patch size 16x16"):
        model(torch.randn(1, 3, 64, 70))


def test_two_additive_schemes_are_refused() -> None:
    with pytest.raises(ValueError, match="at most one additive scheme"):
        make("vit_tiny", ["learned2d", "sincos2d"])


def test_unknown_option_is_refused_with_the_accepted_ones() -> None:
    with pytest.raises(TypeError, match="unknown option.*thetta.*accepted.*theta"):
        make("vit_tiny", "rope2d", thetta=10.0)


@pytest.mark.parametrize("scheme, option", [("rope2d", "dim"), ("relbias2d", "num_heads"), ("learned2d", "train_grid")])
def test_what_the_model_determines_is_not_an_option(scheme: str, option: str) -> None:
    with pytest.raises(TypeError, match=rf"{option} of {scheme} are set from the model, not by hand; accepted: "):
        make("vit_tiny", scheme, **{option: 4})


def test_configure_needs_rope2d() -> None:
    with pytest.raises(ValueError, match="applies to rope and rope2d; this model uses alibi2d"):
        vispos.configure(make("vit_tiny", "alibi2d"), scaling="yarn")


def test_scaling_temperature_applies_to_prefix_tokens_too() -> None:
    model = make("vit_small_cls", "rope2d")
    vispos.configure(model, scaling="yarn")
    rotary = model.vispos.context((8, 4), torch.device("cpu")).layer(0)[0]  # 2x the training height
    expected = (0.1 * math.log(2.0) + 1.0) ** 0.5  # YaRN's factor on y, none on x; shared by q and k
    assert rotary.temperature == pytest.approx(expected)
    assert torch.allclose(rotary.cos[0], torch.full_like(rotary.cos[0], expected))
    assert torch.equal(rotary.sin[0], torch.zeros_like(rotary.sin[0]))


def test_log_n_attention_scales_logits_only_above_the_training_grid() -> None:
    model = make("vit_small_cls", "alibi2d").eval()
    native, larger = torch.randn(1, 3, IMG, IMG), torch.randn(1, 3, IMG * 2, IMG * 2)
    base_native, base_larger = model(native), model(larger)
    vispos.configure(model, log_n_attention=True)
    assert model.vispos.context((8, 8), torch.device("cpu")).logit_scale == pytest.approx(math.log(64) / math.log(16))
    assert torch.equal(model(native), base_native)
    scaled = model(larger)
    # the same thing by hand: every block's softmax temperature multiplied by ln 64 / ln 16
    reference = copy.deepcopy(model)
    vispos.configure(reference, log_n_attention=False)
    for blk in reference.blocks:
        blk.attn.scale *= math.log(64) / math.log(16)
    torch.testing.assert_close(scaled, reference(larger))
    assert not torch.allclose(scaled, base_larger)
