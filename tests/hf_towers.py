"""Tiny random VLM vision towers of transformers and their inputs, for the towers' tests: Pixtral's encoder on a batch
of three images packed into one row (``pixtral``, ``images``, ``run``), Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's on
pre-cut patches of two images and a two-frame video (``qwen``, ``patches``, ``run_qwen``); positional parameters moved
off their init, a save / load round trip, and a VLM patched around its tower."""

from __future__ import annotations

import pytest
import torch

import vispos

tf = pytest.importorskip("transformers")

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


def patches(grid_thw: torch.Tensor = GRID_THW, seed: int = 3) -> torch.Tensor:
    tokens = int((grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).sum())
    return torch.randn(tokens, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(seed))


def run_qwen(model: torch.nn.Module, x: torch.Tensor, grid_thw: torch.Tensor = GRID_THW) -> torch.Tensor:
    with torch.no_grad():
        return model(x, grid_thw=grid_thw).last_hidden_state  # [T, C]
