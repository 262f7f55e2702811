"""vispos.patch on transformers vision models: every family keeps its own positions exactly (at the native
size and wherever the original runs at another size), takes every 2D scheme at any size, and keeps what
transformers users rely on (attention implementations, output_attentions, heads, two-tower models,
gradient checkpointing, compile, save_pretrained, pickling). Tiny random configs only; nothing is
downloaded."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

import vispos

tf = pytest.importorskip("transformers")

SIZE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
            patch_size=8)  # fmt: skip


def config(cls, **extra):
    return cls(**(SIZE | extra))


FAMILIES = {
    "vit": lambda **k: tf.ViTModel(config(tf.ViTConfig, **k)),
    "deit": lambda **k: tf.DeiTModel(config(tf.DeiTConfig, **k)),
    "dinov2": lambda **k: tf.Dinov2Model(config(tf.Dinov2Config, mlp_ratio=2, **k)),
    "dinov2_reg": lambda **k: tf.Dinov2WithRegistersModel(
        config(tf.Dinov2WithRegistersConfig, mlp_ratio=2, num_register_tokens=4, **k)
    ),
    "dinov3": lambda **k: tf.DINOv3ViTModel(config(tf.DINOv3ViTConfig, num_register_tokens=4, **k)),
    "clip": lambda **k: tf.CLIPVisionModel(config(tf.CLIPVisionConfig, **k)),
    "siglip": lambda **k: tf.SiglipVisionModel(config(tf.SiglipVisionConfig, **k)),
}
PREFIX = {"vit": 1, "deit": 2, "dinov2": 1, "dinov2_reg": 5, "dinov3": 5, "clip": 1, "siglip": 0}
OWN = {"dinov3": "rope2d"}  # the scheme a family's own positions become; learned2d elsewhere
# the sizes at which the original runs with interpolate_pos_encoding (DINOv2 / DINOv3: always)
SIZES = [(32, 32), (48, 64), (24, 40)]


def make(family: str, **extra) -> torch.nn.Module:
    model = FAMILIES[family](**extra).eval()
    with torch.no_grad():  # non-zero layer scales and tables: what a trained model has
        for name, p in model.named_parameters():
            if "lambda1" in name or "lambda2" in name or name.endswith("layer_scale") or "position_embedding" in name:
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "lambda" in name else 0.0))
    return model


def original(model: torch.nn.Module, family: str, x: torch.Tensor) -> torch.Tensor:
    kwargs = {} if family in ("dinov2", "dinov2_reg", "dinov3") else {"interpolate_pos_encoding": True}
    with torch.no_grad():
        return model(x, **kwargs).last_hidden_state


def run(model: torch.nn.Module, x: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(x, **kwargs).last_hidden_state


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_inherited_positions_give_the_original_outputs(family: str) -> None:
    model = make(family)
    patched = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # keeping the model's own positions warns of nothing
        vispos.patch(patched, OWN.get(family, "learned2d"))
    fresh = vispos.patch(copy.deepcopy(model), OWN.get(family, "learned2d"), inherit=False)
    for h, w in SIZES:
        x = torch.randn(2, 3, h, w)
        want = original(model, family, x)
        assert run(patched, x).shape == want.shape == (2, PREFIX[family] + h * w // 64, 64)
        torch.testing.assert_close(run(patched, x), want, rtol=0, atol=1e-5)
        assert (run(fresh, x) - want).abs().max() > 1e-3  # the control: fresh positions differ


def test_dinov2_with_registers_resizes_with_antialias_as_its_model() -> None:
    """A reduced size: DINOv2 with registers antialiases, DINOv2 does not; each patched model follows its own."""
    for family in ("dinov2", "dinov2_reg"):
        model = make(family, image_size=64)
        patched = vispos.patch(copy.deepcopy(model), "learned2d")
        assert patched.vispos.additive.antialias is (family == "dinov2_reg")
        x = torch.randn(1, 3, 24, 40)
        torch.testing.assert_close(run(patched, x), original(model, family, x), rtol=0, atol=1e-5)


SCHEMES_2D = vispos.list_encodings(2)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_2d_scheme_at_any_size(family: str) -> None:
    model = make(family)
    for scheme in SCHEMES_2D:
        patched = vispos.patch(copy.deepcopy(model), scheme, inherit=False)
        for h, w in SIZES:
            out = run(patched, torch.randn(2, 3, h, w))
            assert out.shape == (2, PREFIX[family] + h * w // 64, 64), scheme
            assert torch.isfinite(out).all(), scheme


@pytest.mark.parametrize("scheme", ["rope2d", "relbias2d", "alibi2d", "cpb2d", ["learned2d", "rope2d_mixed"]])
def test_eager_and_sdpa_are_equal_and_attentions_are_returned(scheme) -> None:
    model = make("vit", attn_implementation="eager")
    eager = vispos.patch(model, scheme, inherit=False)
    sdpa = copy.deepcopy(eager)
    sdpa.set_attn_implementation("sdpa")
    assert sdpa.config._attn_implementation == "sdpa"
    x = torch.randn(2, 3, 40, 24)
    torch.testing.assert_close(run(sdpa, x), run(eager, x), rtol=0, atol=1e-5)
    with torch.no_grad():
        out = eager(x, output_attentions=True, output_hidden_states=True)
    assert len(out.attentions) == 2 and len(out.hidden_states) == 3
    n = 1 + 15
    assert out.attentions[0].shape == (2, 4, n, n)
    torch.testing.assert_close(out.attentions[0].sum(-1), torch.ones(2, 4, n), rtol=0, atol=1e-5)
    plain = vispos.patch(make("vit", attn_implementation="eager"), "nope", inherit=False)
    plain.load_state_dict({k: v for k, v in eager.state_dict().items() if not k.startswith("vispos.")}, strict=False)
    with torch.no_grad():
        unpositioned = plain(x, output_attentions=True).attentions[0]
    assert (out.attentions[0] - unpositioned).abs().max() > 1e-3  # the weights carry the positions


@pytest.mark.parametrize("scheme", ["rope2d", "relbias2d"])
def test_flex_attention_implementations_equal_sdpa(scheme: str) -> None:
    """transformers' flex_attention (rotary schemes: its kernel; bias schemes: SDPA with the mask) and vispos's
    own FlexAttention path for biases (configure(attention="flex")) give the sdpa outputs."""
    model = vispos.patch(make("vit"), scheme, inherit=False)
    x = torch.randn(2, 3, 32, 48)
    want = run(model, x)
    flex = copy.deepcopy(model)
    flex.set_attn_implementation("flex_attention")
    torch.testing.assert_close(run(flex, x), want, rtol=0, atol=1e-5)
    if scheme == "relbias2d":
        vispos.configure(model, attention="flex")
        torch.testing.assert_close(run(model, x), want, rtol=0, atol=1e-5)


def test_masked_image_modeling_keeps_its_mask_tokens() -> None:
    model = tf.ViTForMaskedImageModeling(config(tf.ViTConfig, encoder_stride=8)).eval()
    patched = vispos.patch(copy.deepcopy(model), "learned2d")
    x, masked = torch.randn(2, 3, 32, 32), torch.rand(2, 16) > 0.5
    with torch.no_grad():
        want = model(x, bool_masked_pos=masked).reconstruction
        torch.testing.assert_close(patched(x, bool_masked_pos=masked).reconstruction, want, rtol=0, atol=1e-5)
        assert (patched(x).reconstruction - want).abs().max() > 1e-3  # the mask tokens matter


def test_bias_schemes_are_refused_with_flash_attention() -> None:
    model = make("vit")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="sdpa"):
        vispos.patch(copy.deepcopy(model), "relbias2d", inherit=False)
    rotary = vispos.patch(copy.deepcopy(model), "rope2d", inherit=False)  # rotary schemes: accepted
    assert rotary.vispos.attention_kind == "rotary"
    patched = vispos.patch(make("vit"), "alibi2d", inherit=False)
    patched.config._attn_implementation = "flash_attention_2"  # as set_attn_implementation would leave it
    with pytest.raises(ValueError, match="flash attention kernels do not take"):
        run(patched, torch.randn(1, 3, 32, 32))


@pytest.mark.parametrize("scheme", vispos.list_encodings(2, kind="rotary"))
def test_rotary_schemes_hand_flash_attention_what_its_kernels_take(scheme: str, monkeypatch) -> None:  # noqa: ANN001
    """flash-attn is not installed here: a stand-in registered as ``flash_attention_2`` checks what vispos hands
    the flash interface (half-precision q/k/v [B, heads, N, head_dim] with the rotation applied, no mask, the
    model's scale) and computes it with SDPA, so the bf16 outputs must equal the sdpa implementation's."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls = []

    def flash_stand_in(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):  # noqa: ANN001
        assert attention_mask is None and query.dtype == key.dtype == value.dtype == torch.bfloat16
        assert query.shape == key.shape == value.shape and query.shape[1] == module.config.num_attention_heads
        calls.append(scaling)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling)
        return out.transpose(1, 2), None

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "flash_attention_2", flash_stand_in)
    model = vispos.patch(make("dinov2"), scheme, inherit=False).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.vispos.parameters():  # learned rotations off their init
            p.add_(torch.randn_like(p) * 0.1)
    x = torch.randn(2, 3, 48, 32, dtype=torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    want = run(model, x)
    model.config._attn_implementation = "flash_attention_2"
    torch.testing.assert_close(run(model, x), want, rtol=0, atol=0)
    assert calls == [(64 // 4) ** -0.5] * 2  # one call per layer (hidden 64, 4 heads), the model's scale
    unrotated = vispos.patch(make("dinov2"), "nope", inherit=False).to(torch.bfloat16)
    unrotated.load_state_dict(model.state_dict(), strict=False)
    unrotated.config._attn_implementation = "flash_attention_2"
    assert (run(unrotated, x) - want).abs().max() > 1e-2  # the control: the rotation reaches the kernel


def test_refusals_name_the_family() -> None:
    swin = tf.SwinModel(tf.SwinConfig(embed_dim=16, depths=[1], num_heads=[2], image_size=32, patch_size=4,
                                      window_size=4))  # fmt: skip
    with pytest.raises(TypeError, match="Swin: window attention"):
        vispos.patch(swin, "rope2d")
    beit = tf.BeitModel(tf.BeitConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32,
                                      image_size=32, patch_size=8))  # fmt: skip
    with pytest.raises(TypeError, match="BEiT"):
        vispos.patch(beit, "rope2d")
    with pytest.raises(TypeError, match="no vision model"):
        vispos.patch(tf.BertModel(tf.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                intermediate_size=32)), "rope2d")  # fmt: skip
    patched = vispos.patch(make("vit"), "rope2d", inherit=False)
    with pytest.raises(ValueError, match="already patched"):
        vispos.patch(patched, "rope2d")
    with pytest.raises(ValueError, match="not divisible by the patch size 8x8"):
        run(patched, torch.randn(1, 3, 30, 32))


def test_discarding_the_own_table_warns_and_inherit_false_is_silent() -> None:
    with pytest.warns(vispos.PretrainedPositionsWarning, match="learned position table is discarded"):
        vispos.patch(make("vit"), "rope2d")
    with pytest.warns(vispos.PretrainedPositionsWarning, match="own RoPE"):
        vispos.patch(make("dinov3"), "relbias2d")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vispos.patch(make("vit"), "rope2d", inherit=False)
        kept = vispos.patch(make("vit"), ["learned2d", "rope2d"])
    assert kept.vispos.settings["pos"] == ["learned2d", "rope2d"]


def test_heads_and_two_tower_models_patch_the_vision_tower_only() -> None:
    head = tf.ViTForImageClassification(config(tf.ViTConfig, num_labels=5)).eval()
    keys = set(head.state_dict())
    reference = copy.deepcopy(head)
    vispos.patch(head, "learned2d")
    new = set(head.state_dict())
    assert keys - new == {"vit.embeddings.position_embeddings"}
    assert all(k.startswith("vit.vispos.") for k in new - keys)
    x = torch.randn(2, 3, 48, 32)
    with torch.no_grad():
        want = reference(x, interpolate_pos_encoding=True).logits
        torch.testing.assert_close(head(x).logits, want, rtol=0, atol=1e-5)

    clip_config = tf.CLIPConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32),
        vision_config=SIZE, projection_dim=16,
    )  # fmt: skip
    clip = tf.CLIPModel(clip_config).eval()
    text_before = type(clip.text_model.encoder.layers[0].self_attn)
    ids = torch.tensor([[1, 5, 7, 2]])
    with torch.no_grad():
        text = clip.get_text_features(input_ids=ids)
    vispos.patch(clip, "rope2d", inherit=False)
    assert type(clip.text_model.encoder.layers[0].self_attn) is text_before  # the class itself is untouched
    assert "vispos" in type(clip.vision_model.encoder.layers[0].self_attn).__module__
    with torch.no_grad():
        torch.testing.assert_close(clip.get_text_features(input_ids=ids), text, rtol=0, atol=0)
        image = clip.get_image_features(pixel_values=torch.randn(2, 3, 48, 64))
    assert torch.isfinite(image.pooler_output if hasattr(image, "pooler_output") else image).all()
    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32)
    siglip = tf.SiglipModel(tf.SiglipConfig(text_config=text, vision_config=SIZE)).eval()
    vispos.patch(siglip, "alibi2d", inherit=False)
    assert hasattr(siglip.vision_model, "vispos") and not hasattr(siglip.text_model, "vispos")


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    model = vispos.patch(make("vit"), ["learned2d", "rope2d_mixed"], inherit=False).train()
    model.config.hidden_dropout_prob = model.config.attention_probs_dropout_prob = 0.0
    checkpointed = copy.deepcopy(model)
    checkpointed.gradient_checkpointing_enable()
    x = torch.randn(2, 3, 40, 32)
    grads = []
    for m in (model, checkpointed):
        m(x).last_hidden_state.square().mean().backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any(k.startswith("vispos.") for k in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6)


def test_compile_without_graph_breaks() -> None:
    model = vispos.patch(make("vit"), "rope2d", inherit=False)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 3, 32, 48)
    torch.testing.assert_close(run(compiled, x), run(model, x), rtol=1e-5, atol=1e-5)


def test_save_pretrained_and_from_pretrained_round_trip(tmp_path) -> None:
    model = vispos.patch(make("dinov3"), "rope2d")
    vispos.configure(model, log_n_attention=True)
    model.save_pretrained(tmp_path)
    loaded = vispos.hf.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "DINOv3ViTModel" and loaded.vispos_cfg["pos"] == ["rope2d"]
    assert loaded.vispos.log_n_tokens == model.vispos.log_n_tokens == 16
    for h, w in SIZES:
        x = torch.randn(1, 3, h, w)
        torch.testing.assert_close(run(loaded, x), run(model, x), rtol=1e-5, atol=1e-6)
    other = vispos.patch(make("dinov3"), "relbias2d", inherit=False)
    with pytest.raises(ValueError, match="positions are"):
        other.load_state_dict(model.state_dict())
    plain = tmp_path / "plain"
    make("vit").save_pretrained(plain)
    with pytest.raises(ValueError, match="unpatched"):
        vispos.hf.from_pretrained(plain)


def test_a_plain_checkpoint_loads_into_a_patched_model() -> None:
    model = make("clip")
    patched = vispos.patch(tf.CLIPVisionModel(config(tf.CLIPVisionConfig)).eval(), "learned2d")
    patched.load_state_dict(model.state_dict())  # the unpatched model's keys, its table adopted
    x = torch.randn(1, 3, 48, 48)
    torch.testing.assert_close(run(patched, x), original(model, "clip", x), rtol=0, atol=1e-5)
    rope = vispos.patch(tf.CLIPVisionModel(config(tf.CLIPVisionConfig)).eval(), "rope2d", inherit=False)
    with pytest.raises(ValueError, match="no place for"):
        rope.load_state_dict(model.state_dict())
    rope.load_state_dict(model.state_dict(), strict=False)  # every other weight


def test_pickle_deepcopy_and_dinov3_augmentation_only_in_training() -> None:
    model = vispos.patch(make("dinov3"), "rope2d")
    assert model.vispos_cfg["options"]["rescale_coords"] == 2.0  # DINOv3's training-time augmentation, inherited
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(run(model, x), run(model, x), rtol=0, atol=0)  # eval: no draw
    for twin in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        torch.testing.assert_close(run(twin, x), run(model, x), rtol=0, atol=0)
    model.train()
    with torch.no_grad():
        a, b = model(x).last_hidden_state, model(x).last_hidden_state
    assert (a - b).abs().max() > 1e-4  # training: a new coordinate frame each forward


def test_log_n_and_scaling_on_a_pretrained_rope_tower() -> None:
    model = vispos.patch(make("dinov3"), "rope2d")
    x = torch.randn(1, 3, 64, 64)
    before = run(model, x)
    vispos.configure(model, log_n_attention=True)
    assert (run(model, x) - before).abs().max() > 1e-4  # 64 tokens against 16 in training: sharper attention
    torch.testing.assert_close(run(model, torch.randn(1, 3, 32, 32)).shape, before[:, :21].shape)
    vispos.configure(model, log_n_attention=False, scaling="linear")  # DINOv3's own frame: already interpolated
    torch.testing.assert_close(run(model, x), before, rtol=0, atol=1e-4)
    small = torch.randn(1, 3, 32, 32)  # the training size
    at_training = run(model, small)
    vispos.configure(model, scaling="yarn")
    torch.testing.assert_close(run(model, small), at_training, rtol=0, atol=1e-5)
    assert (run(model, x) - before).abs().max() > 1e-3  # fast pairs keep their training spacing at 64 px
    pixel = vispos.patch(make("vit"), "rope2d", inherit=False)
    before = run(pixel, x)
    vispos.configure(pixel, scaling="yarn")
    assert (run(pixel, x) - before).abs().max() > 1e-4
