"""The vision towers of vision-language models, read from transformers 5.x:

- Pixtral's encoder (``PixtralVisionModel``, alone or inside a ``LlavaForConditionalGeneration`` / Mistral 3
  model; ``models/pixtral/modeling_pixtral.py``). It packs a batch into one row: each image's patch grid
  (``image_sizes`` [B, 2] in pixels, its ``patch_size`` cutting the padded ``pixel_values``) row-major, image after
  image, with a block-diagonal mask (flash attention: ``cu_seq_lens``) and no prefix token. Its RoPE
  (``PixtralVisionRotaryEmbedding``) rotates every token by its own image's (row, column): the half layout, the rows
  on the first half of the pairs, the axes sharing out one RoPE of the head width, theta ** (-2i / d), rows its even
  i, columns its odd i; as ``rope2d``: ``axes="yx", layout="half", bands="alternate"``.
- Qwen2-VL's encoder (``Qwen2VisionTransformerPretrainedModel``, alone or inside ``Qwen2VLForConditionalGeneration``;
  ``models/qwen2_vl/modeling_qwen2_vl.py``). Its input is one sequence [T, C * t * p * p] of pre-cut patches of every
  image and video (``grid_thw`` [N, 3]: frames, rows, columns of each), each frame's patches in blocks of
  ``spatial_merge_size`` x ``spatial_merge_size`` (the blocks row-major, each block row-major), frame after frame,
  and every frame attends to itself alone (``cu_seqlens``). Its RoPE (``Qwen2VLVisionRotaryEmbedding``): the half
  layout, rows on the first half of the pairs, theta ** (-4j / d) on each axis; as ``rope2d``: ``axes="yx",
  layout="half"``. The patch merger after the blocks is left as it is. Qwen2-VL trains at native resolution: it
  has no training grid, and vispos takes ``QWEN_GRID`` (32 x 32 patches) as the grid RoPE scaling counts from
  (``vispos.configure(model, scaling=..., train_grid=(H, W))`` gives another).
- Qwen2.5-VL's encoder (``Qwen2_5_VisionTransformerPretrainedModel``, alone or inside
  ``Qwen2_5_VLForConditionalGeneration``; ``models/qwen2_5_vl/modeling_qwen2_5_vl.py``): Qwen2-VL's sequence, RoPE
  and merger, with the merge blocks reordered window by window before the first block (``window_index`` of
  ``transformers.vision_utils.get_vision_window_index``: windows of ``window_size`` pixels, row-major in each frame,
  each window's blocks row-major) and back after the merger. Its layers attend within each window
  (``cu_window_seqlens``) but at ``fullatt_block_indexes``, within each frame; the positions follow the reordered
  tokens, so every scheme sees each token at its own cell whichever segment the layer attends over.
- Qwen3-VL's encoder (``Qwen3VLVisionModel``, alone or inside ``Qwen3VLForConditionalGeneration``;
  ``models/qwen3_vl/modeling_qwen3_vl.py``): Qwen2-VL's sequence, RoPE and frame-by-frame attention, a learned table
  (``pos_embed``, a square grid interpolated bilinearly to each image's grid and added after the patch embedding)
  and DeepStack (the merged features of some layers, ``deepstack_visual_indexes``). Kept with the inherited RoPE,
  the table stays the tower's own (transformers computes it); when the RoPE is replaced or ``inherit=False``, the
  table goes with it (``TowerTable``: every lookup zero). DeepStack's mergers are left as they are.

Patched, a tower keeps transformers' forward (its packing, its mask and the outputs it records) and gets one more
keyword, ``vispos_context``: the packed sequence as a vispos ragged batch (``Positions.ragged_context`` with one
segment per image or frame, each at the size it has alone), which transformers' layers hand to their attention.
Pixtral's RoPE module then computes nothing (``NoRope``); the Qwens' are left to compute what no layer reads.
Attention schemes only: no tower has a hook for vispos's additive or conditional schemes, which are refused by name,
and the query-dependent biases (decomposed2d, irpe2d), built for one grid, are refused as the towers always pack.

Towers not supported are refused by name (``REFUSED_TOWERS``), with the supported list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from .. import host as hosting
from ..host import HostShape, OwnRope
from ..positions import Positions
from .modules import NoRope, PatchedAttention, patched
from .tower_modules import PatchedMergedTower, PatchedPackedAttention, PatchedTower, PatchedWindowedTower, TowerTable

QWEN_GRID = (32, 32)  # the grid RoPE scaling counts from on Qwen2-VL, which has no training grid


def image_size_grid(config: Any) -> tuple[int, int]:
    """The patch grid of the configured (largest) image size (Pixtral)."""
    size = config.image_size
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    return h // config.patch_size, w // config.patch_size


@dataclass(frozen=True)
class Tower:
    """One supported tower: the class name of its attention, the mixins its tower and attention classes take, its
    RoPE's ``bands`` as ``rope2d``, the RoPE module that computes nothing once patched (None: left as it is), the
    config fields of its width and heads, the grid its positions count from, and the learned table the tower adds
    itself (None: it has none)."""

    attention: str
    host: type
    layer: type
    bands: str
    rope_module: str | None
    width: str
    heads: str
    grid: Callable[[Any], tuple[int, int]]
    table: str | None = None


TOWERS: dict[str, Tower] = {
    "PixtralVisionModel": Tower("PixtralAttention", PatchedTower, PatchedAttention, "alternate",
                                "patch_positional_embedding", "hidden_size", "num_attention_heads", image_size_grid),
    "Qwen2VisionTransformerPretrainedModel": Tower("VisionAttention", PatchedMergedTower, PatchedPackedAttention,
                                                   "shared", None, "embed_dim", "num_heads", lambda _: QWEN_GRID),
    "Qwen2_5_VisionTransformerPretrainedModel": Tower("Qwen2_5_VLVisionAttention", PatchedWindowedTower,
                                                      PatchedPackedAttention, "shared", None, "hidden_size",
                                                      "num_heads", lambda _: QWEN_GRID),
    "Qwen3VLVisionModel": Tower("Qwen3VLVisionAttention", PatchedMergedTower, PatchedPackedAttention, "shared", None,
                                "hidden_size", "num_heads", lambda _: QWEN_GRID, table="pos_embed"),
}  # fmt: skip

REFUSED_TOWERS: dict[str, str] = {
    "Idefics3VisionTransformer": "Idefics3 / SmolVLM's SigLIP tower (each image's patches look its fixed table up by "
    "bucketed fractional coordinates, a lookup no vispos table reproduces)",
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
    kind = TOWERS[type(tower).__name__].attention  # a patched class keeps its transformers name
    return [m for m in tower.modules() if type(m).__name__ == kind]


def own_rope(tower: nn.Module) -> OwnRope:
    """The tower's RoPE as ``rope2d`` options (module docstring)."""
    config = tower.config
    parameters = getattr(config, "rope_parameters", None) or {}  # older releases: config.rope_theta
    theta = float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    spec = TOWERS[type(tower).__name__]
    options = {"theta": theta, "coords": "pixel", "axes": "yx", "layout": "half", "offset": 0.0, "bands": spec.bands}
    what = "RoPE" if spec.table is None else f"RoPE and the learned table beside it ({spec.table})"
    return OwnRope("rope2d", options, f"transformers {type(tower).__name__}", what=what)


def tower_shape(tower: nn.Module, layers: list[nn.Module]) -> tuple[HostShape, tuple[int, int]]:
    """The tower's widths, heads and depth, and the grid its positions count from (``Tower.grid``)."""
    spec, config = TOWERS[type(tower).__name__], tower.config
    shape = HostShape(getattr(config, spec.width), getattr(config, spec.heads), layers[0].head_dim, len(layers), 0)
    return shape, spec.grid(config)


def patch_tower(tower: nn.Module, pos: Any, inherit: bool, options: dict[str, Any]) -> Positions:
    """Build ``tower``'s positions and patch its classes (``patching.patch`` reaches here for a VLM tower)."""
    layers = tower_attentions(tower)
    spec = TOWERS[type(tower).__name__]
    own = own_rope(tower) if inherit else None
    schemes, per_scheme, kept = hosting.plan_schemes(pos, options, own=own, has_table=False)  # a table: its own
    additive, attention, conditional = schemes
    if additive is not None or conditional is not None:
        which = (additive or conditional).name
        has = "no token table" if spec.table is None else f"a table of its own ({spec.table}, kept with its RoPE)"
        raise ValueError(
            f"{which} on {type(tower).__name__}: the tower has {has} and no hook for vispos's additive and conditional "
            "schemes; use an attention scheme (rope2d and the other rotary, bias and channel schemes)"
        )
    hosting.refuse_one_grid(attention, type(tower).__name__, "this tower packs every batch, one segment per image")
    shape, grid = tower_shape(tower, layers)
    positions = hosting.build_positions(shape, schemes, per_scheme, grid, 0, kept)
    tower.vispos = positions.train(tower.training)
    tower.__class__ = patched(type(tower), spec.host)
    for i, attn in enumerate(layers):
        attn.__class__ = patched(type(attn), spec.layer)
        attn.vispos_layer = i
    if spec.rope_module is not None:
        rope = getattr(tower, spec.rope_module)
        rope.__class__ = patched(type(rope), NoRope)
    if spec.table is not None:  # the table goes with the RoPE it was trained beside
        table = getattr(tower, spec.table)
        table.__class__ = patched(type(table), TowerTable)
        table.__dict__["vispos_positions"] = positions
    return positions
