"""timm's Swin V2-CR (``SwinTransformerV2Cr``) as a patched host: ``patch_swin_cr(model, pos)``.

Swin V2-CR is Swin V2 laid out otherwise: ``stages`` (not ``layers``) that take and give NCHW maps, the
downsampling inside each stage, res-post-norm blocks with an extra main-branch ``norm3`` (the last block of the
last stage: the network's final norm), no ``norm`` after the stages, and a ``WindowMultiHeadAttention`` with
cosine attention (``logit_scale``) and a ``meta_mlp`` bias. The positions are Swin's (``swin.py``): ``model.vispos``
is a ``SwinPositions``, additive and conditional schemes on the full patch grid, one ``Positions`` per stage at
its window shared by every window and block of the stage, the shifted-window mask kept; the forward runs NHWC
from the patch embedding to the last stage and gives NCHW features, as timm's.

Inherited (``inherit=True``, the default): each block's ``meta_mlp`` becomes ``cpb2d`` with
``coords="log"`` (timm's ``sign(d) * log(1 + |d|)`` of the offsets in patches, not normalised by the window),
``output="linear"`` (the MLP's output itself), ``out_bias=True``, ``hidden`` and ``dropout`` those of the MLP
(384 and 0.125 in timm). Cosine attention and ``logit_scale`` stay whatever the scheme. Another scheme discards
the bias with a ``PretrainedPositionsWarning``; ``inherit=False`` starts fresh silently.
``set_input_size(img_size=..., window_size=...)`` is timm's, followed by each stage's positions taking the new
window (``swin_checkpoint.resize_stage``: the log coordinates need no rescaling). A plain timm checkpoint of the
model, at this size or another, loads into an inheriting one: its ``meta_mlp`` weights go to cpb2d
(``adopt_swin_cr_checkpoint``, a load_state_dict pre-hook); a model whose scheme has no place for them refuses
them, or with ``strict=False`` reports them as unexpected.

What the adapter touches in timm's Swin V2-CR: ``patch_embed`` (``strict_img_size`` written False, its NCHW output
permuted), ``stages[i]`` (``downsample``, ``blocks``, ``grad_checkpointing``; not its ``forward``), each block's
``norm1``, ``norm2``, ``norm3``, ``mlp``, ``drop_path1`` / ``drop_path2``, ``window_size``, ``shift_size``,
``dim``, ``attn`` (``qkv``, ``proj``, ``logit_scale`` adopted, ``meta_mlp.fc1`` / ``fc2`` / ``drop1`` read; replaced
by a ``PatchedWindowAttention``); ``set_input_size`` and ``forward_intermediates`` are overridden.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import torch
import torch.fx
from timm.models._features import feature_take_indices
from timm.models.swin_transformer_v2_cr import SwinTransformerV2Cr
from torch import nn

from .. import host
from .._validate import check_bool
from ..host import PositionsHost, warn
from ..positions import Positions
from ..registry import SchemeInfo
from .model import LOAD_ADVICE, adopt_and_match, refuse_unplaced
from .pruning import PrunesPositions
from .swin import SwinPositions, _embed_positions, _stage_positions, embed_patches, run_stage
from .swin_checkpoint import resize_stage
from .window import PatchedWindowAttention

SOURCE = "Swin V2-CR's meta_mlp"
# timm's meta MLP keys -> cpb2d's (``fc1`` -> ``mlp.0``, ``fc2`` -> ``mlp.2``)
_META = re.compile(r"stages\.(\d+)\.blocks\.(\d+)\.attn\.meta_mlp\.fc([12])\.(weight|bias)$")
META_MLP: dict[str, Any] = {"coords": "log", "output": "linear", "out_bias": True}  # the cpb2d it is

torch.fx.wrap("embed_patches")  # torch.fx leaves here too (fx wraps by the calling module's globals)
torch.fx.wrap("run_stage")


class PatchedSwinCr(PrunesPositions, PositionsHost):
    """Mixin placed before timm's SwinTransformerV2Cr: positions from ``self.vispos`` (a ``SwinPositions``)."""

    vispos: SwinPositions

    def _stages(self, x: torch.Tensor, last: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Images -> (NHWC features after stage ``last``, every stage's output up to it, NCHW)."""
        x = embed_patches(self.vispos.embed, self.patch_embed(x).permute(0, 2, 3, 1))
        outs = []
        for i, (stage, positions) in enumerate(zip(self.stages, self.vispos.stages, strict=True)):
            if i > last:
                break
            x = run_stage(stage, positions, x, self.vispos.embed, _starts(self)[i])
            outs.append(x.permute(0, 3, 1, 2))
        return x, outs

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images [B, C, H, W] -> features [B, C', H', W'] (NCHW, as timm's Swin V2-CR)."""
        return self._stages(x, len(self.stages) - 1)[1][-1]

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """timm's ``forward_intermediates`` (stage outputs, NCHW; ``norm`` unused, as timm's) through the patched
        stages."""
        if output_fmt != "NCHW":
            raise ValueError(f"output_fmt must be 'NCHW' (as timm's Swin V2-CR), got {output_fmt!r}")
        take, max_index = feature_take_indices(len(self.stages), indices)
        _, outs = self._stages(x, max_index if stop_early else len(self.stages) - 1)
        intermediates = [out for i, out in enumerate(outs) if i in take]
        return intermediates if intermediates_only else (outs[-1], intermediates)

    def set_input_size(
        self,
        img_size: tuple[int, int] | None = None,
        window_size: Any = None,
        window_ratio: Any = None,
        always_partition: bool | None = None,
    ) -> None:
        """timm's ``set_input_size``; then each stage's positions take its new window (``resize_stage``)."""
        super().set_input_size(img_size=img_size, window_size=window_size, window_ratio=window_ratio,
                               always_partition=always_partition)  # fmt: skip
        self.patch_embed.strict_img_size = False
        for stage, positions in zip(self.stages, self.vispos.stages, strict=True):
            resize_stage(positions, tuple(stage.blocks[0].window_size), follow_window=False)

    def no_weight_decay(self) -> set[str]:
        """Every positional parameter (timm's Swin V2-CR names none of its own)."""
        return {f"vispos.{name}" for name, _ in self.vispos.named_parameters()}

    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """timm's groups; per-block positional modules with their block, the additive and conditional schemes in
        the stem."""
        matcher = dict(super().group_matcher(coarse))
        matcher["stem"] = rf"{matcher['stem']}|^vispos\.embed"
        if coarse:
            matcher["blocks"] = r"^(?:stages|vispos\.stages)\.(\d+)"
        else:
            own = [(r"^vispos\.stages\.(\d+)\.attention\.(\d+)\.", None), (r"^vispos\.stages\.(\d+)\.", (0,))]
            matcher["blocks"] = [*own, *matcher["blocks"]]
        return matcher


class PatchedSwinTransformerV2Cr(PatchedSwinCr, SwinTransformerV2Cr):
    """timm's SwinTransformerV2Cr with vispos positions."""


def _starts(model: nn.Module) -> list[int]:
    """The global index of each stage's first block."""
    sizes = [len(stage.blocks) for stage in model.stages]
    return [sum(sizes[:i]) for i in range(len(sizes))]


def patch_swin_cr(
    model: nn.Module, pos: str | list[str] | tuple[str, ...], *, inherit: bool = True, **options: Any
) -> nn.Module:
    """Give a timm Swin V2-CR the positional scheme ``pos`` (as ``vispos.patch``). ``inherit`` keeps each block's
    ``meta_mlp`` (see the module's docstring). In place; returns the model."""
    if isinstance(model, PatchedSwinCr):
        raise ValueError("this Swin V2-CR is already patched by vispos; patch a fresh model instead")
    if type(model) is not SwinTransformerV2Cr:
        raise TypeError(f"patch_swin_cr takes timm's SwinTransformerV2Cr, got {type(model).__name__}")
    check_bool("inherit", inherit)
    schemes, per_scheme, _ = host.plan_schemes(pos, options, own=None, has_table=False)
    attention = schemes[1]
    meta = model.stages[0].blocks[0].attn.meta_mlp
    own = META_MLP | {"hidden": meta.fc1.out_features, "dropout": meta.drop1.p}
    inherited = inherit and _inherits(attention, per_scheme, own)
    if inherited:
        per_scheme["cpb2d"] = own | per_scheme["cpb2d"]
    embed = _embed_positions(SimpleNamespace(layers=model.stages, patch_embed=model.patch_embed), schemes, per_scheme)
    stages = [_stage_positions(stage, attention, per_scheme) for stage in model.stages]
    if inherited:
        for stage, positions in zip(model.stages, stages, strict=True):
            _adopt_meta_mlp(stage, positions)
    names = [i.name for i in schemes if i is not None] or ["nope"]
    model.vispos = SwinPositions(embed, stages, names, [False] * len(stages))
    model.vispos.train(model.training)
    for stage in model.stages:
        for j, blk in enumerate(stage.blocks):
            blk.attn = PatchedWindowAttention(blk.attn, layer_idx=j)
    model.patch_embed.strict_img_size = False  # any size the patches divide; windows pad as timm's dynamic mode
    model.dynamic_img_size = True
    model.__class__ = PatchedSwinTransformerV2Cr
    model.register_load_state_dict_pre_hook(adopt_swin_cr_checkpoint)
    return model


def adopt_swin_cr_checkpoint(model: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """``load_state_dict`` pre-hook: a plain timm Swin V2-CR checkpoint (any size: the MLP is size-free) gives
    each block's ``meta_mlp`` to its cpb2d; without an inherited cpb2d it is refused, or with ``strict=False``
    left for ``load_state_dict`` to report as unexpected."""
    found = adopt_and_match(model, state_dict, prefix, _META)
    if not found:
        return  # a vispos checkpoint, or no meta_mlp in it
    if not model.vispos.settings.get("inherited"):
        refuse_unplaced(model, SOURCE, f"patch with cpb2d (inherit=True) to keep it, {LOAD_ADVICE}")
        return  # reported by load_state_dict as unexpected keys
    for key, match in found.items():
        i, j, fc, name = match.groups()
        state_dict[f"{prefix}vispos.stages.{i}.attention.{j}.mlp.{0 if fc == '1' else 2}.{name}"] = state_dict.pop(key)


def _inherits(attention: SchemeInfo | None, per_scheme: dict[str, dict[str, Any]], own: dict[str, Any]) -> bool:
    """Whether the meta MLP is kept (``attention`` is cpb2d with its options); said when it is discarded."""
    if attention is None or attention.name != "cpb2d":
        asked = attention.name if attention is not None else "no attention scheme"
        warn(f"this model's own relative position bias ({SOURCE}, as cpb2d) is discarded: {asked} replaces it, and "
             "the pretrained weights were trained with it. Patch with 'cpb2d' to keep it, or inherit=False to start "
             "fresh without this warning")  # fmt: skip
        return False
    changed = {k: v for k, v in per_scheme["cpb2d"].items() if k in own and v != own[k]}
    if changed:
        warn(f"you set {changed}, but {SOURCE} is cpb2d with {own}: cpb2d starts fresh. Drop the options to keep "
             "what the model learned")  # fmt: skip
        return False
    return True


def _adopt_meta_mlp(stage: nn.Module, positions: Positions) -> None:
    """Copy each block's ``meta_mlp`` (fc1, fc2) into the stage's per-block cpb2d (mlp.0, mlp.2)."""
    with torch.no_grad():
        for blk, module in zip(stage.blocks, positions.attention, strict=True):
            meta = blk.attn.meta_mlp
            if meta.fc1.weight.is_meta:  # a model built on the meta device: the values arrive with its weights
                module.mlp.to("meta")
                continue
            for mine, theirs in ((module.mlp[0], meta.fc1), (module.mlp[2], meta.fc2)):
                mine.weight.copy_(theirs.weight)
                mine.bias.copy_(theirs.bias)
    positions.settings["inherited"] = {"from": f"timm SwinTransformerV2Cr: {SOURCE}"}
