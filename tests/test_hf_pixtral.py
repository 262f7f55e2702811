"""Pixtral's vision encoder in transformers, alone and inside a Llava model, on a batch of three images packed into one
sequence, each at its own size. Tiny random configs (``hf_towers``).

The patched tower gives the unpatched tower's outputs with its RoPE inherited, every image what it gets alone with any
other scheme, and the inherited RoPE scaled per axis as the tower's own RoPE would be at scaled positions."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import vispos
from vispos.positions import Positions

tf = pytest.importorskip("transformers")

from hf_towers import PATCH, SIZES, images, off_init, patch_the_vlm, pixtral, reloaded, run  # noqa: E402
from transformers.models.pixtral import modeling_pixtral  # noqa: E402


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
    patch_the_vlm(vlm, "model.vision_tower", pixel_values=images(), image_sizes=SIZES)
    assert isinstance(vlm.model.vision_tower.vispos, Positions)


@pytest.mark.parametrize("scheme", ["rope2d_mixed", "alibi2d", "relbias2d", "pape2d"])
def test_every_image_of_a_packed_row_gets_what_it_gets_alone(scheme: str) -> None:
    model = off_init(vispos.patch(pixtral(), scheme, inherit=False))
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
    model = off_init(vispos.patch(pixtral(), "rope2d_mixed", inherit=False))
    loaded = reloaded(model, tmp_path)
    x = images()
    torch.testing.assert_close(run(loaded, x), run(model, x), rtol=1e-5, atol=1e-5)
    copied = copy.deepcopy(model)  # the patched classes survive a copy (and pickle finds them by name)
    torch.testing.assert_close(run(copied, x), run(model, x), rtol=1e-5, atol=1e-5)


def test_a_discarded_rope_is_said() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vispos.patch(pixtral(), "alibi2d")
    assert any("PixtralVisionModel" in str(w.message) and "discarded" in str(w.message) for w in caught)
