"""``vispos.patch(model, "rope2d")``: swap the positional scheme of a timm ViT.

``patch`` checks the model and hands it to its host: ``vit.py`` (``VisionTransformer``, ``Eva``), ``naflex.py``,
``beit.py``, ``relpos.py``, ``swin.py`` or ``sam.py``; ``create_model`` builds and patches, loading a patched
model's weights.

What changes for a ``VisionTransformer`` / ``Eva`` on the one model it is given (never on timm's classes):

- ``model.vispos`` (a ``Positions`` module) holds the scheme's modules and builds, once per forward
  and from the actual token grid, a ``PositionContext``: RoPE angles and attention biases per layer.
- each ``blocks[i].attn`` becomes a ``PatchedAttention`` that adopts the original's weights.
- the model's class becomes ``patched_class(type(model))`` (``model.py``), whose ``_pos_embed``,
  ``forward_features`` and ``forward_intermediates`` use those positions.
- the patch embedding emits NHWC grids (timm's ``dynamic_img_size``), so any input it accepts works.
- with a conditional scheme (``peg2d``), ``blocks[after]`` gets a forward hook (``model.after_block``) that
  applies it to that block's output, whoever calls the block with the context.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import timm
from timm.models import load_pretrained
from timm.models.beit import Beit
from timm.models.eva import Eva
from timm.models.naflexvit import NaFlexVit
from timm.models.swin_transformer import SwinTransformer
from timm.models.swin_transformer_v2 import SwinTransformerV2
from timm.models.swin_transformer_v2_cr import SwinTransformerV2Cr
from timm.models.vision_transformer import VisionTransformer
from timm.models.vision_transformer_relpos import VisionTransformerRelPos
from timm.models.vision_transformer_sam import VisionTransformerSAM
from torch import nn

from .._validate import check_bool
from .attention import SUPPORTED_ATTENTION
from .beit import patch_beit
from .model import PatchedViT, patched_weights
from .naflex import patch_naflex
from .relpos import patch_relpos
from .sam import patch_sam
from .swin import patch_swin
from .swin_cr import patch_swin_cr
from .vit import patch_vit

# NaFlexVit, Beit, VisionTransformerRelPos, SwinTransformer(V2, V2Cr), VisionTransformerSAM: hosts of their own
# (naflex.py, beit.py, relpos.py, swin.py, swin_cr.py, sam.py)
SUPPORTED_MODELS: tuple[type, ...] = (
    VisionTransformer, Eva, NaFlexVit, Beit, VisionTransformerRelPos, SwinTransformer, SwinTransformerV2,
    SwinTransformerV2Cr, VisionTransformerSAM,
)  # fmt: skip
SUPPORTED = ", ".join(f"timm {c.__name__}" for c in SUPPORTED_MODELS) + " (and subclasses such as DeiT)"


# --- patch ----------------------------------------------------------------------------------------


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, SUPPORTED_MODELS):
        raise TypeError(f"vispos.patch supports {SUPPORTED}; got {type(model).__name__}")
    if isinstance(model, PatchedViT):
        raise ValueError(
            "this model is already patched by vispos; patch a fresh model instead "
            "(a patched model's weights load into a freshly patched one with load_state_dict)"
        )
    names = ", ".join(c.__name__ for c in SUPPORTED_ATTENTION)
    for i, blk in enumerate(model.blocks):
        attn = getattr(blk, "attn", None)
        if attn is None:  # ParallelScalingBlock, ParallelThingsBlock: attention fused with the MLP
            raise TypeError(
                f"block {i} is a {type(blk).__name__}, whose attention has no attn submodule to replace; "
                f"vispos.patch supports blocks with an attn of type {names} (timm's Block, ResPostBlock, EvaBlock)"
            )
        if not isinstance(attn, SUPPORTED_ATTENTION):
            raise TypeError(f"block {i} has attention {type(attn).__name__}; supported: {names}")


def patch(
    model: nn.Module, pos: str | list[str] | tuple[str, ...], *, inherit: bool = True, **options: Any
) -> nn.Module:
    """Give a timm ViT the positional scheme ``pos``: one name, or a list of at most one additive, one
    attention and one conditional scheme (``peg2d``: on the tokens after block ``after``, a forward hook
    on that block).

    In place; returns the model. Scheme options (``theta``, ``coords``, ``scaling``...) go to the
    scheme that accepts them; what the model determines (widths, heads, grid) is not an option.
    The model then runs at any input size divisible by its patch size. Patching twice is refused:
    patch a fresh model and load the weights instead.

    A model with a RoPE of its own (timm's RoPE-ViT, EVA-02, DINOv3, PE models) keeps it by default
    (``inherit=True``): ``rope2d`` (``rope2d_mixed`` for RoPE-Mixed models, whose learned frequencies
    are adopted) takes the model's conventions as options, and a learned ``pos_embed`` beside the RoPE
    stays (as ``learned2d``), so the outputs are unchanged. Options you pass win, with a
    ``PretrainedPositionsWarning`` naming what the weights assume; another scheme discards the model's
    RoPE with that warning too. ``inherit=False`` starts from fresh positions silently.
    """
    check_bool("inherit", inherit)
    if isinstance(model, NaFlexVit):  # its own host: positions from patch_coord / patch_valid
        return patch_naflex(model, pos, inherit=inherit, **options)
    if isinstance(model, Beit):  # its own host: a relative bias of its own, blocks that take shared_rel_pos_bias
        return patch_beit(model, pos, inherit=inherit, **options)
    if isinstance(model, VisionTransformerRelPos):  # its own host: the bias inside every attention
        return patch_relpos(model, pos, inherit=inherit, **options)
    if isinstance(model, (SwinTransformer, SwinTransformerV2)):  # windowed attention: its own host
        return patch_swin(model, pos, inherit=inherit, **options)
    if isinstance(model, SwinTransformerV2Cr):  # Swin V2 laid out otherwise (NCHW stages, meta_mlp): its own host
        return patch_swin_cr(model, pos, inherit=inherit, **options)
    if isinstance(model, VisionTransformerSAM):  # its own host: NHWC windows, per-block decomposed relative tables
        return patch_sam(model, pos, inherit=inherit, **options)
    _check_model(model)
    return patch_vit(model, pos, inherit=inherit, **options)


def create_model(
    model_name: str,
    *,
    pos: str | list[str],
    pos_options: dict[str, Any] | None = None,
    inherit: bool = True,
    use_ema: bool = True,
    **timm_kwargs: Any,
) -> nn.Module:
    """``timm.create_model(model_name, **timm_kwargs)`` followed by ``patch(model, pos, inherit=inherit,
    **pos_options)``.

    Weights that timm is asked to load (``pretrained=True`` with ``pretrained_cfg_overlay=dict(file=...)``,
    or ``checkpoint_path=``) may be a patched model's (``.safetensors`` or a torch file): they are then
    loaded after patching, through timm's own loaders (so a classifier of another size is dropped as timm
    does). A checkpoint made at another image size loads too: tables are resampled to this model's grid.
    ``use_ema``: a patched model's checkpoint that holds an EMA of its weights (a trainer checkpoint of a run
    with ``train.ema``, timm's ``state_dict_ema`` / ``model_ema``) gives the EMA, the weights the run
    evaluated and reported, as timm's ``load_checkpoint`` does by default; ``use_ema=False`` gives the last
    step's weights (``model`` / ``state_dict``).
    """
    check_bool("inherit", inherit)
    check_bool("use_ema", use_ema)
    state, how = _vispos_weights(timm_kwargs, use_ema)
    if state is None:
        return patch(timm.create_model(model_name, **timm_kwargs), pos, inherit=inherit, **(pos_options or {}))
    kwargs = {k: v for k, v in timm_kwargs.items() if k not in ("pretrained", "checkpoint_path")}
    model = patch(timm.create_model(model_name, **kwargs), pos, inherit=inherit, **(pos_options or {}))
    if how == "pretrained":  # timm's loader, handed the weights picked (it drops a classifier of another size)
        load_pretrained(model, {**model.pretrained_cfg, "state_dict": state}, num_classes=model.num_classes,
                        in_chans=_in_chans(model))  # fmt: skip
    else:
        model.load_state_dict(state)  # as timm's load_checkpoint, once it has read the file
    return model


def _vispos_weights(timm_kwargs: dict[str, Any], use_ema: bool) -> tuple[dict[str, Any] | None, str]:
    """The weights timm would load into the model, when they are a patched model's (``vispos.`` keys), and
    how timm was asked to load them (``"checkpoint"`` or ``"pretrained"``)."""
    overlay = timm_kwargs.get("pretrained_cfg_overlay") or {}
    candidates = [(timm_kwargs.get("checkpoint_path"), "checkpoint")]
    if timm_kwargs.get("pretrained"):
        candidates.append((overlay.get("file"), "pretrained"))
    for file, how in candidates:
        if file and Path(file).is_file() and (state := patched_weights(file, use_ema=use_ema)) is not None:
            return state, how
    return None, ""


def _in_chans(model: nn.Module) -> int:
    return model.patch_embed.proj.in_channels if hasattr(model.patch_embed, "proj") else 3
