"""The transformers vision families vispos patches, as data: where each keeps its tokens, table and layers.

Each family is recognised by the class name of its embeddings module (``ViTEmbeddings``...), read from
the source of transformers 5.x (``models/<family>/modeling_<family>.py``):

- ViT: prefix ``cls_token``; table ``position_embeddings``; resized bicubic, no antialias.
- DeiT: prefix ``cls_token``, ``distillation_token``; table ``position_embeddings``; as ViT.
- DINOv2: prefix ``cls_token``; table ``position_embeddings``; resized bicubic in fp32, no antialias.
- DINOv2 with registers: as DINOv2, then ``register_tokens``; resized bicubic in fp32 with antialias.
- DINOv3: prefix ``cls_token``, then ``register_tokens``; no table: a RoPE (``rope_embeddings``).
- CLIP: prefix ``class_embedding``; table ``position_embedding`` (``nn.Embedding``); as ViT.
- SigLIP: no prefix; table ``position_embedding``; as ViT.
- SigLIP 2 (NaFlex): no prefix; table ``position_embedding``, resized per image to its ``spatial_shapes``,
  bilinear with antialias; pre-cut patches (``pixel_values`` [B, N, C * p * p] through a Linear), each row
  one image, its H*W patches row-major, then padding (``pixel_attention_mask`` False).

The table covers the prefix tokens (one row each) and then the patch grid row-major; register tokens sit
after the prefix tokens and carry no position. DINOv3 rotates patch tokens only
(``DINOv3ViTRopePositionEmbedding``): patch centres in [-1, 1] per axis, y then x, the half layout,
``theta ** (-4j / head_dim)``, and the coordinate augmentation of its config in training mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..host import OwnRope


@dataclass(frozen=True)
class Family:
    """One transformers vision family: ``prefix`` tokens (each with a row of the learned ``table``, an
    attribute path of the embeddings module), ``registers`` after them (no position), and how the family
    resizes its table (``antialias``); ``rope``: a RoPE of its own in the model's ``rope_embeddings``."""

    name: str
    prefix: tuple[str, ...]
    table: str | None
    registers: str | None = None
    antialias: bool = False
    rope: bool = False
    interpolation: str = "bicubic"
    naflex: bool = False  # rows of pre-cut patches at each image's own grid (``spatial_shapes``)


FAMILIES: dict[str, Family] = {
    "ViTEmbeddings": Family("ViT", ("cls_token",), "position_embeddings"),
    "DeiTEmbeddings": Family("DeiT", ("cls_token", "distillation_token"), "position_embeddings"),
    "Dinov2Embeddings": Family("DINOv2", ("cls_token",), "position_embeddings"),
    "Dinov2WithRegistersEmbeddings": Family(
        "DINOv2 with registers", ("cls_token",), "position_embeddings", "register_tokens", antialias=True
    ),
    "DINOv3ViTEmbeddings": Family("DINOv3", ("cls_token",), None, "register_tokens", rope=True),
    "CLIPVisionEmbeddings": Family("CLIP", ("class_embedding",), "position_embedding.weight"),
    "SiglipVisionEmbeddings": Family("SigLIP", (), "position_embedding.weight"),
    "Siglip2VisionEmbeddings": Family(
        "SigLIP 2", (), "position_embedding.weight", antialias=True, interpolation="bilinear", naflex=True
    ),
}

# the attention classes of those families (q_proj / k_proj / v_proj and o_proj or out_proj)
ATTENTIONS: frozenset[str] = frozenset({
    "ViTAttention", "DeiTAttention", "Dinov2Attention", "Dinov2WithRegistersAttention", "DINOv3ViTAttention",
    "CLIPAttention", "SiglipAttention", "Siglip2Attention",
})  # fmt: skip

# the model classes' constructor options that their config does not hold (every other optional part of these
# families is a config field: DINOv2's use_mask_token, SigLIP's vision_use_head), each with the state-dict entry
# of the part it adds: a checkpoint's keys say how its model was built
CONSTRUCTOR_OPTIONS: dict[str, dict[str, str]] = {
    "ViTModel": {"add_pooling_layer": "pooler", "use_mask_token": "embeddings.mask_token"},
    "DeiTModel": {"add_pooling_layer": "pooler", "use_mask_token": "embeddings.mask_token"},
}

# families refused by name: positions of their own inside attention, or batches vispos does not read yet
REFUSED: dict[str, str] = {
    "BeitEmbeddings": "BEiT / Data2Vec-Vision: a relative position bias of its own inside every attention layer",
    "Data2VecVisionEmbeddings": "Data2Vec-Vision: a relative position bias of its own inside every attention layer",
    "SwinEmbeddings": "Swin: window attention with a relative position bias of its own",
    "Swinv2Embeddings": "Swin V2: window attention with a continuous position bias of its own",
    "DonutSwinEmbeddings": "Donut Swin: window attention with a relative position bias of its own",
    "VitDetEmbeddings": "ViTDet: windowed attention with decomposed relative positions of its own",
}


def find_host(model: nn.Module) -> tuple[str, nn.Module, Family]:
    """(its name in ``model``, the vision module, its family): the module that owns a vision ``embeddings``
    (the model itself, the backbone of a head such as ``ViTForImageClassification.vit``, or the vision
    tower of a two-tower model such as ``CLIPModel.vision_model``). Refused families raise by name."""
    found = []
    for name, module in model.named_modules():
        embeddings = module.__dict__.get("_modules", {}).get("embeddings")
        kind = type(embeddings).__name__ if embeddings is not None else None
        if kind in REFUSED:
            raise TypeError(f"vispos.patch does not support transformers {type(module).__name__}: {REFUSED[kind]}")
        if kind in FAMILIES and not any(name.startswith(f"{outer}.") or not outer for outer, _, _ in found):
            found.append((name, module, FAMILIES[kind]))
    if not found:
        supported = ", ".join(f.name for f in FAMILIES.values())
        raise TypeError(
            f"vispos.patch found no vision model it supports in transformers {type(model).__name__}; supported "
            f"families: {supported} (the model itself, a head over it, or the vision tower of CLIP / SigLIP)"
        )
    if len(found) > 1:
        names = ", ".join(name or "the model" for name, _, _ in found)
        raise ValueError(f"this model holds several vision towers ({names}): patch each one (vispos.patch(tower, ...))")
    return found[0]


def attentions(host: nn.Module) -> list[nn.Module]:
    """The host's self-attention modules, in layer order."""
    return [m for m in host.modules() if type(m).__name__ in ATTENTIONS]


def naflex_layout(spatial_shapes: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SigLIP 2's rows -> (cells [B, N, 2] (y, x), valid [B, N]): row b holds its image's H*W patches
    row-major (``spatial_shapes[b]`` = (H, W)), then padding (cell (0, 0), not valid)."""
    if not isinstance(spatial_shapes, torch.Tensor) or spatial_shapes.dim() != 2 or spatial_shapes.shape[1] != 2:
        raise ValueError(f"spatial_shapes must be a tensor [B, 2] of (H, W) per image, got {spatial_shapes!r}")
    sizes = spatial_shapes.long()
    n = torch.arange(tokens, device=sizes.device)[None]  # [1, N]
    width = sizes[:, 1:2].clamp(min=1)
    valid = n < sizes[:, :1] * sizes[:, 1:2]
    cells = torch.stack((n // width, n % width), dim=-1) * valid[..., None]
    return cells, valid


def patch_conv(embeddings: nn.Module) -> nn.Conv2d:
    """The convolution that cuts an image into patch tokens (``patch_embeddings.projection``,
    ``patch_embeddings``, ``patch_embedding``)."""
    for module in embeddings.modules():
        if isinstance(module, nn.Conv2d):
            return module
    raise TypeError(f"{type(embeddings).__name__} has no patch convolution")


def patch_size(conv: nn.Conv2d) -> tuple[int, int]:
    return int(conv.stride[0]), int(conv.stride[1])


def token_grid(conv: nn.Conv2d, image: torch.Tensor) -> tuple[int, int]:
    """The grid of patch tokens of an image batch [B, C, H, W]; a size the patches do not divide is refused."""
    if not isinstance(image, torch.Tensor) or image.dim() != 4:
        got = f"shape {tuple(image.shape)}" if isinstance(image, torch.Tensor) else type(image).__name__
        raise ValueError(f"pixel_values must be an image batch [B, C, H, W], got {got}")
    (h, w), (ph, pw) = image.shape[-2:], patch_size(conv)
    if h % ph or w % pw:
        raise ValueError(f"input size {h}x{w} is not divisible by the patch size {ph}x{pw}")
    return h // ph, w // pw


def train_grid(config: object, conv: nn.Conv2d | None) -> tuple[int, int]:
    """The grid of the configured image size (the grid the model's table was made for); SigLIP 2: the square
    grid of its ``num_patches``."""
    if conv is None:
        side = int(round(config.num_patches**0.5))
        return side, side
    size = config.image_size
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    ph, pw = patch_size(conv)
    return h // ph, w // pw


def own_table(embeddings: nn.Module, family: Family) -> torch.Tensor | None:
    """The family's learned table as [1, P + H*W, C] (P: its prefix rows), or None."""
    if family.table is None:
        return None
    table: object = embeddings
    for part in family.table.split("."):
        table = getattr(table, part, None)
    if not isinstance(table, torch.Tensor):
        return None
    return table.detach().reshape(1, -1, table.shape[-1])


def own_rope(host: nn.Module, family: Family) -> OwnRope | None:
    """DINOv3's RoPE as ``rope2d`` options (the module docstring gives the formula it reproduces)."""
    if not family.rope:
        return None
    config = host.config
    options = {
        "theta": float(config.rope_theta), "coords": "normalized", "axes": "yx", "layout": "half", "offset": 0.0,
        "normalize": "separate",
    }  # fmt: skip
    for vispos_name, name in (("shift_coords", "pos_embed_shift"), ("jitter_coords", "pos_embed_jitter"),
                              ("rescale_coords", "pos_embed_rescale")):  # fmt: skip
        value = getattr(config, name, None)
        if value is not None:
            options[vispos_name] = float(value)
    return OwnRope("rope2d", options, f"transformers {type(host).__name__}")
