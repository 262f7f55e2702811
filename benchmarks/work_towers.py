"""The VLM vision towers' rows of the counted benchmark (``benchmarks.patch_work --towers``).

Pixtral's encoder, Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's, each at ViT-S's size (384 wide, 6 heads of 64, 12
layers, patch 16; the Qwens' 2 x 2 merge blocks and two-frame patches; Qwen2.5-VL's windows of 128 px, 8 x 8 patches,
as its release's 112 px windows of 14 px patches, with full attention at layers 3, 7 and 11, a quarter of its layers
as in the release; Qwen3-VL's 48 x 48 learned table and DeepStack features after layers 2, 5 and 8), random init,
fed the benchmark's [B, 3, S, S] images: Pixtral packs the B images into one row; for the Qwens the images are cut
into their pre-cut patches (the same reshape in every row, so it cancels) with ``grid_thw`` one frame of
S/16 x S/16 per image. Three rows per tower:

- the tower patched with ``nope`` (``inherit=False``): no positions (Qwen3-VL: no table either), the baseline;
- the unpatched tower, its own RoPE: what transformers' RoPE adds;
- the tower patched with ``rope2d``, its RoPE inherited (equal outputs): what vispos's adds.

The floors are the rotary floor of ``work_floor`` (q and k read and written once per layer plus the cos / sin
table of the tokens, [B N, head_dim] twice in fp32).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import nn

import vispos

WIDTH, HEADS, LAYERS, PATCH = 384, 6, 12, 16


class TowerAsViT(nn.Module):
    """A tower fed image batches [B, 3, S, S], returning its last hidden state, with the attributes the floors
    read from a timm ViT (``blocks[i].attn`` with ``num_heads`` and ``head_dim``, ``patch_embed.grid_size``,
    ``num_prefix_tokens``, ``vispos``)."""

    def __init__(self, tower: nn.Module, size: int) -> None:
        super().__init__()
        self.tower = tower
        self.qwen = hasattr(tower, "spatial_merge_size")
        layers = tower.blocks if self.qwen else tower.transformer.layers
        attns = [layer.attn if self.qwen else layer.attention for layer in layers]
        self.__dict__["blocks"] = [SimpleNamespace(attn=attn) for attn in attns]  # plain references, no submodules
        self.__dict__["patch_embed"] = SimpleNamespace(grid_size=(size // PATCH, size // PATCH))
        self.num_prefix_tokens = 0

    @property
    def vispos(self) -> nn.Module:
        return self.tower.vispos

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if not self.qwen:
            return self.tower(images).last_hidden_state
        b, c, h, w = images.shape
        gh, gw = h // PATCH, w // PATCH
        patches = images.reshape(b * gh * gw, c * PATCH * PATCH).repeat(1, 2)  # two frames a patch, as Qwen2-VL cuts
        grid_thw = torch.tensor([[1, gh, gw]] * b)
        return self.tower(patches, grid_thw=grid_thw).last_hidden_state


def pixtral(size: int) -> nn.Module:
    import transformers as tf

    config = tf.PixtralVisionConfig(hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=LAYERS,
                                    num_attention_heads=HEADS, image_size=size, patch_size=PATCH,
                                    attn_implementation="sdpa")  # fmt: skip
    return tf.PixtralVisionModel(config)


def qwen2_vl(size: int) -> nn.Module:
    import transformers as tf
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    config = tf.Qwen2VLVisionConfig(depth=LAYERS, embed_dim=WIDTH, hidden_size=WIDTH, num_heads=HEADS, mlp_ratio=4,
                                    patch_size=PATCH, spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
    config._attn_implementation = "sdpa"
    return Qwen2VisionTransformerPretrainedModel._from_config(config)


def qwen2_5_vl(size: int) -> nn.Module:
    import transformers as tf
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = tf.Qwen2_5_VLVisionConfig(depth=LAYERS, hidden_size=WIDTH, out_hidden_size=WIDTH, num_heads=HEADS,
                                       intermediate_size=4 * WIDTH, patch_size=PATCH, spatial_merge_size=2,
                                       temporal_patch_size=2, window_size=8 * PATCH,
                                       fullatt_block_indexes=[3, 7, 11])  # fmt: skip
    config._attn_implementation = "sdpa"
    return Qwen2_5_VisionTransformerPretrainedModel._from_config(config)


def qwen3_vl(size: int) -> nn.Module:
    import transformers as tf
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    config = tf.Qwen3VLVisionConfig(depth=LAYERS, hidden_size=WIDTH, out_hidden_size=WIDTH, num_heads=HEADS,
                                    intermediate_size=4 * WIDTH, patch_size=PATCH, spatial_merge_size=2,
                                    temporal_patch_size=2, num_position_embeddings=48 * 48,
                                    deepstack_visual_indexes=[2, 5, 8])  # fmt: skip
    config._attn_implementation = "sdpa"
    return Qwen3VLVisionModel._from_config(config)


TOWERS: dict[str, Callable[[int], nn.Module]] = {
    "PixtralVisionModel": pixtral, "Qwen2-VL vision": qwen2_vl, "Qwen2.5-VL vision": qwen2_5_vl,
    "Qwen3-VL vision": qwen3_vl,
}  # fmt: skip


def tower_rows() -> list[tuple[str, Callable[[int], nn.Module], str, str]]:
    """(label, build at an image size, baseline label, kind) for every tower's three rows."""
    rows = []
    for name, build in TOWERS.items():
        base = f"transformers {name} (ViT-S size) without positions"
        def plain(size: int, b: Callable[[int], nn.Module] = build) -> nn.Module:
            return TowerAsViT(vispos.patch(b(size), "nope", inherit=False), size)

        def own(size: int, b: Callable[[int], nn.Module] = build) -> nn.Module:
            return TowerAsViT(b(size), size)

        def inherited(size: int, b: Callable[[int], nn.Module] = build) -> nn.Module:
            return TowerAsViT(vispos.patch(b(size), "rope2d"), size)

        rows.append((base, plain, "", ""))
        rows.append((f"transformers {name} (ViT-S size)", own, base, "rotary"))
        rows.append((f"vispos rope2d (inherited) on {name}", inherited, base, "rotary"))
    return rows


def own_table_bytes(model: TowerAsViT, batch: int) -> int:
    """Bytes of a tower's own cos / sin tables for its tokens: [B N, head_dim] twice, fp32."""
    grid = model.patch_embed.grid_size
    return 2 * batch * grid[0] * grid[1] * model.blocks[0].attn.head_dim * 4
