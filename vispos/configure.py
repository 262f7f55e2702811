"""Inference-time settings of any module tree that holds vispos schemes, without rebuilding it.

``configure`` sets RoPE scaling on every scalable RoPE (1D ``rope`` in ``vispos.layers.Attention``
stacks, 2D ``rope2d`` in patched timm models) and log-n attention scaling on patched 2D models;
``set_position_enabled`` switches every scheme off or on (DroPE). Both find the schemes through the
registry's declared properties, not through class names, and work on a patched timm model and on a
plain ``nn.Module`` made of ``vispos.layers.Attention`` layers alike.
"""

from __future__ import annotations

import difflib
import inspect
import math
from dataclasses import fields
from typing import Any

from torch import nn

from ._validate import check_bool, check_choice, check_grid
from .drope import set_enabled
from .encodings.rope_scaling_setting import RopeScaling
from .positions import Positions, plain
from .registry import list_encodings

ATTENTION_BACKENDS: tuple[str, ...] = ("sdpa", "flex")
SETTINGS: tuple[str, ...] = ("scaling", "train_grid", "log_n_attention", "attention")  # configure's own keywords

_KEEP: Any = object()  # "leave this setting as it is"


def scalable_ropes(module: nn.Module) -> list[nn.Module]:
    """The RoPE modules under ``module`` whose frequencies ``configure(scaling=...)`` can stretch."""
    return [m for m in module.modules() if getattr(getattr(m, "scheme_info", None), "scalable", False)]


def _schemes_in_use(module: nn.Module) -> str:
    names = sorted({m.scheme_info.name for m in module.modules() if hasattr(m, "scheme_info")})
    return ", ".join(names) or "no vispos scheme"


def configure(
    module: nn.Module,
    *,
    scaling: RopeScaling | str | dict | None = _KEEP,
    train_grid: tuple[int, int] | None = None,
    log_n_attention: bool | None = None,
    attention: str | None = None,
    **scaling_options: Any,
) -> nn.Module:
    """Inference-time settings for inputs larger than training; no re-patching, no rebuilding.

    ``scaling``: RoPE scaling, ``"linear"``, ``"ntk"``, ``"yarn"``... (``vispos.SCALING_TYPES``), with
    ``RopeScaling`` fields such as ``factor=`` as keywords, a dict or a ``RopeScaling``; None switches
    it off. 2D RoPE stretches each axis by its own factor, current / training size (at least 1),
    unless ``factor=`` is given; 1D RoPE needs ``original_length=`` (the training length) for methods
    that derive the factor from the length. A diffusers transformer (``vispos.diffusers``) takes ``linear``,
    ``ntk`` and ``yarn`` per image axis, and ``schedule="dype"``: the scaling's strength follows the denoising
    timestep its forward receives (DyPE; docs/diffusers.md), for its own RoPE and for a rope2d put in a DiT or PixArt
    with ``inherit=False``. ``log_n_attention`` (2D): True multiplies every logit by
    max(1, ln N / ln N_train) for N = H x W patches of the image's grid (of a token subset's full image
    too: patch dropout and MAE keep the scale of their image); works with any scheme.

    ``train_grid`` (2D): the training grid both scalings are relative to, for a patched model
    ``Positions.scaling_grid``: the model's own training grid (``vispos_cfg["train_grid"]``, the grid it was
    patched at, which loading a checkpoint of another grid does not change), unless given here; a grid given
    here is recorded (``vispos_cfg["configured_train_grid"]``), applies to RoPE scaling and log-n alike, and
    is kept by later calls and through saving and loading. ``attention`` (2D relative biases: alibi2d, relbias2d,
    cpb2d): ``"flex"`` computes the bias inside FlexAttention from a per-offset table, so no
    [heads, N, N] mask is built (the path for large grids, compiled on first use); ``"sdpa"`` (default)
    hands SDPA one mask per layer. Settings left out keep their current value.
    Returns ``module``.
    """
    positions = [m for m in module.modules() if isinstance(m, Positions)]
    if not positions and not any(hasattr(m, "scheme_info") for m in module.modules()):
        raise ValueError("no vispos positional scheme found; patch the model with vispos.patch or use vispos.layers")
    _refuse_unknown(scaling_options, module)
    grid = None if train_grid is None else check_grid(train_grid, "train_grid")
    if scaling is _KEEP and scaling_options:
        raise ValueError(f"scaling options {sorted(scaling_options)} given without scaling=")
    if log_n_attention is not None:
        check_bool("log_n_attention", log_n_attention)
        if not positions:
            raise ValueError("log_n_attention applies to models patched with vispos.patch")
        if log_n_attention and any(math.prod(grid or pos.scaling_grid) < 2 for pos in positions):
            raise ValueError("log_n_attention needs a training grid of at least 2 patches")
    if attention is not None:
        check_choice("attention", attention, ATTENTION_BACKENDS)
        if attention == "flex" and not any(p.attention_kind == "bias" for p in positions):
            raise ValueError(
                f"attention='flex' applies to the 2D biases ({', '.join(list_encodings(2, kind='bias'))}); "
                f"this model uses {_schemes_in_use(module)}"
            )
    owner = {id(rope): pos for pos in positions for rope in scalable_ropes(pos)}
    if scaling is not _KEEP:
        ropes = scalable_ropes(module)
        if not ropes:
            raise ValueError(f"RoPE scaling applies to rope and rope2d; this model uses {_schemes_in_use(module)}")
        for rope in ropes:
            if rope.scheme_info.ndim == 2:
                at = owner[id(rope)].scaling_grid if grid is None and id(rope) in owner else grid
                rope.set_scaling(scaling, train_grid=at, **scaling_options)
            elif grid is not None:
                raise ValueError("train_grid applies to 2D RoPE; give 1D RoPE its training length as original_length=")
            else:
                rope.set_scaling(scaling, **scaling_options)
        for pos in positions:  # each patched model records its settings (saved with its weights)
            pos.settings["scaling"] = None if scaling is None else plain({"scaling": scaling, **scaling_options})
    for pos in positions:
        before = pos.settings.get("configured_train_grid")
        if grid is not None:
            pos.settings["configured_train_grid"] = list(grid)
        if log_n_attention is not None:
            pos.log_n_tokens = math.prod(grid or pos.scaling_grid) if log_n_attention else None
            pos.settings["log_n_attention"] = log_n_attention
        try:
            pos.follow_scaling_grid()  # every size-relative setting on the one training grid
        except ValueError:  # a grid a scheme refuses: the model keeps the one it had
            if before is None:
                pos.settings.pop("configured_train_grid", None)
            else:
                pos.settings["configured_train_grid"] = before
            raise
    if attention is not None:
        for pos in positions:
            pos.settings["attention"] = attention  # read back as Positions.attention_backend
    return module


def _refuse_unknown(given: dict[str, Any], module: nn.Module) -> None:
    """A keyword that is neither a setting of ``configure``, a ``RopeScaling`` field nor a keyword of the model's
    RoPEs' own ``set_scaling`` (the diffusers host's ``schedule``), named with the accepted ones and the nearest."""
    options = tuple(f.name for f in fields(RopeScaling) if f.name != "type")
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    own = {n: None for rope in scalable_ropes(module) for n, p in inspect.signature(rope.set_scaling).parameters.items()
           if p.kind in named and n not in ("scaling", "train_grid", "train_size")}  # fmt: skip
    options += tuple(n for n in own if n not in options)
    unknown = [k for k in given if k not in options]
    if unknown:
        near = {k: difflib.get_close_matches(k, SETTINGS + options, n=1) for k in unknown}
        hints = "".join(f" ({k!r}: did you mean {m[0]!r}?)" for k, m in near.items() if m)
        raise TypeError(
            f"vispos.configure got unknown keyword(s) {', '.join(map(repr, unknown))}{hints}; "
            f"accepted: {', '.join(SETTINGS)}, and with scaling= the RopeScaling fields {', '.join(options)}"
        )


def set_position_enabled(module: nn.Module, enabled: bool) -> nn.Module:
    """Turn every positional scheme under ``module`` off (``False``) or back on; weights are kept."""
    check_bool("enabled", enabled)
    if set_enabled(module, enabled) == 0:
        raise ValueError("no vispos positional scheme found; patch the model with vispos.patch or use vispos.layers")
    return module
