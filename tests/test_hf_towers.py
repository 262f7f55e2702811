"""VLM vision towers in transformers: Pixtral's encoder (alone and inside a Llava model), Qwen2-VL's, Qwen2.5-VL's and
Qwen3-VL's (alone and inside their VLMs; Qwen2.5-VL's with window attention, Qwen3-VL's with a learned table and
DeepStack). Tiny random configs.

Both pack a batch into one sequence, each image (or video frame) at its own size: the patched tower must give the
unpatched tower's outputs with its RoPE inherited, every image what it gets alone with any other scheme, and the
inherited RoPE scaled per axis as the tower's own RoPE would be at scaled positions."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

import vispos
from vispos.positions import Positions

tf = pytest.importorskip("transformers")

from transformers.models.pixtral import modeling_pixtral  # noqa: E402
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl  # noqa: E402
from transformers.models.qwen2_vl import modeling_qwen2_vl  # noqa: E402
from transformers.models.qwen3_vl import modeling_qwen3_vl  # noqa: E402

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


def off_init(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its positional parameters (tables, frequencies) moved off their init."""
    with torch.no_grad():
        for p in model.vispos.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def reloaded(model: torch.nn.Module, path) -> torch.nn.Module:  # noqa: ANN001
    """``model`` through save_pretrained and ``vispos.hf.from_pretrained``."""
    model.save_pretrained(path)
    return vispos.hf.from_pretrained(path)


def patch_the_vlm(vlm: torch.nn.Module, tower: str, **inputs: torch.Tensor) -> None:
    """``vispos.patch(vlm, "rope2d")``: the image features (the tower and the VLM's projection) stay as they were,
    the language model keeps its classes, and the record names the tower."""
    language = {n: type(m) for n, m in vlm.model.language_model.named_modules()}
    with torch.no_grad():
        expected = vlm.model.get_image_features(**inputs)
        vispos.patch(vlm, "rope2d")
        got = vlm.model.get_image_features(**inputs)
    for a, b in zip(getattr(got, "pooler_output", got), getattr(expected, "pooler_output", expected), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert {n: type(m) for n, m in vlm.model.language_model.named_modules()} == language
    assert vlm.config.vispos["tower"] == tower


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


# --- Qwen2-VL: pre-cut patches [T, 3 * 2 * 4 * 4] in 2 x 2 merge blocks, grid_thw (frames, rows, columns) ---------
GRID_THW = torch.tensor([[1, 4, 6], [2, 2, 4], [1, 6, 2]])  # two images and a two-frame video
# Qwen2.5-VL's windows of 2 x 2 merge blocks: the 4 x 6 image cuts into a full window and a 2 x 1 one, the 6 x 2 into a
# full one and a 1 x 1, each 2 x 4 frame is one window


def qwen(attn: str = "sdpa", family: str = "qwen2_vl") -> torch.nn.Module:
    """Qwen2-VL's tower; Qwen2.5-VL's: three layers, the middle one attending over whole frames and the others
    within windows of 16 px (2 x 2 merge blocks of 2 x 2 patches of 4), so that the grids below cut into windows of
    several sizes; Qwen3-VL's: three layers, a 4 x 4 learned table (random, not the init's), DeepStack features of
    the first two."""
    torch.manual_seed(0)
    if family == "qwen2_vl":
        config = tf.Qwen2VLVisionConfig(depth=2, embed_dim=64, hidden_size=32, num_heads=4, patch_size=4,
                                        spatial_merge_size=2, temporal_patch_size=2, mlp_ratio=2)  # fmt: skip
        tower = modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel
    elif family == "qwen3_vl":
        config = tf.Qwen3VLVisionConfig(depth=3, hidden_size=64, out_hidden_size=32, num_heads=4, patch_size=4,
                                        intermediate_size=128, spatial_merge_size=2, temporal_patch_size=2,
                                        num_position_embeddings=16, deepstack_visual_indexes=[0, 1])  # fmt: skip
        tower = modeling_qwen3_vl.Qwen3VLVisionModel
    else:
        config = tf.Qwen2_5_VLVisionConfig(depth=3, hidden_size=64, out_hidden_size=32, num_heads=4, patch_size=4,
                                           intermediate_size=128, spatial_merge_size=2, temporal_patch_size=2,
                                           window_size=16, fullatt_block_indexes=[1])  # fmt: skip
        tower = modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel
    config._attn_implementation = attn
    model = tower._from_config(config).eval()
    with torch.no_grad():  # sharper attention than the random init's
        for block in model.blocks:
            block.attn.qkv.weight.mul_(4.0)
        if family == "qwen3_vl":
            model.pos_embed.weight.normal_()
    return model


QWENS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
TOWER_NAMES = {"qwen2_vl": "Qwen2VisionTransformerPretrainedModel",
               "qwen2_5_vl": "Qwen2_5_VisionTransformerPretrainedModel", "qwen3_vl": "Qwen3VLVisionModel"}  # fmt: skip
ROTARIES = {"qwen2_vl": modeling_qwen2_vl.Qwen2VLVisionRotaryEmbedding,
            "qwen2_5_vl": modeling_qwen2_5_vl.Qwen2_5_VLVisionRotaryEmbedding,
            "qwen3_vl": modeling_qwen3_vl.Qwen3VLVisionRotaryEmbedding}  # fmt: skip


def patches(grid_thw: torch.Tensor = GRID_THW, seed: int = 3) -> torch.Tensor:
    tokens = int((grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).sum())
    return torch.randn(tokens, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(seed))


def run_qwen(model: torch.nn.Module, x: torch.Tensor, grid_thw: torch.Tensor = GRID_THW) -> torch.Tensor:
    with torch.no_grad():
        return model(x, grid_thw=grid_thw).last_hidden_state  # [T, C]


@pytest.mark.parametrize("family", QWENS)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_qwen_inherited_rope_gives_the_towers_own_outputs(attn: str, family: str) -> None:
    model = qwen(attn, family)
    x = patches()
    with torch.no_grad():
        expected = model(x, grid_thw=GRID_THW)
        vispos.patch(model, "rope2d")
        got = model(x, grid_thw=GRID_THW)
    assert model.vispos.settings["inherited"] == {"from": f"transformers {TOWER_NAMES[family]}"}
    torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.pooler_output, expected.pooler_output, rtol=1e-5, atol=1e-5)  # the merger's
    for ours, theirs in zip(getattr(got, "deepstack_features", []), getattr(expected, "deepstack_features", []),
                            strict=True):  # fmt: skip
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)  # Qwen3-VL's DeepStack mergers'


@pytest.mark.parametrize("family", QWENS)
@pytest.mark.parametrize("scheme", ["rope2d_mixed", "alibi2d", "pape2d"])
def test_qwen_every_frame_gets_what_it_gets_alone(scheme: str, family: str) -> None:
    model = off_init(vispos.patch(qwen(family=family), scheme, inherit=False))
    x = patches()
    packed = run_qwen(model, x)
    start = 0
    for t, h, w in GRID_THW.tolist():
        for _ in range(t):  # each frame alone: one image of its size
            frame = slice(start, start + h * w)
            alone = run_qwen(model, x[frame], torch.tensor([[1, h, w]]))
            torch.testing.assert_close(packed[frame], alone, rtol=1e-5, atol=1e-5)
            start += h * w


@pytest.mark.parametrize("family", QWENS)
def test_qwen_linear_scaling_is_its_rope_at_scaled_positions(monkeypatch, family: str) -> None:
    grid = torch.tensor([[1, 8, 6]])  # against a training grid of 4 x 4: factors 2 (rows) and 1.5 (columns)
    x = patches(grid)
    own = ROTARIES[family].forward

    def scaled(self, x, position_ids):  # noqa: ANN001, ANN202
        return own(self, x, position_ids / torch.tensor([2.0, 1.5]))

    monkeypatch.setattr(ROTARIES[family], "forward", scaled)
    expected = run_qwen(qwen(family=family), x, grid)
    monkeypatch.undo()
    model = vispos.patch(qwen(family=family), "rope2d")
    plain = run_qwen(model, x, grid)
    vispos.configure(model, scaling="linear", train_grid=(4, 4))
    got = run_qwen(model, x, grid)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (got - plain).abs().max() > 1e-2


def test_qwen2_vl_inside_its_vlm_and_saved_and_loaded(tmp_path) -> None:
    torch.manual_seed(0)
    vision = tf.Qwen2VLVisionConfig(depth=2, embed_dim=64, hidden_size=32, num_heads=4, patch_size=4,
                                    spatial_merge_size=2, temporal_patch_size=2, mlp_ratio=2)  # fmt: skip
    rope = {"rope_type": "default", "mrope_section": [2, 2, 4], "rope_theta": 1e4}
    text = tf.Qwen2VLTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1, vocab_size=64, rope_parameters=rope)  # fmt: skip
    vlm = tf.Qwen2VLForConditionalGeneration(tf.Qwen2VLConfig(vision_config=vision, text_config=text)).eval()
    x = patches()
    patch_the_vlm(vlm, "model.visual", pixel_values=x, image_grid_thw=GRID_THW)
    tower = off_init(vispos.patch(qwen(), "rope2d_mixed", inherit=False))
    loaded = reloaded(tower, tmp_path)
    torch.testing.assert_close(run_qwen(loaded, x), run_qwen(tower, x), rtol=1e-5, atol=1e-5)


def test_qwen2_5_vl_inside_its_vlm_saved_and_loaded_and_given_its_window_order(tmp_path) -> None:
    torch.manual_seed(0)
    tower = qwen(family="qwen2_5_vl")
    rope = {"rope_type": "default", "mrope_section": [2, 2, 4], "rope_theta": 1e4}
    text = tf.Qwen2_5_VLTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=64, rope_parameters=rope)  # fmt: skip
    config = tf.Qwen2_5_VLConfig(vision_config=tower.config.to_dict(), text_config=text)
    vlm = tf.Qwen2_5_VLForConditionalGeneration(config).eval()
    x = patches()
    patch_the_vlm(vlm, "model.visual", pixel_values=x, image_grid_thw=GRID_THW)
    model = off_init(vispos.patch(tower, "alibi2d", inherit=False))
    loaded = reloaded(model, tmp_path)
    torch.testing.assert_close(run_qwen(loaded, x), run_qwen(model, x), rtol=1e-5, atol=1e-5)
    unpickled = pickle.loads(pickle.dumps(model))  # the patched classes are found by name
    torch.testing.assert_close(run_qwen(unpickled, x), run_qwen(model, x), rtol=1e-5, atol=1e-5)
    # a window order the caller computed beforehand (transformers' precomputed keywords) is the one followed: here
    # the merge blocks in their own order, each frame one window
    frames = GRID_THW[:, 0] * GRID_THW[:, 1] * GRID_THW[:, 2]
    given = {"window_index": torch.arange(int(frames.sum()) // 4),
             "cu_window_seqlens": torch.nn.functional.pad(frames.cumsum(0), (1, 0)).int()}  # fmt: skip
    reference = qwen(family="qwen2_5_vl")
    with torch.no_grad():
        expected = reference(x, grid_thw=GRID_THW, **given).last_hidden_state
        got = vispos.patch(qwen(family="qwen2_5_vl"), "rope2d")(x, grid_thw=GRID_THW, **given).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (expected - run_qwen(reference, x)).abs().max() > 1e-2  # not the tower's own windows


def test_qwen3_vl_keeps_its_table_with_its_rope_and_drops_both_otherwise() -> None:
    """Qwen3-VL's learned table goes with its RoPE: ``nope`` with ``inherit=False`` is the unpatched tower with a zero
    table and no rotation (inv_freq 0); replacing the RoPE while inheriting drops the table too, and says so."""
    x = patches()
    reference = qwen(family="qwen3_vl")
    with torch.no_grad():
        reference.pos_embed.weight.zero_()
        reference.rotary_pos_emb.inv_freq.zero_()
        expected = run_qwen(reference, x)
        got = run_qwen(vispos.patch(qwen(family="qwen3_vl"), "nope", inherit=False), x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with pytest.warns(UserWarning, match=r"RoPE and the learned table beside it \(pos_embed\) .* is discarded"):
        replaced = vispos.patch(qwen(family="qwen3_vl"), "alibi2d")
    fresh = vispos.patch(qwen(family="qwen3_vl"), "alibi2d", inherit=False)
    torch.testing.assert_close(run_qwen(replaced, x), run_qwen(fresh, x), rtol=1e-5, atol=1e-5)
    assert "pos_embed.weight" in replaced.state_dict()  # dropped from the sum, kept in the checkpoint
    with pytest.raises(ValueError, match=r"learned2d on Qwen3VLVisionModel: the tower has a table of its own"):
        vispos.patch(qwen(family="qwen3_vl"), ["learned2d", "rope2d"])


def test_qwen3_vl_inside_its_vlm_and_saved_and_loaded(tmp_path) -> None:
    tower = qwen(family="qwen3_vl")
    rope = {"rope_type": "default", "mrope_section": [2, 2, 4], "rope_theta": 1e4}
    text = tf.Qwen3VLTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                num_key_value_heads=1, vocab_size=64, head_dim=16, rope_parameters=rope)  # fmt: skip
    vlm = tf.Qwen3VLForConditionalGeneration(tf.Qwen3VLConfig(vision_config=tower.config.to_dict(), text_config=text))
    vlm.eval()
    x = patches()
    patch_the_vlm(vlm, "model.visual", pixel_values=x, image_grid_thw=GRID_THW)
    model = vispos.patch(tower, "rope2d")
    vispos.configure(model, scaling="yarn", train_grid=(2, 2))
    loaded = reloaded(model, tmp_path)
    torch.testing.assert_close(run_qwen(loaded, x), run_qwen(model, x), rtol=1e-5, atol=1e-5)
    unpickled = pickle.loads(pickle.dumps(vispos.patch(qwen(family="qwen3_vl"), "nope", inherit=False)))
    assert not unpickled.pos_embed(torch.arange(3)).any()  # the table stays dropped


def test_unsupported_schemes_and_towers_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="learned2d on PixtralVisionModel: the tower has no token table"):
        vispos.patch(pixtral(), ["learned2d", "rope2d"])
    model = vispos.patch(pixtral(), "rope2d")
    with pytest.raises(ValueError, match="already patched"):
        vispos.patch(model, "rope2d")
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionTransformer

    config = tf.Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     image_size=32, patch_size=4)  # fmt: skip
    tower = Idefics3VisionTransformer._from_config(config)
    with pytest.raises(TypeError, match=r"Idefics3 / SmolVLM's SigLIP tower .* supported vision towers: "
                       "PixtralVisionModel, Qwen2VisionTransformerPretrainedModel, "
                       "Qwen2_5_VisionTransformerPretrainedModel, Qwen3VLVisionModel"):  # fmt: skip
        vispos.patch(tower, "rope2d")
    with pytest.raises(ValueError, match=r"grid_thw must be a tensor \[N, 3\]"):
        vispos.patch(qwen(), "rope2d")(patches(), grid_thw=torch.tensor([4, 6]))
    with pytest.raises(ValueError, match="does not tile into 2 x 2 merge blocks"):
        vispos.patch(qwen(), "rope2d")(patches(torch.tensor([[1, 3, 6]])), grid_thw=torch.tensor([[1, 3, 6]]))


def test_a_discarded_rope_is_said() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vispos.patch(pixtral(), "alibi2d")
    assert any("PixtralVisionModel" in str(w.message) and "discarded" in str(w.message) for w in caught)
