"""Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's vision towers in transformers, alone and inside their VLMs (Qwen2.5-VL's with
window attention, Qwen3-VL's with a learned table and DeepStack), on pre-cut patches of two images and a two-frame video
packed into one sequence. Tiny random configs (``hf_towers``).

The patched tower gives the unpatched tower's outputs with its RoPE inherited, every frame what it gets alone with any
other scheme, and the inherited RoPE scaled per axis as the tower's own RoPE would be at scaled positions."""

from __future__ import annotations

import pickle

import pytest
import torch

import vispos

tf = pytest.importorskip("transformers")

from hf_towers import GRID_THW, QWENS, off_init, patch_the_vlm, patches, qwen, reloaded, run_qwen  # noqa: E402
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl  # noqa: E402
from transformers.models.qwen2_vl import modeling_qwen2_vl  # noqa: E402
from transformers.models.qwen3_vl import modeling_qwen3_vl  # noqa: E402

TOWER_NAMES = {"qwen2_vl": "Qwen2VisionTransformerPretrainedModel",
               "qwen2_5_vl": "Qwen2_5_VisionTransformerPretrainedModel", "qwen3_vl": "Qwen3VLVisionModel"}  # fmt: skip
ROTARIES = {"qwen2_vl": modeling_qwen2_vl.Qwen2VLVisionRotaryEmbedding,
            "qwen2_5_vl": modeling_qwen2_5_vl.Qwen2_5_VLVisionRotaryEmbedding,
            "qwen3_vl": modeling_qwen3_vl.Qwen3VLVisionRotaryEmbedding}  # fmt: skip


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
