"""timm's VisionTransformerRelPos (``vit_relpos_*``, ``vit_srelpos_*``) as a patched host: ``patch_relpos``.

These models carry no absolute table: every attention adds a relative position bias of its own, from a
``RelPosMlp`` (an MLP on log coordinates, ``rel_pos_type="mlp"``, every registered model) or a
``RelPosBias`` (Swin's table, ``rel_pos_type="bias"``), one per block or one for the network
(``shared_rel_pos=True``, the ``vit_srelpos_*`` models). With ``inherit=True`` (the default) that bias
becomes the catalogue scheme that computes it, its weights adopted, so the outputs stay timm's:

- ``RelPosMlp(mode="cr")`` -> ``cpb2d(coords="log", output="linear", out_bias=True)`` (every ``vit_relpos_*`` and
  ``vit_srelpos_*`` name): sign(d) ln(1 + |d|) in patch units, no sigmoid, a bias on both layers.
- ``RelPosMlp(mode="swin")`` (``rel_pos_type="mlp_swin"``, no registered name) -> ``cpb2d`` with SwinV2's
  coordinates and 16 sigmoid; offsets scaled by the grid at hand (``offset_scale="grid"``) as timm scales them
  when the model is built at another size, or by its ``pretrained_window_size`` when it has one. Mode ``"rw"``
  has no coordinates in timm 1.0.31 (``gen_relative_log_coords`` refuses it), so no such model can be built.
- ``RelPosBias`` -> ``relbias2d(resize="geometric")``; the class token's three entries (timm's last rows,
  BEiT's order) become ``prefix_bias``. Another grid resamples the table on BEiT's geometric grid, as timm's
  ``set_input_size`` (``RelPosBias.set_window_size``) and its ``checkpoint_filter_fn`` do.

The MLP's hidden width, its dropout (timm's 0.125, training only), the class token's zero bias
(``prefix_entries=False``) and the sharing across layers (``per_layer``) are carried over as options. The MLP
is evaluated at the offsets of each input's grid, so a patched model at any size equals timm's model built at
that size with the same weights. Another scheme discards the bias (``PretrainedPositionsWarning``);
``inherit=False`` starts fresh silently.

The blocks stay timm's; their ``shared_rel_pos`` argument carries vispos's ``PositionContext`` to the
``PatchedRelPosAttention`` of each block, which adopts timm's ``qkv`` / ``q_norm`` / ``k_norm`` / ``proj`` under
their names. A timm checkpoint of the same model loads into the patched one: its ``rel_pos`` weights go to the
inherited scheme (``adopt_relpos_checkpoint``); a RelPosBias table of another grid (a checkpoint of the model at
another size) is resampled first, as timm's ``checkpoint_filter_fn`` does. ``set_input_size`` is timm's, the
positions following every input's grid as they do without it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from timm.layers import Format, RelPosBias, RelPosMlp, resize_rel_pos_bias_table
from timm.models._features import feature_take_indices
from timm.models._input import update_model_input_size
from timm.models.vision_transformer_relpos import RelPosAttention, VisionTransformerRelPos
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import host
from .._validate import check_bool
from ..host import OwnRope, warn
from ..positions import PositionContext
from ..registry import SchemeInfo, split_options
from .attention import PatchedAttention, positioned_attention
from .model import PatchedViT, adopt_timm_checkpoint, conditional_tokens, embed_tokens, position_context, token_grid
from .vit import build_positions

# torch.fx leaves (as in model.py and attention.py): fx.wrap patches the names of the module that calls it
torch.fx.wrap("token_grid")
torch.fx.wrap("position_context")
torch.fx.wrap("embed_tokens")
torch.fx.wrap("positioned_attention")

# what decides the shapes of the inherited weights: overriding one of these starts the scheme fresh
_STRUCTURE = ("hidden", "out_bias", "per_layer", "prefix_entries")
# timm's RelPosMlp (an ``Mlp``) -> cpb2d's ``mlp`` (``nn.Sequential``: Linear, activation, Linear)
_MLP_KEYS = {"mlp.fc1.weight": "mlp.0.weight", "mlp.fc1.bias": "mlp.0.bias", "mlp.fc2.weight": "mlp.2.weight",
             "mlp.fc2.bias": "mlp.2.bias"}  # fmt: skip


class PatchedRelPosAttention(PatchedAttention):
    """timm's ``RelPosAttention`` with vispos's positions: its projections adopted, its ``rel_pos`` dropped (the
    bias is ``model.vispos``'s); the block hands it the context through ``shared_rel_pos``."""

    accepts = (RelPosAttention,)

    def __init__(self, original: nn.Module, layer_idx: int) -> None:
        super().__init__(original, layer_idx)
        if "rel_pos" in self._modules:
            delattr(self, "rel_pos")
        self.norm = nn.Identity()  # RelPosAttention has no norm before proj

    def forward(self, x: torch.Tensor, shared_rel_pos: object = None) -> torch.Tensor:
        return positioned_attention(self, x, shared_rel_pos, False)


class PatchedVisionTransformerRelPos(PatchedViT, VisionTransformerRelPos):
    """VisionTransformerRelPos with vispos positions: the context is built once per forward from the input's grid
    and handed to every block as its ``shared_rel_pos``."""

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, H, W, C] from the patch embedding -> tokens [B, P + H*W, C] (class token first), positions added."""
        return embed_tokens(self.vispos, x, [] if self.cls_token is None else [self.cls_token])

    def _blocks(self, x: torch.Tensor, ctx: PositionContext, blocks: nn.Module) -> list[torch.Tensor]:
        outs = []
        for blk in blocks:
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = checkpoint(blk, x, shared_rel_pos=ctx, use_reentrant=False)
            else:
                x = blk(x, shared_rel_pos=ctx)
            outs.append(x)
        return outs

    def forward_features(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Images [B, C, H, W] -> tokens [B, P + H*W, C] after the final norm; ``attn_mask``: a mask of one's own."""
        grid = token_grid(self.patch_embed, x)  # refuses a size the patches do not divide
        x = self._pos_embed(self.patch_embed(x))
        ctx = position_context(self.vispos, grid, x, attn_mask)
        return self.norm(self._blocks(x, ctx, self.blocks)[-1])

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[Any] | tuple[torch.Tensor, list[Any]]:
        """timm's ``forward_intermediates`` (same arguments and outputs), the blocks called with the context."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take, max_index = feature_take_indices(len(self.blocks), indices)
        b = x.shape[0]
        h, w = token_grid(self.patch_embed, x)
        x = self._pos_embed(self.patch_embed(x))
        ctx = position_context(self.vispos, (h, w), x, None)
        blocks = self.blocks[: max_index + 1] if stop_early else self.blocks
        outs = self._blocks(x, ctx, blocks)
        p = self.num_prefix_tokens
        taken = [self.norm(y) if norm else y for i, y in enumerate(outs) if i in take]
        prefix, patches = [y[:, :p] for y in taken], [y[:, p:] for y in taken]
        if output_fmt == "NCHW":
            patches = [y.reshape(b, h, w, -1).permute(0, 3, 1, 2).contiguous() for y in patches]
        result = list(zip(patches, prefix, strict=True)) if return_prefix_tokens else patches
        return result if intermediates_only else (self.norm(outs[-1]), result)

    def set_input_size(
        self, img_size: int | tuple[int, int] | None = None, patch_size: int | tuple[int, int] | None = None
    ) -> None:
        """timm's ``set_input_size``: the patch embedding's size (FlexiViT resampling for a new patch size). The
        inherited bias keeps its training grid and follows every input's grid at forward (the MLP evaluated at
        its offsets, the table resampled as timm's ``RelPosBias.set_window_size`` resamples it), so nothing of the
        positions changes here."""
        self.patch_embed.set_input_size(img_size=img_size, patch_size=patch_size)
        update_model_input_size(self, self.patch_embed.img_size, patch_size=patch_size)


def after_relpos_block(block: nn.Module, args: tuple, kwargs: dict[str, Any], out: torch.Tensor) -> torch.Tensor:
    """Forward hook on ``blocks[after]`` for a conditional scheme (peg2d): the context is the block's
    ``shared_rel_pos``. Module level, so copies and pickles of the model carry it."""
    ctx = kwargs["shared_rel_pos"] if "shared_rel_pos" in kwargs else args[1] if len(args) > 1 else None
    return conditional_tokens(out, ctx)


# --- what the model's own bias is ------------------------------------------------------------------------


def _own_module(model: VisionTransformerRelPos) -> nn.Module:
    """The model's relative-bias module: the shared one, or the first block's (every block's is alike)."""
    return model.shared_rel_pos if model.shared_rel_pos is not None else model.blocks[0].attn.rel_pos


def own_relative_bias(model: VisionTransformerRelPos) -> OwnRope:
    """The model's relative bias as a catalogue scheme with options (``OwnRope`` carries any inherited scheme).
    Raises for a bias vispos cannot reproduce."""
    module, per_layer = _own_module(model), model.shared_rel_pos is None
    if isinstance(module, RelPosBias):
        source = "timm RelPosBias"
        return OwnRope("relbias2d", {"prefix_entries": True, "per_layer": per_layer, "resize": "geometric"}, source)
    if not isinstance(module, RelPosMlp):
        raise ValueError(f"this model's relative bias is a {type(module).__name__}, which vispos does not reproduce; "
                         "accepted: timm RelPosMlp (modes 'swin', 'cr') and RelPosBias. patch(model, ..., "
                         "inherit=False) replaces it with a fresh scheme")  # fmt: skip
    mlp = module.mlp
    if module.mode not in ("swin", "cr") or not isinstance(mlp.act, nn.ReLU) or not isinstance(mlp.norm, nn.Identity):
        raise ValueError(f"this model's RelPosMlp (mode={module.mode!r}, {type(mlp.act).__name__}) has no vispos "
                         "equivalent; accepted: modes 'swin' and 'cr' with ReLU. patch(model, ..., inherit=False) "
                         "replaces it with a fresh scheme")  # fmt: skip
    options: dict[str, Any] = {
        "hidden": mlp.fc1.out_features, "out_bias": mlp.fc2.bias is not None, "dropout": float(mlp.drop1.p),
        "prefix_entries": False, "per_layer": per_layer,
    }  # fmt: skip
    if module.mode == "cr":
        options |= {"coords": "log", "output": "linear"}
    else:
        pretrained = tuple(module.pretrained_window_size)
        options |= {"coords": "swin", "output": "sigmoid", "max_bias": float(module.bias_gain)}
        options["offset_scale"] = "train" if pretrained[0] > 0 else "grid"
    return OwnRope("cpb2d", options, f"timm RelPosMlp(mode={module.mode!r})")


def _plan(
    pos: str | list[str] | tuple[str, ...], options: dict[str, Any], own: OwnRope | None
) -> tuple[tuple[SchemeInfo | None, ...], dict[str, dict[str, Any]], OwnRope | None]:
    """The schemes to build, each one's options, and the model's own bias when it is kept (``pos`` names its
    scheme); a bias discarded is said."""
    schemes = host.resolve_schemes(pos)
    attention = schemes[1]
    if own is not None and (attention is None or attention.name != own.scheme):
        asked = attention.name if attention is not None else "no attention scheme"
        warn(f"this model's own relative position bias ({own.describe()}) is discarded: {asked} replaces it, and "
             f"the pretrained weights were trained with it. Patch with {own.scheme!r} to keep it, or inherit=False "
             "to start fresh without this warning")  # fmt: skip
    kept = own if own is not None and attention is not None and attention.name == own.scheme else None
    used = [i for i in schemes if i is not None]
    per_scheme = dict(zip([i.name for i in used], split_options(used, options), strict=True))
    if kept is not None:
        per_scheme[kept.scheme] = host.merge_options(kept, per_scheme[kept.scheme])
    return schemes, per_scheme, kept


# --- weights -----------------------------------------------------------------------------------------------


def vispos_entries(
    state: dict[str, Any], prefix: str, *, depth: int, per_layer: bool, scheme: str, table_rows: int
) -> dict[str, Any]:
    """Pops timm's relative-bias weights out of a state dict -> the same weights under vispos's keys.

    ``blocks.{i}.attn.rel_pos.`` (or ``shared_rel_pos.``) ``mlp.fc1/fc2`` -> ``vispos.attention.{i}.mlp.0/2``
    (cpb2d); a RelPosBias table [T + 3P, heads] -> ``table`` [T, heads] (``table_rows`` = T = (2H-1)(2W-1)) and,
    with a class token, ``prefix_bias`` [3, heads]: timm's rows T, T+1, T+2 hold cls -> patch, patch -> cls and
    cls -> cls, relbias2d's order."""
    places = [(f"blocks.{i}.attn.rel_pos.", f"vispos.attention.{i}.") for i in range(depth)]
    if not per_layer:
        places = [("shared_rel_pos.", "vispos.attention.")]
    out: dict[str, Any] = {}
    for source, target in places:
        src, dst = f"{prefix}{source}", f"{prefix}{target}"
        if scheme == "cpb2d":
            out |= {
                dst + key: state.pop(src + timm_key) for timm_key, key in _MLP_KEYS.items() if src + timm_key in state
            }
        elif src + "relative_position_bias_table" in state:
            table = state.pop(src + "relative_position_bias_table")  # [T + 3P, heads]
            out[dst + "table"] = table[:table_rows]
            if table.shape[0] > table_rows:
                out[dst + "prefix_bias"] = table[table_rows:]
    return out


def _first_attention(model: nn.Module) -> nn.Module:
    """The attention scheme of the first layer (per layer or shared, as the model holds it)."""
    attention = model.vispos.attention
    return attention[0] if isinstance(attention, nn.ModuleList) else attention


def _rel_pos_layout(model: nn.Module) -> dict[str, Any] | None:
    """How this patched model's inherited bias maps timm's keys (``vispos_entries``' arguments), or None when
    it inherited none."""
    inherited = model.vispos.settings.get("inherited") or {}
    if "timm_rel_pos" not in inherited:
        return None
    scheme = inherited["timm_rel_pos"]
    first = _first_attention(model)
    h, w = model.vispos.train_grid
    return {"depth": len(model.blocks), "per_layer": isinstance(model.vispos.attention, nn.ModuleList),
            "scheme": scheme, "table_rows": (2 * h - 1) * (2 * w - 1) if hasattr(first, "table") else 0}  # fmt: skip


def adopt_relpos_checkpoint(model: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook: a plain timm checkpoint of this model (``rel_pos`` keys) gives its bias
    weights to the inherited scheme; everything else as ``adopt_timm_checkpoint`` (settings records)."""
    adopt_timm_checkpoint(model, state_dict, prefix, *args)
    layout = _rel_pos_layout(model)
    if layout is not None:
        if layout["table_rows"]:
            _resample_tables(model, state_dict, prefix, layout["table_rows"])
        state_dict.update(vispos_entries(state_dict, prefix, **layout))


def _resample_tables(model: nn.Module, state_dict: dict[str, Any], prefix: str, table_rows: int) -> None:
    """RelPosBias tables of a checkpoint at another grid (the model built at another size) -> this model's
    training grid, in place, as timm's ``checkpoint_filter_fn`` resamples them (``resize_rel_pos_bias_table``:
    a square source grid assumed, the class token's rows kept)."""
    first = _first_attention(model)
    rows = table_rows + (0 if first.prefix_bias is None else first.prefix_bias.shape[0])
    for key in [k for k in state_dict if k.startswith(prefix) and k.endswith("rel_pos.relative_position_bias_table")]:
        table = state_dict[key]
        if table.shape[0] != rows:
            state_dict[key] = resize_rel_pos_bias_table(
                table, new_window_size=model.vispos.train_grid, new_bias_shape=(rows, table.shape[1])
            )


def _adopt_weights(model: nn.Module, source: dict[str, torch.Tensor]) -> None:
    """The original model's bias weights (its state dict) -> the inherited scheme's parameters, copied."""
    entries = vispos_entries(dict(source), "", **_rel_pos_layout(model))
    params = dict(model.vispos.named_parameters())
    with torch.no_grad():
        for key, value in entries.items():
            params[key[len("vispos.") :]].copy_(value)


# --- patch -------------------------------------------------------------------------------------------------


def patch_relpos(
    model: nn.Module, pos: str | list[str] | tuple[str, ...], *, inherit: bool = True, **options: Any
) -> nn.Module:
    """Give a timm VisionTransformerRelPos the positional scheme ``pos`` (as ``vispos.patch``: at most one
    additive, one attention and one conditional scheme; options go to the scheme that accepts them). With
    ``inherit`` its own relative bias is kept as ``cpb2d`` / ``relbias2d`` (module docstring). In place."""
    if not isinstance(model, VisionTransformerRelPos):
        raise TypeError(f"patch_relpos takes a timm VisionTransformerRelPos (vit_relpos_*, vit_srelpos_*), got "
                        f"{type(model).__name__}")  # fmt: skip
    if isinstance(model, PatchedViT):
        raise ValueError("this model is already patched by vispos; patch a fresh model instead")
    check_bool("inherit", inherit)
    for i, blk in enumerate(model.blocks):
        if not isinstance(getattr(blk, "attn", None), RelPosAttention):
            raise TypeError(f"block {i} has attention {type(getattr(blk, 'attn', None)).__name__}; accepted: timm "
                            "RelPosAttention (RelPosBlock, ResPostRelPosBlock)")  # fmt: skip
    own = own_relative_bias(model) if inherit else None
    schemes, per_scheme, kept = _plan(pos, options, own)
    if kept is not None and any(
        per_scheme[kept.scheme].get(k) != v for k, v in kept.options.items() if k in _STRUCTURE
    ):
        warn(f"the options given change the shape of this model's {kept.scheme} weights ({kept.source}): they "
             "start fresh")  # fmt: skip
        kept = None
    original = model.state_dict()
    grid = tuple(model.patch_embed.grid_size)
    model.vispos = build_positions(model, schemes, per_scheme, grid, model.num_prefix_tokens, kept)
    if kept is not None:
        model.vispos.settings["inherited"] = kept.record() | {"timm_rel_pos": kept.scheme}
        _adopt_weights(model, original)
        if kept.options.get("offset_scale") == "train":  # a pretrained_window_size: the offsets' scale
            window = tuple(int(s) for s in _own_module(model).pretrained_window_size)
            for module in model.vispos.attention.modules():
                if hasattr(module, "offset_grid"):
                    module.offset_grid = window
    model.vispos.train(model.training)  # a model patched in eval mode stays in it
    model.shared_rel_pos = None
    for i, blk in enumerate(model.blocks):
        blk.attn = PatchedRelPosAttention(blk.attn, layer_idx=i)
    if model.vispos.conditional is not None:
        model.blocks[model.vispos.conditional.after].register_forward_hook(after_relpos_block, with_kwargs=True)
    pe = model.patch_embed
    pe.flatten, pe.output_fmt, pe.strict_img_size = False, Format.NHWC, False  # dynamic_img_pad stays as it was
    model.norm_pre = nn.Identity()  # what vispos.diagnostics reads before a block (timm's ViT has one)
    model.__class__ = PatchedVisionTransformerRelPos
    model.register_load_state_dict_pre_hook(adopt_relpos_checkpoint)
    return model
