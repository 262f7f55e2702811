"""VLM vision towers in transformers: Pixtral's encoder, alone and inside a Llava model. Tiny random configs.

Pixtral packs a batch into one row, each image at its own size (``image_sizes``): the patched tower must give the
unpatched tower's outputs with its RoPE inherited, every image what it gets alone with any other scheme, and the
inherited RoPE scaled per axis as Pixtral's own RoPE would be at scaled positions."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import vispos
from vispos.positions import Positions

tf = pytest.importorskip("transformers")

from transformers.models.pixtral import modeling_pixtral  # noqa: E402

SIZES = torch.tensor([[48, 64], [32, 40], [16, 24]])  # pixels: 6x8, 4x5 and 2x3 patches of 8
PATCH = 8


def pixtral(attn: str = "sdpa", theta: float = 10000.0) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tf.PixtralVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32,
        patch_size=PATCH, rope_parameters={"rope_type": "axial", "rope_theta": theta}, attn_implementation=attn,
    )  # fmt: skip
    model = tf.PixtralVisionModel(config).eval()
    with torch.no_grad():  # sharper attention than the random init's: positions then move the outputs visibly
        for layer in model.transformer.layers:
            layer.attention.q_proj.weight.mul_(6.0)
            layer.attention.k_proj.weight.mul_(6.0)
    return model


def images(seed: int = 1) -> torch.Tensor:
    return torch.randn(len(SIZES), 3, 48, 64, generator=torch.Generator().manual_seed(seed))


def run(model: torch.nn.Module, x: torch.Tensor, sizes: torch.Tensor = SIZES) -> torch.Tensor:
    with torch.no_grad():
        return model(x, image_sizes=sizes).last_hidden_state[0]  # [T, C]: the packed row


def per_image(out: torch.Tensor, sizes: torch.Tensor = SIZES) -> list[torch.Tensor]:
    counts = [(int(h) // PATCH) * (int(w) // PATCH) for h, w in sizes]
    return list(out.split(counts))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("theta", [10000.0, 100.0])
def test_inherited_rope_gives_the_towers_own_outputs_on_a_packed_batch(attn: str, theta: float) -> None:
    model = pixtral(attn, theta)
    x = images()
    expected = run(model, x)
    vispos.patch(model, "rope2d")
    assert model.vispos.settings["inherited"] == {"from": "transformers PixtralVisionModel"}
    assert model.vispos.settings["options"] | {"theta": theta} == model.vispos.settings["options"]
    torch.testing.assert_close(run(model, x), expected, rtol=1e-5, atol=1e-5)
    single = x[:1, :, :32, :40]  # one image, no image_sizes: the whole tensor
    fresh = pixtral(attn, theta)
    with torch.no_grad():
        torch.testing.assert_close(model(single).last_hidden_state, fresh(single).last_hidden_state,
                                   rtol=1e-5, atol=1e-5)  # fmt: skip


def test_the_tower_inside_a_llava_model_is_patched_and_the_language_model_left_alone() -> None:
    torch.manual_seed(0)
    vision = tf.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    image_size=32, patch_size=PATCH)  # fmt: skip
    text = tf.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, vocab_size=64, head_dim=16)  # fmt: skip
    vlm = tf.LlavaForConditionalGeneration(tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=5,
                                                   vision_feature_select_strategy="full"))
    vlm.eval()
    language = {n: type(m) for n, m in vlm.model.language_model.named_modules()}
    x = images()
    with torch.no_grad():
        expected = vlm.model.get_image_features(pixel_values=x, image_sizes=SIZES)
        vispos.patch(vlm, "rope2d")
        got = vlm.model.get_image_features(pixel_values=x, image_sizes=SIZES)
    expected = getattr(expected, "pooler_output", expected)
    got = getattr(got, "pooler_output", got)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert isinstance(vlm.model.vision_tower.vispos, Positions)
    assert {n: type(m) for n, m in vlm.model.language_model.named_modules()} == language
    assert vlm.config.vispos["tower"] == "model.vision_tower"


@pytest.mark.parametrize("scheme", ["rope2d_mixed", "alibi2d", "relbias2d", "pape2d"])
def test_every_image_of_a_packed_row_gets_what_it_gets_alone(scheme: str) -> None:
    model = vispos.patch(pixtral(), scheme, inherit=False)
    with torch.no_grad():
        for p in model.vispos.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # tables and frequencies off their init
    x = images()
    packed = per_image(run(model, x))
    for i, (h, w) in enumerate(SIZES.tolist()):
        alone = run(model, x[i : i + 1, :, :h, :w], SIZES[i : i + 1])
        torch.testing.assert_close(packed[i], alone, rtol=1e-5, atol=1e-5)


def test_linear_scaling_of_the_inherited_rope_is_pixtrals_rope_at_scaled_positions(monkeypatch) -> None:
    """vispos.configure(scaling="linear") on the inherited RoPE above the training grid (4x4 patches of 8): each axis
    divided by its own factor, size / 4; the reference is the unpatched tower with its position ids so divided."""
    sizes = torch.tensor([[64, 48]])  # 8 x 6 patches: factors 2 (rows) and 1.5 (columns)
    x = torch.randn(1, 3, 64, 48, generator=torch.Generator().manual_seed(2))
    reference = pixtral()
    own = modeling_pixtral.PixtralVisionRotaryEmbedding.forward

    def scaled(self, x, position_ids):  # noqa: ANN001, ANN202
        return own(self, x, position_ids / torch.tensor([2.0, 1.5]))

    monkeypatch.setattr(modeling_pixtral.PixtralVisionRotaryEmbedding, "forward", scaled)
    expected = run(reference, x, sizes)
    monkeypatch.undo()
    model = vispos.patch(pixtral(), "rope2d")
    plain = run(model, x, sizes)
    vispos.configure(model, scaling="linear")
    got = run(model, x, sizes)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (got - plain).abs().max() > 1e-2
    inside = torch.tensor([[32, 24]])  # within the training grid: no scaling
    torch.testing.assert_close(run(model, x[:, :, :32, :24], inside), run(pixtral(), x[:, :, :32, :24], inside),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_save_pretrained_and_from_pretrained_give_the_same_outputs(tmp_path) -> None:
    model = vispos.patch(pixtral(), "rope2d_mixed", inherit=False)
    with torch.no_grad():
        for p in model.vispos.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    loaded = vispos.hf.from_pretrained(tmp_path)
    x = images()
    torch.testing.assert_close(run(loaded, x), run(model, x), rtol=1e-5, atol=1e-5)
    copied = copy.deepcopy(model)  # the patched classes survive a copy (and pickle finds them by name)
    torch.testing.assert_close(run(copied, x), run(model, x), rtol=1e-5, atol=1e-5)


def test_unsupported_schemes_and_towers_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="learned2d on PixtralVisionModel: the tower has no token table"):
        vispos.patch(pixtral(), ["learned2d", "rope2d"])
    model = vispos.patch(pixtral(), "rope2d")
    with pytest.raises(ValueError, match="already patched"):
        vispos.patch(model, "rope2d")
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    config = tf.Qwen2VLVisionConfig(depth=1, embed_dim=32, hidden_size=32, num_heads=2, patch_size=4)
    qwen = Qwen2VisionTransformerPretrainedModel._from_config(config)
    with pytest.raises(TypeError, match=r"Qwen2-VL's vision encoder .* supported vision towers: PixtralVisionModel"):
        vispos.patch(qwen, "rope2d")


def test_a_discarded_rope_is_said() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vispos.patch(pixtral(), "alibi2d")
    assert any("PixtralVisionModel" in str(w.message) and "discarded" in str(w.message) for w in caught)
