"""Big models as people hold them, on the CPU: a patched timm ViT, a transformers DINOv3 and a Qwen2.5-VL model
(tiny configs) saved as sharded safetensors and loaded with a device map that puts some blocks on ``"cpu"`` and
some on ``"disk"`` (accelerate's offloading): equal to the patched model in memory, in fp32 and in bf16."""

from __future__ import annotations

import pytest
import torch

import vispos

accelerate = pytest.importorskip("accelerate")
tf = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")

from accelerate import init_empty_weights, load_checkpoint_and_dispatch  # noqa: E402
from huggingface_hub import save_torch_state_dict  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
SHARD = "40KB"  # several shards of each tiny model


def off_init(positions: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in positions.parameters():
            p.add_(torch.randn_like(p) * 0.1)


def shards(folder) -> int:
    return len(list(folder.glob("*.safetensors")))


@pytest.mark.parametrize("dtype", DTYPES)
def test_timm_vit_sharded_and_offloaded_to_cpu_and_disk(dtype, tmp_path) -> None:
    def build() -> torch.nn.Module:
        return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=3, embed_dim=64, num_heads=4,
                                 mlp_ratio=2.0, num_classes=0)  # fmt: skip

    torch.manual_seed(0)
    model = vispos.patch(build(), ["learned2d", "rope2d"], inherit=False)
    off_init(model.vispos)
    model = model.to(dtype).eval()
    (tmp_path / "ckpt").mkdir()
    save_torch_state_dict(model.state_dict(), tmp_path / "ckpt", max_shard_size="150KB")  # accelerate: ~0.6 s a shard
    assert shards(tmp_path / "ckpt") > 1
    with init_empty_weights():
        empty = build()
    vispos.patch(empty, ["learned2d", "rope2d"], inherit=False)
    device_map = {"patch_embed": "cpu", "cls_token": "cpu", "vispos": "cpu", "blocks.0": "cpu", "blocks.1": "disk",
                  "blocks.2": "disk", "norm": "cpu", "fc_norm": "cpu", "head": "cpu", "head_drop": "cpu",
                  "pos_drop": "cpu", "patch_drop": "cpu", "norm_pre": "cpu"}  # fmt: skip
    loaded = load_checkpoint_and_dispatch(empty.to(dtype), str(tmp_path / "ckpt"), device_map=device_map,
                                          offload_folder=str(tmp_path / "offload"), dtype=dtype)  # fmt: skip
    x = torch.randn(2, 3, 32, 48, dtype=dtype)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dinov3_sharded_and_offloaded_to_cpu_and_disk(dtype, tmp_path) -> None:
    torch.manual_seed(0)
    config = tf.DINOv3ViTConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
                                image_size=32, patch_size=8, num_register_tokens=4)  # fmt: skip
    model = vispos.patch(tf.DINOv3ViTModel(config), "rope2d")
    model = model.to(dtype).eval()
    model.save_pretrained(tmp_path / "ckpt", max_shard_size=SHARD)
    assert shards(tmp_path / "ckpt") > 1
    device_map = {"embeddings": "cpu", "vispos": "cpu", "rope_embeddings": "cpu", "model.layer.0": "cpu",
                  "model.layer.1": "disk", "model.layer.2": "disk", "norm": "cpu"}  # fmt: skip
    loaded = vispos.hf.from_pretrained(tmp_path / "ckpt", dtype="auto", device_map=device_map,
                                       offload_folder=str(tmp_path / "offload"))  # fmt: skip
    assert loaded.dtype == dtype
    x = torch.randn(2, 3, 32, 40, dtype=dtype)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).last_hidden_state, model(x).last_hidden_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qwen2_5_vl_sharded_and_offloaded_to_cpu_and_disk(dtype, tmp_path) -> None:
    torch.manual_seed(0)
    vision = tf.Qwen2_5_VLVisionConfig(depth=3, hidden_size=64, out_hidden_size=32, num_heads=4, patch_size=4,
                                       intermediate_size=128, spatial_merge_size=2, temporal_patch_size=2,
                                       window_size=16, fullatt_block_indexes=[1])  # fmt: skip
    rope = {"rope_type": "default", "mrope_section": [2, 2, 4], "rope_theta": 1e4}
    text = tf.Qwen2_5_VLTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=64, rope_parameters=rope)  # fmt: skip
    vlm = tf.Qwen2_5_VLForConditionalGeneration(tf.Qwen2_5_VLConfig(vision_config=vision.to_dict(), text_config=text))
    vispos.patch(vlm, "rope2d")
    off_init(vlm.model.visual.vispos)
    vlm = vlm.to(dtype).eval()
    vlm.save_pretrained(tmp_path / "ckpt", max_shard_size=SHARD)
    assert shards(tmp_path / "ckpt") > 1
    device_map = {"model.visual.patch_embed": "cpu", "model.visual.rotary_pos_emb": "cpu", "model.visual.vispos": "cpu",
                  "model.visual.blocks.0": "cpu", "model.visual.blocks.1": "disk", "model.visual.blocks.2": "cpu",
                  "model.visual.merger": "disk", "model.language_model": "cpu", "lm_head": "cpu"}  # fmt: skip
    loaded = vispos.hf.from_pretrained(tmp_path / "ckpt", dtype="auto", device_map=device_map,
                                       offload_folder=str(tmp_path / "offload"))  # fmt: skip
    grid = torch.tensor([[1, 4, 6], [2, 2, 4]])
    x = torch.randn(int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum()), 3 * 2 * 4 * 4, dtype=dtype)
    with torch.no_grad():
        got = loaded.model.visual(x, grid_thw=grid).pooler_output
        expected = vlm.model.visual(x, grid_thw=grid).pooler_output
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
