"""timm's Swin (``SwinTransformer``) and Swin V2 (``SwinTransformerV2``) as a patched host: ``patch_swin(model, pos)``.

Swin attends inside windows (``window.py``); its stages differ in width, heads and window. So ``model.vispos``
is a ``SwinPositions``: ``embed``, a ``Positions`` on the full patch grid holding the additive scheme (added at
the patch embedding, where Swin v1's original ``absolute_pos_embed`` was; timm 1.0.31 has none) and the
conditional one (``peg2d``, after block ``after``, counted over all stages, at that stage's width and grid);
``stages[i]``, one ``Positions`` per stage at the grid of its window (no prefix tokens) holding the attention
scheme, one module per block for per-layer schemes. Each forward builds each stage's context once, at its window,
and every window of every block of the stage shares it: attention schemes act on window-local coordinates
(RoPE-Swin: ``t_x = i % ww``, ``t_y = i // ww``), a bias is added to the shifted-window mask.

Inherited (``inherit=True``, the default), as the weights were trained: Swin's per-block
``relative_position_bias_table`` becomes ``relbias2d`` (one per block, the same table and index rule); Swin V2's
``cpb_mlp`` becomes ``cpb2d`` (the same MLP, log-spaced offsets normalised by the model's
``pretrained_window_size`` where it is set, else by the window, which then follows ``set_input_size`` as Swin V2's
does). Swin V2's cosine attention and ``logit_scale`` stay whatever the scheme. Another scheme discards the bias
with a ``PretrainedPositionsWarning``; ``inherit=False`` starts fresh silently.

``set_input_size(img_size=..., window_size=...)`` is timm's, followed by each stage's positions taking the new
window: relbias2d tables resized by Swin's own rule (timm's ``resize_rel_pos_bias_table``, BEiT's geometric
interpolation, not bicubic), cpb2d evaluated at the new offsets, RoPE on the new window-local grid.
That resize, the adoption of the model's own bias and plain timm checkpoints (same or another window) are
``swin_checkpoint.py``'s.

What the adapter touches in timm's Swin: ``patch_embed`` (``strict_img_size`` written False), ``layers[i]``
(``downsample``, ``blocks``, ``grad_checkpointing``), each block's ``norm1``, ``norm2``, ``mlp``,
``drop_path1`` / ``drop_path2``, ``window_size``, ``shift_size``, ``dim``, ``attn`` (replaced by a
``PatchedWindowAttention``); ``norm``; ``set_input_size`` and ``forward_intermediates`` are overridden.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from timm.models._features import feature_take_indices
from timm.models.swin_transformer import SwinTransformer
from timm.models.swin_transformer_v2 import SwinTransformerV2, SwinTransformerV2Block
from timm.models.swin_transformer_v2_cr import SwinTransformerV2CrBlock
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import host
from .._validate import check_bool
from ..host import HostShape, PositionsHost, warn
from ..positions import PositionContext, Positions
from ..registry import SchemeInfo, build_in_context
from .pruning import PrunesPositions
from .swin_checkpoint import OWN_BIAS, adopt_own_bias, adopt_swin_checkpoint, resize_stage
from .window import PatchedWindowAttention, partition, reverse, shift_mask

SWIN_MODELS: tuple[type, ...] = (SwinTransformer, SwinTransformerV2)
CPB_MLP: dict[str, Any] = {"hidden": 512, "max_bias": 16.0}  # Swin V2's cpb_mlp: 2 -> 512 -> heads, 16 * sigmoid


class SwinPositions(nn.Module):
    """``model.vispos`` of a patched Swin: ``embed`` (additive and conditional schemes, full patch grid) and
    ``stages`` (one ``Positions`` per stage at its window: the attention scheme). ``follow_window[i]``: stage
    i's cpb2d normalises offsets by the current window (Swin V2 with ``pretrained_window_size`` 0)."""

    def __init__(self, embed: Positions, stages: list[Positions], schemes: list[str], follow_window: list[bool]):
        super().__init__()
        self.embed = embed
        self.stages = nn.ModuleList(stages)
        self.schemes = list(schemes)
        self.follow_window = list(follow_window)

    @property
    def settings(self) -> dict[str, Any]:
        """Schemes, options, the training patch grid, each stage's window, and what was inherited."""
        options = dict(self.embed.settings["options"])
        for stage in self.stages:
            options |= stage.settings["options"]
        out = {"pos": list(self.schemes), "options": options, "train_grid": self.embed.train_grid,
               "windows": [stage.train_grid for stage in self.stages]}  # fmt: skip
        inherited = self.stages[0].settings.get("inherited") if len(self.stages) else None
        return out | ({"inherited": inherited} if inherited else {})

    @property
    def strict_loading(self) -> bool:
        return self.embed.strict_loading

    @strict_loading.setter
    def strict_loading(self, value: bool) -> None:
        for positions in (self.embed, *self.stages):
            positions.strict_loading = value

    @property
    def conditional(self) -> nn.Module | None:
        return self.embed.conditional


# --- forward: pure functions of the model's modules (torch.fx leaves: they read sizes as Python numbers) ---


def embed_patches(positions: Positions, x: torch.Tensor) -> torch.Tensor:
    """x [B, H, W, C] from the patch embedding -> with the additive scheme added on the full grid."""
    b, h, w, c = x.shape
    return positions.add_to_patches(x.reshape(b, h * w, c), (h, w)).reshape(b, h, w, c)


def windowed_attention(block: nn.Module, x: torch.Tensor, ctx: PositionContext, mask: torch.Tensor | None):
    """Swin's (shifted) window attention of ``block`` on x [B, H, W, C]: roll by -shift, pad to whole windows,
    attend in each window with the stage's context and ``mask`` (the shift mask of the padded map), undo."""
    b, h, w, c = x.shape
    window, shift = tuple(block.window_size), tuple(block.shift_size)
    if any(shift):
        x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2))
    pad_h, pad_w = (window[0] - h % window[0]) % window[0], (window[1] - w % window[1]) % window[1]
    x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))  # [B, Hp, Wp, C]
    out = block.attn(partition(x, window), mask=mask, ctx=ctx)  # [B * nW, N, C]
    x = reverse(out, window, (h + pad_h, w + pad_w))[:, :h, :w]
    return torch.roll(x, shifts=shift, dims=(1, 2)) if any(shift) else x


def block_forward(block: nn.Module, x: torch.Tensor, ctx: PositionContext, mask: torch.Tensor | None):
    """One Swin block on x [B, H, W, C]: pre-norm residuals (Swin), or res-post-norm (Swin V2 and V2-CR: norm after
    attention and MLP; V2-CR's ``norm3`` on the main branch after both)."""
    b, h, w, c = x.shape
    post = isinstance(block, (SwinTransformerV2Block, SwinTransformerV2CrBlock))
    y = windowed_attention(block, x if post else block.norm1(x), ctx, mask)
    x = x + block.drop_path1(block.norm1(y) if post else y)
    x = x.reshape(b, h * w, c)
    x = x + block.drop_path2(block.norm2(block.mlp(x)) if post else block.mlp(block.norm2(x)))
    if isinstance(block, SwinTransformerV2CrBlock):
        x = block.norm3(x)
    return x.reshape(b, h, w, c)


def run_stage(
    stage: nn.Module, positions: Positions, x: torch.Tensor, embed: Positions, first_block: int
) -> torch.Tensor:
    """A Swin stage on x [B, H, W, C]: downsampling, then its blocks with one context at the stage's window and one
    shift mask per shift, both built here once; ``embed``'s conditional scheme after its block (``first_block``:
    the global index of the stage's first block)."""
    x = stage.downsample(x)
    b, h, w, c = x.shape
    window = tuple(stage.blocks[0].window_size)
    ctx = positions.context(window, x.device)
    padded = (-(-h // window[0]) * window[0], -(-w // window[1]) * window[1])
    masks = {s: shift_mask(padded, window, s, x.device) for s in {tuple(blk.shift_size) for blk in stage.blocks}}
    conditional = embed.conditional if embed.enabled else None
    for j, blk in enumerate(stage.blocks):
        mask = masks[tuple(blk.shift_size)]
        if stage.grad_checkpointing and torch.is_grad_enabled():
            x = checkpoint(block_forward, blk, x, ctx, mask, use_reentrant=False)
        else:
            x = block_forward(blk, x, ctx, mask)
        if conditional is not None and conditional.after == first_block + j:
            x = conditional(x.reshape(b, h * w, c), (h, w), 0, None).reshape(b, h, w, c)
    return x


torch.fx.wrap("embed_patches")
torch.fx.wrap("run_stage")


class PatchedSwin(PrunesPositions, PositionsHost):
    """Mixin placed before timm's Swin class: positions from ``self.vispos`` (a ``SwinPositions``)."""

    vispos: SwinPositions

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images [B, C, H, W] -> features [B, H', W', C'] (NHWC, as timm's Swin)."""
        x = embed_patches(self.vispos.embed, self.patch_embed(x))
        for stage, positions, first in zip(self.layers, self.vispos.stages, _starts(self), strict=True):
            x = run_stage(stage, positions, x, self.vispos.embed, first)
        return self.norm(x)

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """timm's ``forward_intermediates`` (stage outputs, NCHW) through the patched stages."""
        if output_fmt != "NCHW":
            raise ValueError(f"output_fmt must be 'NCHW' (as timm's Swin), got {output_fmt!r}")
        take, max_index = feature_take_indices(len(self.layers), indices)
        last = max_index if stop_early else len(self.layers) - 1
        x = embed_patches(self.vispos.embed, self.patch_embed(x))
        intermediates = []
        for i, (stage, positions, first) in enumerate(zip(self.layers, self.vispos.stages, _starts(self), strict=True)):
            if i > last:
                break
            x = run_stage(stage, positions, x, self.vispos.embed, first)
            if i in take:
                out = self.norm(x) if norm and i == len(self.layers) - 1 else x
                intermediates.append(out.permute(0, 3, 1, 2).contiguous())
        if intermediates_only:
            return intermediates
        if last == len(self.layers) - 1:
            x = self.norm(x)
        return x, intermediates

    def set_input_size(
        self,
        img_size: tuple[int, int] | None = None,
        patch_size: tuple[int, int] | None = None,
        window_size: Any = None,
        window_ratio: Any = None,
        always_partition: bool | None = None,
    ) -> None:
        """timm's ``set_input_size``; then each stage's positions take its new window (``resize_stage``)."""
        super().set_input_size(img_size=img_size, patch_size=patch_size, window_size=window_size,
                               window_ratio=window_ratio, always_partition=always_partition)  # fmt: skip
        self.patch_embed.strict_img_size = False
        for stage, positions, follow in zip(self.layers, self.vispos.stages, self.vispos.follow_window, strict=True):
            resize_stage(positions, tuple(stage.blocks[0].window_size), follow_window=follow)

    def no_weight_decay(self) -> set[str]:
        """timm's own (Swin V2's ``logit_scale``) plus the positional parameters (``positional_no_weight_decay``)."""
        return set(super().no_weight_decay()) | self.positional_no_weight_decay()

    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """timm's groups; per-block positional modules with their block, per-stage ones with the stage's
        downsampling, the additive and conditional schemes in the stem."""
        matcher = dict(super().group_matcher(coarse))
        matcher["stem"] = rf"{matcher['stem']}|^vispos\.embed"
        if coarse:
            matcher["blocks"] = r"^(?:layers|vispos\.stages)\.(\d+)"
        else:
            own = [(r"^vispos\.stages\.(\d+)\.attention\.(\d+)\.", None), (r"^vispos\.stages\.(\d+)\.", (0,))]
            matcher["blocks"] = [*own, *matcher["blocks"]]
        return matcher


class PatchedSwinTransformer(PatchedSwin, SwinTransformer):
    """timm's SwinTransformer with vispos positions."""


class PatchedSwinTransformerV2(PatchedSwin, SwinTransformerV2):
    """timm's SwinTransformerV2 with vispos positions."""


PATCHED: dict[type, type] = {SwinTransformer: PatchedSwinTransformer, SwinTransformerV2: PatchedSwinTransformerV2}


# --- patch ----------------------------------------------------------------------------------------------


def patch_swin(
    model: nn.Module, pos: str | list[str] | tuple[str, ...], *, inherit: bool = True, **options: Any
) -> nn.Module:
    """Give a timm Swin / Swin V2 the positional scheme ``pos`` (as ``vispos.patch``: at most one additive, one
    attention and one conditional scheme; options go to the scheme that accepts them). ``inherit`` keeps the
    model's own bias (see the module's docstring). In place; returns the model."""
    if isinstance(model, PatchedSwin):
        raise ValueError("this Swin is already patched by vispos; patch a fresh model instead")
    if type(model) not in OWN_BIAS:
        raise TypeError(f"patch_swin takes timm's SwinTransformer or SwinTransformerV2, got {type(model).__name__}")
    check_bool("inherit", inherit)
    schemes, per_scheme, _ = host.plan_schemes(pos, options, own=None, has_table=False)
    additive, attention, conditional = schemes
    inherited = _inherits(model, attention, per_scheme) if inherit else False
    embed = _embed_positions(model, schemes, per_scheme)
    stages, follow = [], []
    for stage in model.layers:
        positions = _stage_positions(stage, attention, per_scheme)
        follow.append(adopt_own_bias(stage, positions, type(model)) if inherited else False)
        stages.append(positions)
    names = [i.name for i in schemes if i is not None] or ["nope"]
    model.vispos = SwinPositions(embed, stages, names, follow)
    model.vispos.train(model.training)
    for stage in model.layers:
        for j, blk in enumerate(stage.blocks):
            blk.attn = PatchedWindowAttention(blk.attn, layer_idx=j)
    model.patch_embed.strict_img_size = False  # any size the patches divide; windows pad as timm's dynamic mode
    model.dynamic_img_size = True
    model.__class__ = PATCHED[type(model)]
    model.register_load_state_dict_pre_hook(adopt_swin_checkpoint)  # plain timm checkpoints
    return model


def _inherits(model: nn.Module, attention: SchemeInfo | None, per_scheme: dict[str, dict[str, Any]]) -> bool:
    """Whether the model's own bias is kept (``attention`` is its scheme); said when it is discarded."""
    own, source = OWN_BIAS[type(model)]
    if attention is None or attention.name != own:
        asked = attention.name if attention is not None else "no attention scheme"
        warn(f"this model's own relative position bias ({source}, as {own}) is discarded: {asked} replaces it, and "
             f"the pretrained weights were trained with it. Patch with {own!r} to keep it, or inherit=False to start "
             "fresh without this warning")  # fmt: skip
        return False
    if own == "cpb2d":
        chosen = per_scheme["cpb2d"]
        if chosen.get("hidden", CPB_MLP["hidden"]) != CPB_MLP["hidden"]:
            warn(f"you set hidden={chosen['hidden']!r}, but {source} has {CPB_MLP['hidden']} hidden units: cpb2d "
                 "starts fresh. Drop the option to keep what the model learned")  # fmt: skip
            return False
        if chosen.get("max_bias", CPB_MLP["max_bias"]) != CPB_MLP["max_bias"]:
            warn(f"you set max_bias={chosen['max_bias']!r}, but {source} assumes {CPB_MLP['max_bias']}; its outputs "
                 "will change. Drop the option to keep what the model learned")  # fmt: skip
    return True


def _embed_positions(
    model: nn.Module,
    schemes: tuple[SchemeInfo | None, SchemeInfo | None, SchemeInfo | None],
    per_scheme: dict[str, dict[str, Any]],
) -> Positions:
    """The additive scheme on the full patch grid (stage 0's width) and the conditional one (at the width of the
    stage holding block ``after``)."""
    additive, _, conditional = schemes
    depth = sum(len(stage.blocks) for stage in model.layers)
    attn0 = model.layers[0].blocks[0].attn
    shape = HostShape(model.layers[0].blocks[0].dim, attn0.num_heads, 1, depth, 0)  # head_dim: unused here
    held = {i.name: per_scheme[i.name] for i in (additive, conditional) if i is not None}
    grid = tuple(model.patch_embed.grid_size)
    positions = host.build_positions(shape, (additive, None, conditional), held, grid, table_prefix=0)
    if conditional is not None:
        after = positions.conditional.after  # checked against the depth by build_positions
        stage = next(s for s, first in zip(model.layers, _starts(model), strict=True) if after < first + len(s.blocks))
        options = per_scheme[conditional.name]
        positions.conditional = build_in_context(conditional, {"dim": stage.blocks[0].dim}, options)
    return positions


def _starts(model: nn.Module) -> list[int]:
    """The global index of each stage's first block."""
    starts, n = [], 0
    for stage in model.layers:
        starts.append(n)
        n += len(stage.blocks)
    return starts


def _stage_positions(
    stage: nn.Module, attention: SchemeInfo | None, per_scheme: dict[str, dict[str, Any]]
) -> Positions:
    """One stage's attention scheme at the grid of its window, for its width, heads and depth."""
    blk = stage.blocks[0]
    heads = blk.attn.num_heads
    head_dim = blk.attn.qkv.out_features // (3 * heads)
    shape = HostShape(blk.dim, heads, head_dim, len(stage.blocks), 0)
    held = {} if attention is None else {attention.name: per_scheme[attention.name]}
    return host.build_positions(shape, (None, attention, None), held, tuple(blk.window_size), table_prefix=0)
