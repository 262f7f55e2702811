"""A patched transformers model goes where transformers' checkpoints go: ``vispos.hf.from_pretrained`` takes
transformers' loader keywords with their meaning, patched classes are transformers' code to transformers (its key
conversions apply on saving and loading, VLM classes included), are never built from a config, and run its
weight init. Tiny random configs; outputs compared with the patched model in memory."""

from __future__ import annotations

import inspect

import pytest
import torch
from safetensors import safe_open

import vispos
from vispos.positions import Positions

tf = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SIZE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
            patch_size=8)  # fmt: skip


def vit() -> torch.nn.Module:
    torch.manual_seed(0)
    return tf.ViTModel(tf.ViTConfig(**SIZE), add_pooling_layer=False).eval()


def dinov3() -> torch.nn.Module:
    torch.manual_seed(0)
    return tf.DINOv3ViTModel(tf.DINOv3ViTConfig(num_register_tokens=4, **SIZE)).eval()


def off_init(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.vispos.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def last(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x.to(model.dtype)).last_hidden_state.float()


def saved_keys(folder) -> set[str]:
    keys: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            keys |= set(handle.keys())
    return keys


def test_a_patched_dinov3_saves_its_keys_as_transformers_writes_them(tmp_path) -> None:
    dinov3().save_pretrained(tmp_path / "plain")
    model = vispos.patch(dinov3(), "rope2d")
    assert not type(model).is_custom_code()
    model.save_pretrained(tmp_path / "patched")
    plain, patched = saved_keys(tmp_path / "plain"), saved_keys(tmp_path / "patched")
    assert {k for k in patched if not k.startswith("vispos.")} == plain
    loaded = vispos.hf.from_pretrained(tmp_path / "patched")
    x = torch.randn(1, 3, 32, 40)
    torch.testing.assert_close(last(loaded, x), last(model, x), rtol=1e-5, atol=1e-6)


def test_the_class_of_a_patched_model_is_never_built_from_a_config(tmp_path) -> None:
    model = vispos.patch(vit(), "rope2d")
    model.save_pretrained(tmp_path)
    with pytest.raises(TypeError, match=r"vispos\.hf\.from_pretrained"):
        type(model)(model.config)
    with pytest.raises(TypeError, match=r"vispos\.hf\.from_pretrained"):
        type(model).from_pretrained(tmp_path)


@pytest.mark.parametrize("build", [vit, dinov3])
def test_the_class_of_a_patched_model_keeps_the_constructor_signature_of_the_family(build) -> None:
    """What reads the options a model class takes from its constructor (transformers' tests pass
    ``use_mask_token=True`` where it is named) reads the family's, while the constructor still refuses."""
    model = build()
    before = inspect.signature(type(model).__init__)
    vispos.patch(model, "rope2d")
    assert inspect.signature(type(model).__init__) == before
    assert inspect.signature(model.__init__) == inspect.signature(build().__init__)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_pretrained_takes_transformers_loader_keywords(dtype, tmp_path) -> None:
    """A sharded checkpoint saved in ``dtype``, loaded with ``dtype="auto"`` (the checkpoint's), a device map
    (every block on the CPU, one on disk), the loading report and the other loader keywords."""
    model = off_init(vispos.patch(vit(), ["learned2d", "rope2d"], inherit=False)).to(dtype)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1  # sharded
    x = torch.randn(1, 3, 32, 48)
    loaded, info = vispos.hf.from_pretrained(tmp_path, dtype="auto", output_loading_info=True, use_safetensors=True,
                                             low_cpu_mem_usage=True, ignore_mismatched_sizes=False)  # fmt: skip
    assert loaded.dtype == dtype and not info["missing_keys"] and not info["unexpected_keys"]
    torch.testing.assert_close(last(loaded, x), last(model, x), rtol=1e-5, atol=1e-6)
    device_map = {"embeddings": "cpu", "vispos": "cpu", "layers.0": "cpu", "layers.1": "disk", "layernorm": "cpu"}
    offloaded = vispos.hf.from_pretrained(tmp_path, dtype="auto", device_map=device_map,
                                          offload_folder=str(tmp_path / "offload"))  # fmt: skip
    torch.testing.assert_close(last(offloaded, x), last(model, x), rtol=1e-5, atol=1e-6)
    auto = vispos.hf.from_pretrained(tmp_path, dtype=torch.float32, device_map="auto")
    torch.testing.assert_close(last(auto, x), last(model.float(), x), rtol=0, atol=0)


QWEN_ROPE = {"rope_type": "default", "mrope_section": [2, 2, 4], "rope_theta": 1e4}
GRID_THW = torch.tensor([[1, 4, 6], [1, 2, 4]])


def qwen2_vl() -> torch.nn.Module:
    vision = tf.Qwen2VLVisionConfig(depth=2, embed_dim=64, hidden_size=32, num_heads=4, patch_size=4,
                                    spatial_merge_size=2, temporal_patch_size=2, mlp_ratio=2)  # fmt: skip
    text = tf.Qwen2VLTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1, vocab_size=64, rope_parameters=QWEN_ROPE)  # fmt: skip
    return tf.Qwen2VLForConditionalGeneration(tf.Qwen2VLConfig(vision_config=vision, text_config=text))


def qwen2_5_vl() -> torch.nn.Module:
    vision = tf.Qwen2_5_VLVisionConfig(depth=2, hidden_size=64, out_hidden_size=32, num_heads=4, patch_size=4,
                                       intermediate_size=128, spatial_merge_size=2, temporal_patch_size=2,
                                       window_size=16, fullatt_block_indexes=[1])  # fmt: skip
    text = tf.Qwen2_5_VLTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=64, rope_parameters=QWEN_ROPE)  # fmt: skip
    return tf.Qwen2_5_VLForConditionalGeneration(tf.Qwen2_5_VLConfig(vision_config=vision.to_dict(),
                                                                      text_config=text))  # fmt: skip


def qwen3_vl() -> torch.nn.Module:
    vision = tf.Qwen3VLVisionConfig(depth=2, hidden_size=64, out_hidden_size=32, num_heads=4, patch_size=4,
                                    intermediate_size=128, spatial_merge_size=2, temporal_patch_size=2,
                                    num_position_embeddings=16, deepstack_visual_indexes=[0])  # fmt: skip
    text = tf.Qwen3VLTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1, vocab_size=64, head_dim=16, rope_parameters=QWEN_ROPE)
    return tf.Qwen3VLForConditionalGeneration(tf.Qwen3VLConfig(vision_config=vision.to_dict(), text_config=text))


def llava() -> torch.nn.Module:
    vision = tf.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    image_size=32, patch_size=8)  # fmt: skip
    text = tf.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, vocab_size=64, head_dim=16)  # fmt: skip
    return tf.LlavaForConditionalGeneration(tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=5,
                                                           vision_feature_select_strategy="full"))  # fmt: skip


def mistral3() -> torch.nn.Module:
    vision = tf.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    image_size=32, patch_size=8)  # fmt: skip
    text = tf.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, vocab_size=64, head_dim=16)  # fmt: skip
    config = tf.Mistral3Config(vision_config=vision, text_config=text, image_token_index=5, spatial_merge_size=2)
    return tf.Mistral3ForConditionalGeneration(config)


def qwen_features(vlm: torch.nn.Module) -> torch.Tensor:
    x = torch.randn(int((GRID_THW[:, 0] * GRID_THW[:, 1] * GRID_THW[:, 2]).sum()), 3 * 2 * 4 * 4,
                    generator=torch.Generator().manual_seed(1))  # fmt: skip
    with torch.no_grad():
        return vlm.model.visual(x, grid_thw=GRID_THW).last_hidden_state


def pixtral_features(vlm: torch.nn.Module) -> torch.Tensor:
    x = torch.randn(2, 3, 32, 40, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return vlm.model.vision_tower(x, image_sizes=torch.tensor([[32, 40], [16, 24]])).last_hidden_state


VLMS = {"qwen2_vl": (qwen2_vl, qwen_features), "qwen2_5_vl": (qwen2_5_vl, qwen_features),
        "qwen3_vl": (qwen3_vl, qwen_features), "llava": (llava, pixtral_features),
        "mistral3": (mistral3, pixtral_features)}  # fmt: skip


@pytest.mark.parametrize("family", VLMS)
def test_a_patched_vlm_saves_in_transformers_layout_and_loads_back(family, tmp_path) -> None:
    build, features = VLMS[family]
    torch.manual_seed(0)
    plain = build().eval()
    plain.save_pretrained(tmp_path / "plain")
    torch.manual_seed(0)
    vlm = build().eval()
    with pytest.warns(vispos.PretrainedPositionsWarning):  # its own RoPE replaced
        vispos.patch(vlm, "rope2d_mixed")
    off_init(vlm.model.visual if hasattr(vlm.model, "visual") else vlm.model.vision_tower)
    vlm.save_pretrained(tmp_path / "patched")
    plain_keys, keys = saved_keys(tmp_path / "plain"), saved_keys(tmp_path / "patched")
    assert {k for k in keys if ".vispos." not in k} == plain_keys  # the layout transformers writes
    loaded = vispos.hf.from_pretrained(tmp_path / "patched")
    assert type(loaded) is type(vlm)
    torch.testing.assert_close(features(loaded), features(vlm), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["deit", "dinov2_reg", "siglip"])
def test_transformers_init_runs_on_patched_models_whose_table_vispos_holds(family) -> None:
    """``initialize_weights`` (a load with missing weights, a meta-device build) on a family whose init writes to its
    own table: it runs, and leaves vispos's table alone when it is marked loaded (as transformers marks the weights a
    checkpoint gave)."""
    build = {
        "deit": lambda: tf.DeiTModel(tf.DeiTConfig(**SIZE)),
        "dinov2_reg": lambda: tf.Dinov2WithRegistersModel(tf.Dinov2WithRegistersConfig(num_register_tokens=2,
                                                                                       **SIZE)),  # fmt: skip
        "siglip": lambda: tf.SiglipVisionModel(tf.SiglipVisionConfig(**SIZE)),
    }[family]
    model = vispos.patch(build(), "learned2d")
    table = next(m for m in model.modules() if isinstance(getattr(m, "vispos", None), Positions)).vispos.additive.table
    before = table.detach().clone()
    table._is_hf_initialized = True
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    model.initialize_weights()
    torch.testing.assert_close(table.detach(), before, rtol=0, atol=0)


@pytest.mark.parametrize("build", [vit, dinov3])
def test_a_patched_forward_keeps_the_signature_of_the_forward_it_replaces(build) -> None:
    model = build()
    before = inspect.signature(model.forward)
    vispos.patch(model, "rope2d")
    assert inspect.signature(model.forward) == before


@pytest.mark.parametrize("pos", [["relbias2d"], ["learned2d", "rope2d_mixed"], ["cpb2d"]])
def test_transformers_init_initialises_vispos_weights_as_vispos_does(pos) -> None:
    """A meta-device build, patched, ``to_empty`` and ``initialize_weights`` (what transformers does before a load):
    every positional weight is initialised as its scheme initialises it (a fresh build under the same seed), none left
    as the memory ``to_empty`` gave."""
    with torch.device("meta"):
        model = tf.DINOv3ViTModel(tf.DINOv3ViTConfig(num_register_tokens=4, **SIZE))
    vispos.patch(model, pos, inherit=False)
    model.to_empty(device="cpu")
    with torch.no_grad():  # what to_empty may leave: any bytes
        for tensor in [*model.vispos.parameters(), *model.vispos.buffers()]:
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    torch.manual_seed(3)
    model.initialize_weights()
    torch.manual_seed(3)
    fresh = vispos.patch(tf.DINOv3ViTModel(tf.DINOv3ViTConfig(num_register_tokens=4, **SIZE)), pos, inherit=False)
    fresh_state = fresh.vispos.state_dict()
    for name, tensor in model.vispos.state_dict().items():
        if tensor.is_floating_point():
            assert torch.isfinite(tensor).all(), name
            assert tensor.shape == fresh_state[name].shape
    for name, tensor in [*model.vispos.named_buffers()]:
        torch.testing.assert_close(tensor, dict(fresh.vispos.named_buffers())[name], rtol=0, atol=0)


@pytest.mark.parametrize("where", ["disk", "auto"])
def test_settings_survive_a_device_map_that_offloads_the_positions(where, tmp_path) -> None:
    """accelerate fills memory in module order, and ``vispos`` (registered last) is the first module sent to disk:
    its settings record is then not loaded with the weights. The loader reads it from the checkpoint: a model saved
    with a scaling loads with it whatever the device map."""
    model = off_init(vispos.patch(vit(), ["learned2d", "rope2d"], inherit=False))
    vispos.configure(model, scaling="yarn", log_n_attention=True)
    model.save_pretrained(tmp_path)
    x = torch.randn(1, 3, 48, 64)  # above the training grid: the scaling is in use
    if where == "disk":
        device_map = {"embeddings": "cpu", "layers": "cpu", "layernorm": "cpu", "vispos": "disk"}
        kwargs = {"device_map": device_map}
    else:  # the weights fill a memory budget; the rest, vispos first, goes to disk
        kwargs = {"device_map": "auto", "max_memory": {"cpu": "60KB"}}
    loaded = vispos.hf.from_pretrained(tmp_path, offload_folder=str(tmp_path / "offload"), **kwargs)
    assert loaded.vispos_cfg == model.vispos_cfg
    torch.testing.assert_close(last(loaded, x), last(model, x), rtol=1e-5, atol=1e-6)


def test_from_pretrained_takes_transformers_config_keyword(tmp_path) -> None:
    """``config=`` with transformers' meaning: a config object used as it is (as transformers' own save / load and
    attention-implementation tests pass it), or a folder holding one."""
    model = off_init(vispos.patch(vit(), "rope2d", inherit=False))
    model.save_pretrained(tmp_path)
    x = torch.randn(1, 3, 32, 48)
    config = tf.AutoConfig.from_pretrained(tmp_path)
    config._attn_implementation = "eager"
    loaded = vispos.hf.from_pretrained(tmp_path, config=config)
    assert loaded.config._attn_implementation == "eager" and loaded.vispos_cfg == model.vispos_cfg
    torch.testing.assert_close(last(loaded, x), last(model, x), rtol=1e-5, atol=1e-5)
    again = vispos.hf.from_pretrained(tmp_path, config=str(tmp_path))
    torch.testing.assert_close(last(again, x), last(model, x), rtol=1e-5, atol=1e-5)
