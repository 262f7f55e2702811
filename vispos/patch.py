"""timm integration: ``vispos.patch(model, "rope2d")`` swaps the positional scheme of a timm ViT.

What changes on the one model it is given (never on timm's classes):

- ``model.vispos`` (a ``Positions`` module) holds the scheme's modules and builds, once per forward
  and from the actual patch grid, a ``PositionContext``: RoPE angles and attention biases per layer.
- each ``blocks[i].attn`` becomes a ``PatchedAttention`` that adopts the original's weights.
- ``_pos_embed``, ``forward_features`` and ``forward_intermediates`` are rebound on the instance: they
  read the grid from the input, add additive tables, and hand the context to the blocks through the
  ``attn_mask`` argument timm already forwards.
- the patch embedding emits NHWC grids (timm's ``dynamic_img_size``), so any input divisible by the
  patch size works.
"""

from __future__ import annotations

import math
import types
from typing import Any

import timm
import torch
import torch.nn.functional as F
from timm.layers import AttentionRope, Format
from timm.models.eva import Eva, EvaAttention
from timm.models.vision_transformer import Attention as TimmAttention
from timm.models.vision_transformer import VisionTransformer
from torch import nn
from torch.utils.checkpoint import checkpoint

from ._validate import check_grid
from .attention import PatchedAttention, PositionContext, as_float_mask
from .registry import SchemeInfo, accepted_options, create_encoding, get_info

SUPPORTED_MODELS: tuple[type, ...] = (VisionTransformer, Eva)
SUPPORTED_ATTENTION: tuple[type, ...] = (TimmAttention, AttentionRope, EvaAttention)


class Positions(nn.Module):
    """The positional scheme of a patched model: at most one additive and one attention scheme."""

    def __init__(
        self,
        *,
        additive: nn.Module | None,
        attention: nn.Module | nn.ModuleList | None,
        attention_kind: str,
        depth: int,
        num_prefix_tokens: int,
        patch_size: tuple[int, int],
    ) -> None:
        super().__init__()
        self.additive = additive
        self.attention = attention
        self.attention_kind = attention_kind
        self.depth = depth
        self.num_prefix_tokens = num_prefix_tokens
        self.patch_size = patch_size
        self.enabled = True
        self.log_n_tokens: int | None = None  # training token count when log-n attention scaling is on

    def grid(self, image: torch.Tensor) -> tuple[int, int]:
        """Patch grid of an image batch [B, C, H, W]; refuses sizes the patch size does not divide."""
        h, w = image.shape[-2:]
        ph, pw = self.patch_size
        if h % ph or w % pw:
            raise ValueError(f"input size {h}x{w} is not divisible by the patch size {ph}x{pw}")
        return h // ph, w // pw

    def _per_layer(self, grid: tuple[int, int], device: torch.device) -> list[Any]:
        if self.attention is None or not self.enabled:
            return [None] * self.depth
        if isinstance(self.attention, nn.ModuleList):
            return [m(grid, device) for m in self.attention]
        return [self.attention(grid, device)] * self.depth

    def context(self, grid: tuple[int, int], device: torch.device, user_mask: torch.Tensor | None = None):
        """Rotary angles and masks for every layer, from the grid alone (computed once per forward)."""
        p = self.num_prefix_tokens
        user = as_float_mask(user_mask, torch.float32)
        outputs = self._per_layer(grid, device)
        logit_scale = self.logit_scale(grid)
        if self.attention_kind == "rotary":
            rotary = tuple(r.with_prefix(p) if r is not None else None for r in outputs)
            return PositionContext(rotary, (user,) * self.depth, logit_scale)
        masks = []
        for bias in outputs:
            if bias is None:
                masks.append(user)
                continue
            bias = F.pad(bias, (p, 0, p, 0))  # prefix rows and columns: zero bias
            masks.append(bias if user is None else bias + user)
        return PositionContext((None,) * self.depth, tuple(masks), logit_scale)

    def logit_scale(self, grid: tuple[int, int]) -> float:
        """log-n attention scaling: logits x max(1, ln N / ln N_train) for N patch tokens, so attention
        keeps its sharpness (entropy) when a larger grid spreads it over more keys."""
        if self.log_n_tokens is None:
            return 1.0
        return max(1.0, math.log(grid[0] * grid[1]) / math.log(self.log_n_tokens))

    def add_to_patches(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """x [B, H*W, C] (patch tokens only) + the additive table, if any."""
        if self.additive is None or not self.enabled:
            return x
        return x + self.additive(grid, x.device).to(x.dtype)

    def extra_repr(self) -> str:
        return f"depth={self.depth}, num_prefix_tokens={self.num_prefix_tokens}, enabled={self.enabled}"


# --- the instance-bound replacements --------------------------------------------------------------


def _prefix_tokens(model: nn.Module) -> list[torch.Tensor]:
    """Prefix tokens in timm's order: cls, distillation, registers."""
    names = ("cls_token", "dist_token", "reg_token")
    return [t for t in (getattr(model, n, None) for n in names) if t is not None]


def _pos_embed(self: nn.Module, x: torch.Tensor):  # bound to the model instance
    b, h, w, c = x.shape
    pos: Positions = self.vispos
    x = pos.add_to_patches(x.reshape(b, h * w, c), (h, w))
    prefix = [t.expand(b, -1, -1) for t in _prefix_tokens(self)]
    if prefix:
        tokens = torch.cat(prefix, dim=1)
        embed = getattr(pos.additive, "prefix", None)
        if embed is not None and pos.enabled:
            tokens = tokens + embed.to(tokens.dtype)
        x = torch.cat((tokens, x), dim=1)
    x = self.pos_drop(x)
    return (x, None) if isinstance(self, Eva) else x


def _forward_features(self: nn.Module, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False):
    ctx = self.vispos.context(self.vispos.grid(x), x.device, attn_mask)
    x = self.patch_embed(x)
    x = self._pos_embed(x)
    if isinstance(x, tuple):
        x = x[0]
    x = self.norm_pre(x)  # no patch dropout: patch() refuses models that use it
    for blk in self.blocks:
        if self.grad_checkpointing and torch.is_grad_enabled():
            x = checkpoint(blk, x, attn_mask=ctx, is_causal=is_causal, use_reentrant=False)
        else:
            x = blk(x, attn_mask=ctx, is_causal=is_causal)
    return self.norm(x)


def _forward_intermediates(self: nn.Module, x: torch.Tensor, *args: Any, attn_mask=None, **kwargs: Any):
    ctx = self.vispos.context(self.vispos.grid(x), x.device, attn_mask)
    return type(self).forward_intermediates(self, x, *args, attn_mask=ctx, **kwargs)


# --- patch ----------------------------------------------------------------------------------------


def _resolve_schemes(pos: str | list[str] | tuple[str, ...]) -> tuple[SchemeInfo | None, SchemeInfo | None]:
    names = [pos] if isinstance(pos, str) else list(pos)
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"pos must be a scheme name or a list of names, got {pos!r}")
    infos = [get_info(n, ndim=2) for n in names]
    additive = [i for i in infos if i.kind == "additive"]
    attention = [i for i in infos if i.kind in ("rotary", "bias")]
    if len(additive) > 1 or len(attention) > 1:
        raise ValueError(
            f"combine at most one additive scheme with one attention scheme, got {names}; "
            "additive: sincos2d, learned2d; attention: rope2d, rope2d_mixed, relbias2d, cpb2d, alibi2d"
        )
    return (additive[0] if additive else None), (attention[0] if attention else None)


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, SUPPORTED_MODELS):
        names = ", ".join(f"timm {c.__name__}" for c in SUPPORTED_MODELS)
        raise TypeError(f"vispos.patch supports {names} (and subclasses such as DeiT); got {type(model).__name__}")
    if hasattr(model, "vispos_cfg"):
        raise ValueError(
            "this model is already patched by vispos; patch a fresh model instead "
            "(a patched model's weights load into a freshly patched one with load_state_dict)"
        )
    drop = getattr(model, "patch_drop", None)
    if drop is not None and not isinstance(drop, nn.Identity) and getattr(drop, "prob", 0.0) > 0:
        raise ValueError("patch dropout is enabled (patch_drop_rate > 0): positions would no longer match tokens")
    for i, blk in enumerate(model.blocks):
        if not isinstance(blk.attn, SUPPORTED_ATTENTION):
            names = ", ".join(c.__name__ for c in SUPPORTED_ATTENTION)
            raise TypeError(f"block {i} has attention {type(blk.attn).__name__}; supported: {names}")


def _split_options(infos: list[SchemeInfo], options: dict[str, Any]) -> list[dict[str, Any]]:
    accepted = [set(accepted_options(i.name, 2)) for i in infos]
    unknown = sorted(set(options) - set().union(*accepted)) if infos else sorted(options)
    if unknown:
        names = ", ".join(i.name for i in infos) or "nope"
        raise TypeError(
            f"unknown option(s) {', '.join(unknown)} for {names}; accepted: {sorted(set().union(*accepted))}"
        )
    return [{k: v for k, v in options.items() if k in acc} for acc in accepted]


def _learned_from_timm(model: nn.Module, grid: tuple[int, int], options: dict[str, Any]) -> nn.Module:
    """learned2d that starts from the model's own table when it has one (same outputs at the native size)."""
    embed_dim = model.embed_dim
    prefix = 0 if model.no_embed_class else model.num_prefix_tokens
    module = create_encoding(
        "learned2d", ndim=2, **{"dim": embed_dim, "grid": grid, "num_prefix_tokens": prefix, **options}
    )
    table = getattr(model, "pos_embed", None)
    if (
        table is not None
        and not module.factorized
        and module.grid == grid
        and table.shape[1] == prefix + grid[0] * grid[1]
    ):
        with torch.no_grad():
            module.table.copy_(table[0, prefix:].reshape(*grid, embed_dim))
            if prefix:
                module.prefix.copy_(table[0, :prefix])
    return module


def patch(model: nn.Module, pos: str | list[str] | tuple[str, ...], **options: Any) -> nn.Module:
    """Give a timm ViT the positional scheme ``pos`` (one name, or an additive + an attention scheme).

    In place; returns the model. Scheme options (``theta``, ``coords``, ``scaling``...) go to the
    scheme that accepts them. The model then runs at any input size divisible by its patch size.
    Patching twice is refused: patch a fresh model and load the weights instead.
    """
    _check_model(model)
    additive, attention = _resolve_schemes(pos)
    used = [i for i in (additive, attention) if i is not None]
    per_scheme = dict(zip([i.name for i in used], _split_options(used, options), strict=False))
    add_opts = per_scheme.get(additive.name, {}) if additive is not None else {}
    att_opts = per_scheme.get(attention.name, {}) if attention is not None else {}
    grid = check_grid(tuple(model.patch_embed.grid_size))
    attn0 = model.blocks[0].attn
    depth, heads, head_dim = len(model.blocks), attn0.num_heads, attn0.head_dim

    add_module = None
    if additive is not None:
        if additive.name == "learned2d":
            add_module = _learned_from_timm(model, grid, add_opts)
        else:
            add_module = create_encoding(additive.name, ndim=2, **{"dim": model.embed_dim, **add_opts})
    att_module: nn.Module | nn.ModuleList | None = None
    if attention is not None:
        auto = {"dim": head_dim, "num_heads": heads, "grid": grid, "train_grid": grid}
        accepted = accepted_options(attention.name, 2)
        kwargs = {k: v for k, v in auto.items() if k in accepted} | att_opts
        if attention.per_layer:
            att_module = nn.ModuleList(create_encoding(attention.name, ndim=2, **kwargs) for _ in range(depth))
        else:
            att_module = create_encoding(attention.name, ndim=2, **kwargs)

    model.vispos = Positions(
        additive=add_module,
        attention=att_module,
        attention_kind=attention.kind if attention is not None else "none",
        depth=depth,
        num_prefix_tokens=model.num_prefix_tokens,
        patch_size=tuple(model.patch_embed.patch_size),
    )
    model.pos_embed = None
    if isinstance(model, Eva):
        model.rope, model.rope_mixed = None, False
    for i, blk in enumerate(model.blocks):
        blk.attn = PatchedAttention(blk.attn, layer_idx=i)
    pe = model.patch_embed
    pe.flatten, pe.output_fmt, pe.strict_img_size, pe.dynamic_img_pad = False, Format.NHWC, False, False
    model.dynamic_img_size = True
    model._pos_embed = types.MethodType(_pos_embed, model)
    model.forward_features = types.MethodType(_forward_features, model)
    model.forward_intermediates = types.MethodType(_forward_intermediates, model)
    model.vispos_cfg = {
        "pos": [i.name for i in used] or ["nope"],
        "options": dict(options),
        "train_grid": grid,
    }
    return model


def create_model(
    model_name: str, *, pos: str | list[str], pos_options: dict[str, Any] | None = None, **timm_kwargs: Any
):
    """``timm.create_model(model_name, **timm_kwargs)`` followed by ``patch(model, pos, **pos_options)``."""
    return patch(timm.create_model(model_name, **timm_kwargs), pos, **(pos_options or {}))


def _patched(model: nn.Module) -> Positions:
    pos = getattr(model, "vispos", None)
    if not isinstance(pos, Positions):
        raise ValueError("this model is not patched by vispos; call vispos.patch(model, ...) first")
    return pos


_KEEP: Any = object()  # "leave this setting as it is"


def configure(
    model: nn.Module,
    *,
    scaling: str | dict | None = _KEEP,
    train_grid: tuple[int, int] | None = None,
    log_n_attention: bool | None = None,
    **scaling_options: Any,
) -> nn.Module:
    """Inference-time settings of a patched model for grids larger than training; no re-patching.

    ``scaling``: RoPE scaling of a rope2d model, "linear", "ntk", "yarn" (or any ``RopeScaling`` type,
    options such as ``factor=`` as keywords), or None to switch it off. Each axis is stretched by its
    own factor, current / training size (at least 1), unless ``factor=`` is given.
    ``log_n_attention``: True multiplies every logit by max(1, ln N / ln N_train) (N patch tokens);
    works with any scheme. ``train_grid`` defaults to the grid the model had when it was patched.
    Settings left out keep their current value.
    """
    from .encodings.rope import Rope2d  # noqa: PLC0415

    pos = _patched(model)
    grid = check_grid(train_grid if train_grid is not None else model.vispos_cfg["train_grid"], "train_grid")
    if scaling is _KEEP and scaling_options:
        raise ValueError(f"scaling options {sorted(scaling_options)} given without scaling=")
    if scaling is not _KEEP:
        ropes = [m for m in pos.modules() if isinstance(m, Rope2d)]
        if not ropes:
            raise ValueError(f"RoPE scaling applies to rope2d; this model uses {model.vispos_cfg['pos']}")
        for rope in ropes:
            rope.set_scaling(scaling, train_grid=grid, **scaling_options)
        model.vispos_cfg["scaling"] = (
            None if scaling is None else {"scaling": scaling, "train_grid": grid, **scaling_options}
        )
    if log_n_attention is not None:
        if not isinstance(log_n_attention, bool):
            raise TypeError(f"log_n_attention must be a bool, got {type(log_n_attention).__name__}")
        pos.log_n_tokens = grid[0] * grid[1] if log_n_attention else None
        if log_n_attention and pos.log_n_tokens < 2:
            raise ValueError("log_n_attention needs a training grid of at least 2 patches")
        model.vispos_cfg["log_n_attention"] = log_n_attention
    return model


def set_position_enabled(model: nn.Module, enabled: bool) -> nn.Module:
    """Turn a patched model's whole positional scheme off (``False``) or back on; weights are kept."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _patched(model).enabled = enabled
    return model
