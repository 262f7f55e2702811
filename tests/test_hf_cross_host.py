"""The same weights as a timm ViT and as a transformers ViT, patched alike, give the same outputs: each
adapter checked against the other."""

from __future__ import annotations

import pytest
import torch

import vispos

tf = pytest.importorskip("transformers")

from test_hf_patch import SCHEMES_2D, SIZES, config  # noqa: E402


def _timm_to_hf(timm_state: dict[str, torch.Tensor], depth: int) -> dict[str, torch.Tensor]:
    """timm ViT weights under transformers ViTModel's names (qkv split into q, k, v)."""
    out = {
        "embeddings.cls_token": timm_state["cls_token"],
        "embeddings.patch_embeddings.projection.weight": timm_state["patch_embed.proj.weight"],
        "embeddings.patch_embeddings.projection.bias": timm_state["patch_embed.proj.bias"],
        "layernorm.weight": timm_state["norm.weight"], "layernorm.bias": timm_state["norm.bias"],
    }  # fmt: skip
    for i in range(depth):
        t, h = f"blocks.{i}.", f"layers.{i}."
        for part, value in zip("qkv", timm_state[t + "attn.qkv.weight"].chunk(3), strict=True):
            out[f"{h}attention.{part}_proj.weight"] = value
        for part, value in zip("qkv", timm_state[t + "attn.qkv.bias"].chunk(3), strict=True):
            out[f"{h}attention.{part}_proj.bias"] = value
        pairs = {"attn.proj": "attention.o_proj", "norm1": "layernorm_before", "norm2": "layernorm_after",
                 "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}  # fmt: skip
        for a, b in pairs.items():
            for kind in ("weight", "bias"):
                out[f"{h}{b}.{kind}"] = timm_state[f"{t}{a}.{kind}"]
    out |= {k: v for k, v in timm_state.items() if k.startswith("vispos.")}
    return out


@pytest.mark.parametrize("scheme", SCHEMES_2D)
def test_the_same_weights_on_timm_and_transformers_give_the_same_outputs(scheme: str) -> None:
    timm = pytest.importorskip("timm")
    t = timm.create_model("vit_base_patch16_224", img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4,
                          mlp_ratio=1.0, num_classes=0, global_pool="", class_token=True).eval()  # fmt: skip
    vispos.patch(t, scheme, inherit=False)
    with torch.no_grad():
        for p in t.vispos.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # trained-looking positional parameters, copied across
    h = tf.ViTModel(config(tf.ViTConfig, layer_norm_eps=1e-6, qkv_bias=True), add_pooling_layer=False).eval()
    vispos.patch(h, scheme, inherit=False)
    h.load_state_dict(_timm_to_hf(t.state_dict(), 2), strict=True)
    for size in SIZES:
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            torch.testing.assert_close(h(x).last_hidden_state, t.forward_features(x), rtol=1e-5, atol=1e-5)
