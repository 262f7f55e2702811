"""A patched Swin's position weights from elsewhere: its own bias at patch time (``adopt_own_bias``), another
window (``resize_stage``, for ``set_input_size``), and plain timm checkpoints of Swin / Swin V2
(``adopt_swin_checkpoint``, a load_state_dict pre-hook that ``swin.patch_swin`` registers).

timm's per-block ``layers.{i}.blocks.{j}.attn.relative_position_bias_table`` (Swin) and ``attn.cpb_mlp.*``
(Swin V2) go to the inherited scheme's ``vispos.stages.{i}.attention.{j}.`` keys; Swin's tables of another window
are resized as timm's ``swin_transformer.checkpoint_filter_fn`` resizes them (``resize_rel_pos_bias_table``),
Swin V2's MLP needs none. ``logit_scale`` keeps its key (the patched attention adopts it). timm's buffers
(``relative_position_index``, ``relative_coords_table``, ``attn_mask``) are dropped, as timm's filter drops them.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from timm.layers import resize_rel_pos_bias_table
from timm.models.swin_transformer import SwinTransformer
from timm.models.swin_transformer_v2 import SwinTransformerV2
from torch import nn

from ..encodings.relbias import ContinuousBias2d, RelBias2d
from ..positions import Positions
from .model import LOAD_ADVICE, adopt_and_match, refuse_unplaced

OWN_BIAS: dict[type, tuple[str, str]] = {  # the scheme each family's own bias is, and where it was read
    SwinTransformer: ("relbias2d", "Swin's relative_position_bias_table"),
    SwinTransformerV2: ("cpb2d", "Swin V2's cpb_mlp"),
}
_BUFFERS = ("relative_position_index", "relative_coords_table", "attn_mask")
_OWN = re.compile(r"layers\.(\d+)\.blocks\.(\d+)\.attn\.(relative_position_bias_table|cpb_mlp\.(.+))$")


def adopt_swin_checkpoint(model: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """``load_state_dict`` pre-hook: a plain timm Swin / Swin V2 checkpoint (same or another window) loads into
    a patched model that inherited its bias; one whose bias the model's scheme has no place for is refused, or
    with ``strict=False`` reported as unexpected."""
    found = adopt_and_match(model, state_dict, prefix, _OWN)
    if found is None:
        return  # a vispos checkpoint: Positions checks it
    for key in [k for k in state_dict if k.startswith(prefix) and k.rsplit(".", 1)[-1] in _BUFFERS]:
        del state_dict[key]
    if not found:
        return
    if not model.vispos.settings.get("inherited"):
        refuse_unplaced(model, "timm Swin's own relative position bias",
                        "patch with the model's own scheme (relbias2d for Swin, cpb2d for Swin V2, inherit=True) to "
                        f"keep it, {LOAD_ADVICE}")  # fmt: skip
        return  # reported by load_state_dict as unexpected keys
    for key, match in found.items():
        i, j = int(match.group(1)), int(match.group(2))
        module = model.vispos.stages[i].attention[j]
        dst = f"{prefix}vispos.stages.{i}.attention.{j}."
        value = state_dict.pop(key)
        if match.group(4) is not None and isinstance(module, ContinuousBias2d):
            state_dict[f"{dst}mlp.{match.group(4)}"] = value
        elif isinstance(module, RelBias2d):
            window = tuple(module.train_grid)
            if value.shape != module.table.shape or window[0] != window[1]:  # timm's checkpoint_filter_fn's rule
                with torch.no_grad():
                    value = resize_rel_pos_bias_table(value, new_window_size=window, new_bias_shape=module.table.shape)
            state_dict[f"{dst}table"] = value
        else:
            state_dict[key] = value  # no place for it: reported as unexpected


# --- set_input_size -----------------------------------------------------------------------------------


def resize_stage(positions: Positions, window: tuple[int, int], *, follow_window: bool) -> None:
    """A stage's positions at a new window (its new grid): relbias2d tables resized by Swin's rule, cpb2d offsets
    normalised by the new window where ``follow_window``; the positions' training grid becomes the window."""
    old = positions.train_grid
    if window == old:
        return
    for module in positions.modules():
        if isinstance(module, RelBias2d):
            shape = ((2 * window[0] - 1) * (2 * window[1] - 1), module.num_heads)
            with torch.no_grad():
                table = resize_rel_pos_bias_table(module.table, new_window_size=window, new_bias_shape=shape,
                                                  old_window_size=old)  # fmt: skip
            module.table = nn.Parameter(table.contiguous(), requires_grad=module.table.requires_grad)
            module.train_grid = window
        elif isinstance(module, ContinuousBias2d):
            module.train_grid = window
            if follow_window:
                module.offset_grid = window
    positions.train_grid = window
    positions.settings["train_grid"] = window
    positions.follow_scaling_grid()


# --- the model's own bias ---


def adopt_own_bias(stage: nn.Module, positions: Positions, family: type) -> bool:
    """Copy each block's own bias into the stage's per-block scheme modules (on a model built on the meta device,
    theirs and ours are meta: the weights arrive with a checkpoint); -> whether cpb2d's offsets follow the
    window (Swin V2 without a ``pretrained_window_size``)."""
    own, source = OWN_BIAS[family]
    follow = False
    with torch.no_grad():
        for blk, module in zip(stage.blocks, positions.attention, strict=True):
            if own == "relbias2d":
                theirs = blk.attn.relative_position_bias_table
                if theirs.is_meta:  # a model built on the meta device: the values arrive with its weights
                    module.table = nn.Parameter(module.table.to("meta"), requires_grad=module.table.requires_grad)
                else:
                    module.table.copy_(theirs)
            else:
                if any(p.is_meta for p in blk.attn.cpb_mlp.parameters()):  # likewise
                    module.mlp.to("meta")
                else:
                    module.mlp.load_state_dict(blk.attn.cpb_mlp.state_dict())
                pretrained = tuple(blk.attn.pretrained_window_size)
                if pretrained[0] > 0:
                    module.offset_grid = pretrained
                follow = pretrained[0] <= 0
    positions.settings["inherited"] = {"from": f"timm {family.__name__}: {source}"}
    return follow


__all__ = ["OWN_BIAS", "adopt_own_bias", "adopt_swin_checkpoint", "resize_stage"]
