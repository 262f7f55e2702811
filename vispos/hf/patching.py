"""``vispos.patch(model, "rope2d")`` on a transformers vision model (``loading.py`` rebuilds a saved one).

What changes on the one model it is given (never on transformers' classes): the vision module (the model,
the backbone of a head, or the vision tower of CLIP / SigLIP) gets ``vispos`` (a ``Positions``); its
embeddings, attentions and (DINOv3) ``rope_embeddings`` take the patched classes of ``modules.py``; its own
learned table leaves the embeddings (``position_embeddings`` / ``position_embedding`` become None) for
``vispos.additive`` when it is kept; ``model.config.vispos`` records the settings for ``save_pretrained``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import host as hosting
from .._validate import check_bool
from ..host import HostShape, warn
from ..positions import Positions, own_records
from .families import FAMILIES, Family, attentions, find_host, own_rope, own_table, patch_conv, train_grid
from .modules import FLASH_REFUSAL, NoRope, PatchedAttention, PatchedEmbeddings, PatchedHost, PositionsHost, patched
from .towers import find_tower, patch_tower

ALREADY_PATCHED = (
    "this model is already patched by vispos; patch a fresh model instead (a patched model's weights load into a "
    "freshly patched one with load_state_dict)"
)
CONFIG_KEY = "vispos"  # model.config.vispos: what from_pretrained rebuilds a patched model from


def patch(
    model: nn.Module, pos: str | list[str] | tuple[str, ...], *, inherit: bool = True, **options: Any
) -> nn.Module:
    """Give a transformers vision model the positional scheme ``pos`` (``vispos.patch`` reaches here for any
    transformers model). In place; returns the model.

    With ``inherit`` (default) the model keeps its own positions: its learned table as ``learned2d``
    (prefix rows kept, resized at other sizes as the family resizes it) when ``pos`` includes ``learned2d``;
    DINOv3's RoPE as ``rope2d`` with its conventions (``docs/hf.md``). What is discarded or overridden is said
    with a ``PretrainedPositionsWarning``; ``inherit=False`` starts fresh silently."""
    check_bool("inherit", inherit)
    found = find_tower(model)
    if found is not None:  # a VLM's vision tower (Pixtral), alone or inside its VLM
        return _patch_tower(model, *found, pos, inherit, options)
    tower, vision, family = find_host(model)
    if isinstance(vision, PatchedHost):
        raise ValueError(ALREADY_PATCHED)
    layers = attentions(vision)
    if not layers:
        raise TypeError(f"transformers {type(vision).__name__} has no attention layer vispos knows")
    embeddings, config = vision.embeddings, vision.config
    table = own_table(embeddings, family) if inherit else None
    own = own_rope(vision, family) if inherit else None
    schemes, per_scheme, kept = hosting.plan_schemes(pos, options, own=own, has_table=False)
    additive, attention, conditional = schemes
    adopt = _table_plan(family, table, additive, per_scheme)
    _refuse_flash(attention, config)
    if family.naflex:
        hosting.refuse_one_grid(attention, type(vision).__name__, "its batches hold each image at its own grid")
    registers = getattr(embeddings, family.registers).shape[1] if family.registers else 0
    shape = HostShape(config.hidden_size, config.num_attention_heads, layers[0].head_dim, len(layers),
                      len(family.prefix) + registers)  # fmt: skip
    grid = train_grid(config, None if family.naflex else patch_conv(embeddings))
    positions = hosting.build_positions(shape, schemes, per_scheme, grid, len(family.prefix), kept, table=adopt)
    adopted = adopt is not None and _adopted(positions, adopt)
    if adopt is not None and not adopted:
        warn(f"this model's learned table {tuple(adopt.shape)} does not fit learned2d at the {grid[0]}x{grid[1]} "
             "grid of its config's image_size: learned2d starts fresh")  # fmt: skip
    _remove_table(embeddings, family)
    embeddings.vispos_table_adopted = adopted  # learned2d takes the values of the family's init (table_init.py)
    vision.vispos = positions.train(vision.training)  # a model patched in eval mode stays in it
    vision.__class__ = patched(type(vision), PatchedHost)
    _register_recorded_outputs(vision)
    embeddings.vispos_family = type(embeddings).__name__  # the key of its family in FAMILIES
    embeddings.__class__ = patched(type(embeddings), PatchedEmbeddings)
    embeddings.__dict__["_vispos_positions"] = positions
    for i, attn in enumerate(layers):
        attn.__class__ = patched(type(attn), PatchedAttention)
        attn.vispos_layer = i
    rope = getattr(vision, "rope_embeddings", None)
    if family.rope and isinstance(rope, nn.Module):
        rope.__class__ = patched(type(rope), NoRope)
    if conditional is not None:
        _hook_conditional(vision, positions)
    vision.register_load_state_dict_pre_hook(_adopt_plain_checkpoint)
    model.config.__dict__[CONFIG_KEY] = {"tower": tower, **positions.settings, "train_grid": list(grid)}
    return model


def _patch_tower(model: nn.Module, name: str, tower: nn.Module, pos: Any, inherit: bool, options: dict) -> nn.Module:
    if isinstance(tower, PositionsHost):
        raise ValueError(ALREADY_PATCHED)
    positions = patch_tower(tower, pos, inherit, options)
    _register_recorded_outputs(tower)
    tower.register_load_state_dict_pre_hook(_adopt_plain_checkpoint)
    model.config.__dict__[CONFIG_KEY] = {"tower": name, **positions.settings,
                                         "train_grid": list(positions.train_grid)}  # fmt: skip
    return model


def _register_recorded_outputs(vision: nn.Module) -> None:
    """transformers records ``output_attentions`` / ``output_hidden_states`` through a registry keyed by the
    model's class name (``utils.output_capturing._CAN_RECORD_REGISTRY``): the patched class is entered
    with the original's entry."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # releases that read _can_record_outputs from the class itself
        return
    # keyed by str(class) in every release (5.24 wraps the dict in a class that takes the model instead)
    dict.__setitem__(_CAN_RECORD_REGISTRY, str(type(vision)), getattr(vision, "_can_record_outputs", None))


def _table_plan(
    family: Family, table: torch.Tensor | None, additive: Any, per_scheme: dict[str, dict[str, Any]]
) -> torch.Tensor | None:
    """The table learned2d starts from (the model's own, resized as the family resizes it), or None; a table
    that ``pos`` discards is said."""
    if table is None:
        return None
    if additive is None or additive.name != "learned2d":
        asked = f"{additive.name} replaces it" if additive is not None else "pos names no additive scheme"
        warn(
            f"this {family.name} model's learned position table is discarded ({asked}), and the "
            "pretrained weights were trained with it. Add 'learned2d' to keep it (e.g. pos=['learned2d', "
            "'rope2d']), or inherit=False to start fresh without this warning"
        )
        return None
    chosen = per_scheme["learned2d"]
    if chosen.get("antialias", family.antialias) != family.antialias:
        warn(f"you set antialias={chosen['antialias']!r}, but {family.name} resizes its table with "
             f"antialias={family.antialias!r}: at other sizes the outputs differ from the model's")  # fmt: skip
    if chosen.get("interpolation", family.interpolation) != family.interpolation:
        warn(f"you set interpolation={chosen['interpolation']!r}, but {family.name} resizes its table with "
             f"{family.interpolation!r}: at other sizes the outputs differ from the model's")  # fmt: skip
    per_scheme["learned2d"] = {"antialias": family.antialias, "interpolation": family.interpolation} | chosen
    return table


def _adopted(positions: Positions, table: torch.Tensor) -> bool:
    additive = positions.additive
    if table.is_meta:  # a model built on the meta device: adopted as meta (``adopt_pos_embed``), no values to compare
        return bool(additive.table.is_meta)
    return bool(torch.equal(additive.table.reshape(-1), table[0, additive.num_prefix_tokens :].reshape(-1).to(
        additive.table.dtype)))  # fmt: skip


def _refuse_flash(attention: Any, config: Any) -> None:
    impl = getattr(config, "_attn_implementation", None) or ""
    if attention is not None and attention.kind in ("bias", "query_bias") and "flash" in impl:
        raise ValueError(f"{attention.name} with attn_implementation={impl!r}: {FLASH_REFUSAL}")


def _remove_table(embeddings: nn.Module, family: Family) -> None:
    """The family's table leaves the embeddings (None in its place, so the attribute still reads); its shape is
    kept (``vispos_table_shape``: the family's init draws a table of that shape, ``table_init.py``)."""
    if family.table is None:
        return
    name = family.table.split(".")[0]
    table: object = embeddings
    for part in family.table.split("."):
        table = getattr(table, part, None)
    if isinstance(table, torch.Tensor):
        embeddings.vispos_table_shape = tuple(table.shape)
    if name in embeddings._parameters:
        del embeddings._parameters[name]
        embeddings.register_parameter(name, None)
    elif name in embeddings._modules:
        embeddings._modules[name] = None


def _hook_conditional(vision: nn.Module, positions: Positions) -> None:
    """A conditional scheme (peg2d) on the output of the layer it follows: a forward hook on that layer."""
    names = [name for name, m in vision.named_modules() if isinstance(m, PatchedAttention)]
    after = positions.conditional.after
    layer = vision.get_submodule(names[after].rsplit(".", 1)[0])
    layer.register_forward_hook(_after_layer, with_kwargs=True)


def _after_layer(layer: nn.Module, args: tuple, kwargs: dict[str, Any], out: Any) -> Any:
    ctx = kwargs.get("vispos_context")
    if ctx is None:
        raise ValueError("a vispos-patched layer needs the positional context of the forward pass: call the model")
    if isinstance(out, tuple):
        return (ctx.positions.apply_conditional(out[0], ctx), *out[1:])
    return ctx.positions.apply_conditional(out, ctx)


def _adopt_plain_checkpoint(vision: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """``load_state_dict`` pre-hook: a transformers checkpoint of the unpatched model (no ``vispos.`` keys)
    loads into a patched one: its table goes to learned2d when the model has it (else strict loading refuses
    it by name), and the positions keep their own settings records."""
    if any(k.startswith(f"{prefix}vispos.") for k in state_dict):
        return  # a patched checkpoint: Positions checks its settings
    positions: Positions = vision.vispos
    state_dict.update(own_records(positions, f"{prefix}vispos."))
    if not hasattr(vision, "embeddings"):  # a VLM tower: no table of its own
        return
    family = FAMILIES[vision.embeddings.vispos_family]
    if family.table is None:
        return
    key = f"{prefix}embeddings.{family.table}"
    if key not in state_dict:
        return
    table = state_dict.pop(key)
    table = table.reshape(1, -1, table.shape[-1])  # CLIP's and SigLIP's nn.Embedding rows: [P + H*W, C]
    adopt = getattr(positions.additive, "adopt_pos_embed", None)
    if adopt is None or not adopt(table):
        if not positions.strict_loading:
            return
        raise ValueError(
            f"this checkpoint holds the model's own position table {tuple(table.shape)}, which this patched model "
            f"({' + '.join(positions.settings['pos'])}) has no place for: patch with learned2d to keep it, or load "
            "with strict=False to take every other weight"
        )
    for name, value in positions.additive.state_dict().items():
        state_dict[f"{prefix}vispos.additive.{name}"] = value
