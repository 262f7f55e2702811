"""The vision towers of vision-language models: Pixtral's encoder (``PixtralVisionModel``, alone or inside a
``LlavaForConditionalGeneration`` / Mistral 3 model), read from transformers 5.x ``models/pixtral/modeling_pixtral.py``.

Pixtral packs a batch into one row: each image's patch grid (``image_sizes`` [B, 2] in pixels, its
``patch_size`` cutting the padded ``pixel_values``) row-major, image after image, with a block-diagonal mask
(``generate_block_attention_mask``; flash attention: ``cu_seq_lens``) and no prefix token. Its RoPE
(``PixtralVisionRotaryEmbedding``) rotates every token by its own image's (row, column): the half layout, the rows
on the first half of the pairs, and the axes sharing out one RoPE of the head width, theta ** (-2i / d), rows its
even i, columns its odd i; as ``rope2d`` that is ``axes="yx", layout="half", bands="alternate"`` at
``rope_parameters["rope_theta"]``.

Patched, the tower keeps transformers' forward (its packing, its mask and the outputs it records) and gets one
more keyword, ``vispos_context``: the packed row as a vispos ragged batch (``Positions.ragged_context`` with one
segment per image, each image the size it has alone), which transformers' layers hand to their attention; the
RoPE module computes nothing (``NoRope``). Attention schemes only: the tower has no token table, so an additive
or conditional scheme is refused by name.

Towers not supported are refused by name (``REFUSED_TOWERS``), with the supported list.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .. import host as hosting
from ..host import HostShape, OwnRope
from ..positions import Positions
from .modules import NoRope, PatchedAttention, PatchedTower, patched

# class name of the tower -> the attention class of its layers
TOWERS: dict[str, str] = {"PixtralVisionModel": "PixtralAttention"}

REFUSED_TOWERS: dict[str, str] = {
    "Qwen2VisionTransformerPretrainedModel": "Qwen2-VL's vision encoder (merged 2x2 patches, 1D-packed video frames)",
    "Qwen2_5_VisionTransformerPretrainedModel": "Qwen2.5-VL's vision encoder (window attention over merged patches)",
    "Qwen3VLVisionModel": "Qwen3-VL's vision encoder (interpolated learned positions beside its RoPE, deepstack)",
    "Idefics3VisionTransformer": "Idefics3 / SmolVLM's SigLIP tower (image tiles with a fixed table)",
}


def find_tower(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(its name in ``model``, the tower) for a supported vision tower in ``model`` (the model itself or a VLM
    holding it), None when there is none; an unsupported tower is refused by name."""
    found = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in REFUSED_TOWERS:
            raise TypeError(
                f"vispos.patch does not support {REFUSED_TOWERS[kind]} ({kind}) yet; supported vision towers: "
                f"{', '.join(TOWERS)}"
            )
        if kind in TOWERS:  # a patched class keeps its transformers name
            found.append((name, module))
    if len(found) > 1:
        names = ", ".join(name or "the model" for name, _ in found)
        raise ValueError(f"this model holds several vision towers ({names}): patch each one (vispos.patch(tower, ...))")
    return found[0] if found else None


def tower_attentions(tower: nn.Module) -> list[nn.Module]:
    """The tower's self-attention modules, in layer order."""
    kind = TOWERS[type(tower).__name__]  # a patched class keeps its transformers name
    return [m for m in tower.modules() if type(m).__name__ == kind]


def pixtral_rope(tower: nn.Module) -> OwnRope:
    """Pixtral's RoPE as ``rope2d`` options (module docstring)."""
    config = tower.config
    parameters = getattr(config, "rope_parameters", None) or {}  # older releases: config.rope_theta
    theta = float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    options = {"theta": theta, "coords": "pixel", "axes": "yx", "layout": "half", "offset": 0.0, "bands": "alternate"}
    return OwnRope("rope2d", options, f"transformers {type(tower).__name__}")


def pixtral_grid(config: Any) -> tuple[int, int]:
    """The patch grid of the configured (largest) image size."""
    size = config.image_size
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    return h // config.patch_size, w // config.patch_size


def patch_tower(tower: nn.Module, pos: Any, inherit: bool, options: dict[str, Any]) -> Positions:
    """Build ``tower``'s positions and patch its classes (``patching.patch`` reaches here for a VLM tower)."""
    layers = tower_attentions(tower)
    own = pixtral_rope(tower) if inherit else None
    schemes, per_scheme, kept = hosting.plan_schemes(pos, options, own=own, has_table=False)
    additive, attention, conditional = schemes
    if additive is not None or conditional is not None:
        which = (additive or conditional).name
        raise ValueError(
            f"{which} on {type(tower).__name__}: the tower has no token table or hook for additive and conditional "
            "schemes; use an attention scheme (rope2d and the other rotary, bias and channel schemes)"
        )
    config = tower.config
    shape = HostShape(config.hidden_size, config.num_attention_heads, layers[0].head_dim, len(layers), 0)
    grid = pixtral_grid(config)
    positions = hosting.build_positions(shape, schemes, per_scheme, grid, 0, kept)
    tower.vispos = positions.train(tower.training)
    tower.__class__ = patched(type(tower), PatchedTower)
    for i, attn in enumerate(layers):
        attn.__class__ = patched(type(attn), PatchedAttention)
        attn.vispos_layer = i
    rope = tower.patch_positional_embedding
    rope.__class__ = patched(type(rope), NoRope)
    return positions
