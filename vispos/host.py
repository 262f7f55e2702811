"""What every host adapter (``vispos.timm``, ``vispos.hf``) does the same way, knowing no model library.

- ``plan_schemes``: the schemes a ``patch`` call names (at most one additive, one attention and one
  conditional scheme), each one's options, and what happens to a model's own RoPE and learned table
  (kept by default, with a ``PretrainedPositionsWarning`` for whatever is discarded or overridden).
- ``build_positions``: the ``Positions`` of a host, built for its widths, heads, depth and training grid
  (``HostShape``), starting from the host's own table and learned RoPE frequencies where it has them.
- ``PositionsHost``: the mixin every patched model class takes (``vispos``, ``vispos_cfg``, ``load_state_dict``).
- ``named_base``: the library class a patched class's module-level name stands for (how pickle finds it).

An adapter reads its library's models into these terms (``OwnRope``, ``HostShape``) and back.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._validate import check_grid
from .positions import Positions
from .registry import SchemeInfo, build_in_context, get_info, list_encodings, split_options

ATTENTION_KINDS: tuple[str, ...] = ("rotary", "bias", "query_bias", "channels")  # applied inside attention


class PretrainedPositionsWarning(UserWarning):
    """Patching discards or overrides positions a pretrained model's weights were trained with."""


def warn(message: str) -> None:
    warnings.warn(message, PretrainedPositionsWarning, stacklevel=4)


class PositionsHost:
    """What every patched model has (mixed in before its library's class): ``vispos`` holds its positions."""

    vispos: Positions

    @property
    def vispos_cfg(self) -> dict[str, Any]:
        """The positional settings: schemes, options, training grid, and what ``vispos.configure`` set."""
        return self.vispos.settings

    def positional_no_weight_decay(self) -> set[str]:
        """The positional parameters ``no_weight_decay()`` lists: every one but those of a scheme whose release
        decays them (a module with ``weight_decayed = True``: pape2d's projections)."""
        decayed = {id(p) for m in self.vispos.modules() if getattr(m, "weight_decayed", False) for p in m.parameters()}
        return {f"vispos.{name}" for name, p in self.vispos.named_parameters() if id(p) not in decayed}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``; with ``strict=False`` a checkpoint of other positions (or a plain
        checkpoint whose table the scheme cannot hold) gives every weight outside the positions and reports the
        positional entries it skipped, instead of being refused."""
        self.vispos.strict_loading = strict
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)  # type: ignore[misc]
        finally:
            self.vispos.strict_loading = True


@dataclass
class OwnRope:
    """A host model's own RoPE as a vispos scheme: ``scheme`` with ``options`` (plus learned ``freqs`` for
    RoPE-Mixed, [2 (x, y), depth, heads, head_dim / 2]); ``source`` names where it was read."""

    scheme: str
    options: dict[str, Any]
    source: str
    freqs: torch.Tensor | None = field(default=None, repr=False)
    freqs_order: str = "xy"  # the host's first frequency component multiplies x ("xy") or y ("yx")
    what: str = "RoPE"  # what the model's own positions are, in warnings ("relative position bias": BEiT)

    def record(self) -> dict[str, str]:
        """What ``vispos_cfg["inherited"]`` keeps: the source, and for learned frequencies their axis order
        (so that a plain checkpoint's frequencies can be loaded later)."""
        return {"from": self.source} | ({"freqs_order": self.freqs_order} if self.freqs is not None else {})

    def describe(self) -> str:
        return f"{self.source}: {self.scheme}({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"


@dataclass(frozen=True)
class HostShape:
    """What a host model fixes for its positions: token width, heads, per-head width, depth, and the number
    of prefix tokens (class, distillation, register tokens) before the patch tokens of every row."""

    embed_dim: int
    num_heads: int
    head_dim: int
    depth: int
    num_prefix_tokens: int


def merge_options(own: OwnRope, chosen: dict[str, Any]) -> dict[str, Any]:
    """The inherited options with the user's on top; one warning names every override."""
    overridden = {k: v for k, v in chosen.items() if k in own.options and _differs(v, own.options[k])}
    if overridden:
        said = ", ".join(f"{k}={v!r}" for k, v in overridden.items())
        assumed = ", ".join(f"{k}={own.options[k]!r}" for k in overridden)
        warn(
            f"you set {said}, but this model's pretrained weights assume {assumed} ({own.source}); "
            "its outputs will change. Drop those options to keep what the model learned"
        )
    return own.options | chosen


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return tuple(a) != tuple(b)
    return a != b


def adopt_freqs(modules: nn.ModuleList, own: OwnRope) -> None:
    """Copy RoPE-Mixed's learned frequencies, layer by layer, into vispos's per-layer modules."""
    assert own.freqs is not None
    with torch.no_grad():
        for i, module in enumerate(modules):
            module.freqs.copy_(own.freqs[:, i])


def resolve_schemes(
    pos: str | list[str] | tuple[str, ...],
) -> tuple[SchemeInfo | None, SchemeInfo | None, SchemeInfo | None]:
    """(additive, attention, conditional) schemes named by ``pos``: at most one of each."""
    names = [pos] if isinstance(pos, str) else list(pos) if isinstance(pos, (list, tuple)) else None
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"pos must be a scheme name or a list of names, got {pos!r}")
    infos = [get_info(n, ndim=2) for n in names]
    additive = [i for i in infos if i.kind == "additive"]
    attention = [i for i in infos if i.kind in ATTENTION_KINDS]
    conditional = [i for i in infos if i.kind == "conditional"]
    if len(additive) > 1 or len(attention) > 1 or len(conditional) > 1:
        raise ValueError(
            f"combine at most one additive scheme, one attention scheme and one conditional scheme, got {names}; "
            f"additive: {', '.join(list_encodings(2, kind='additive'))}; "
            f"attention: {', '.join(list_encodings(2, kind=ATTENTION_KINDS))}; "
            f"conditional: {', '.join(list_encodings(2, kind='conditional'))}"
        )
    return tuple(group[0] if group else None for group in (additive, attention, conditional))


def refuse_one_grid(attention: SchemeInfo | None, host: str, batches: str) -> None:
    """A query-dependent bias (decomposed2d, irpe2d: tables from the query at each offset of one grid) has no ragged
    or packed form: a host whose every batch is ragged or packed (``batches`` says how) refuses it at ``patch``
    time, naming the attention schemes it takes."""
    if attention is None or attention.kind != "query_bias":
        return
    takes = [n for n in list_encodings(2, kind=ATTENTION_KINDS) if get_info(n, ndim=2).kind != "query_bias"]
    raise ValueError(
        f"{attention.name} on {host}: a query-dependent bias is built for one image grid, and {batches}; "
        f"attention schemes this model takes: {', '.join(takes)}"
    )


def _build(
    info: SchemeInfo,
    context: dict[str, Any],
    options: dict[str, Any],
    copies: int,
    layer_grids: list[tuple[int, int]] | None = None,
) -> nn.Module:
    if info.builds_per_layer(options):
        grids = layer_grids or [context["train_grid"]] * copies
        return nn.ModuleList(
            build_in_context(info, context | {"train_grid": g, "layer": i, "depth": len(grids)}, options)
            for i, g in enumerate(grids)
        )
    return build_in_context(info, context | {"layer": 0, "depth": copies}, options)


def plan_schemes(
    pos: str | list[str] | tuple[str, ...],
    options: dict[str, Any],
    *,
    own: OwnRope | None,
    has_table: bool,
) -> tuple[tuple[SchemeInfo | None, SchemeInfo | None, SchemeInfo | None], dict[str, dict[str, Any]], OwnRope | None]:
    """What to build for ``pos``: the (additive, attention, conditional) schemes, each one's options, and the
    model's own RoPE when it is kept. With ``inherit``, a model's RoPE is kept (its conventions as options,
    the user's on top) when ``pos`` names its scheme or no attention scheme, and its learned ``table`` stays
    beside it (as learned2d); whatever is discarded is said (``_inheriting``)."""
    additive, attention, conditional = resolve_schemes(pos)
    if own is not None:
        additive, attention = _inheriting(own, additive, attention, has_table=has_table)
    kept = own if own is not None and attention is not None and attention.name == own.scheme else None
    used = [i for i in (additive, attention, conditional) if i is not None]
    per_scheme = dict(zip([i.name for i in used], split_options(used, options), strict=True))
    if kept is not None:
        per_scheme[kept.scheme] = merge_options(kept, per_scheme[kept.scheme])
    return (additive, attention, conditional), per_scheme, kept


def build_positions(
    shape: HostShape,
    schemes: tuple[SchemeInfo | None, SchemeInfo | None, SchemeInfo | None],
    per_scheme: dict[str, dict[str, Any]],
    grid: tuple[int, int],
    table_prefix: int,
    kept: OwnRope | None = None,
    *,
    table: torch.Tensor | None = None,
    layer_grids: list[tuple[int, int]] | None = None,
) -> Positions:
    """The ``Positions`` of a host model: its (additive, attention, conditional) schemes built for the
    model's widths, heads, depth (``shape``) and training ``grid``; ``table_prefix``: the prefix rows of an additive
    table. A learned table starts from the model's own ``table`` where it fits; ``kept``: the model's
    own RoPE whose learned frequencies are adopted. ``layer_grids``: the grid each layer attends over, where
    it is not ``grid`` (SAM's window blocks), for the training grid of a per-layer attention scheme."""
    additive, attention, conditional = schemes
    grid = check_grid(grid)
    depth = shape.depth
    context = {"num_heads": shape.num_heads, "train_grid": grid}
    add_module = att_module = cond_module = None
    if additive is not None:
        add_context = context | {"dim": shape.embed_dim, "num_prefix_tokens": table_prefix}
        add_module = _build(additive, add_context, per_scheme[additive.name], depth)
        adopt = getattr(add_module, "adopt_pos_embed", None)  # start from the model's own table
        if adopt is not None and table is not None:
            adopt(table)
    if attention is not None:
        att_context = context | {
            "dim": shape.head_dim, "width": shape.embed_dim, "num_prefix_tokens": shape.num_prefix_tokens
        }
        att_module = _build(attention, att_context, per_scheme[attention.name], depth, layer_grids)
        if kept is not None and kept.freqs is not None:
            adopt_freqs(att_module, kept)
    if conditional is not None:
        cond_module = build_in_context(conditional, {"dim": shape.embed_dim}, per_scheme[conditional.name])
        if cond_module.after >= depth:
            raise ValueError(
                f"{conditional.name}: after={cond_module.after} is out of range; the model has {depth} blocks "
                f"(after=0 to {depth - 1})"
            )
    return Positions(
        additive=add_module,
        attention=att_module,
        attention_kind=attention.kind if attention is not None else "none",
        depth=depth,
        num_prefix_tokens=shape.num_prefix_tokens,
        train_grid=grid,
        schemes=[i.name for i in schemes if i is not None] or ["nope"],
        options={k: v for scheme_options in per_scheme.values() for k, v in scheme_options.items()},
        inherited=kept.record() if kept is not None else None,
        conditional=cond_module,
    )


def _inheriting(
    own: OwnRope, additive: SchemeInfo | None, attention: SchemeInfo | None, *, has_table: bool
) -> tuple[SchemeInfo | None, SchemeInfo | None]:
    """The schemes to build when the model has a RoPE of its own: its learned table (``has_table``) stays
    beside it (as learned2d) unless another additive scheme was asked for; anything discarded is said."""
    if attention is None or attention.name != own.scheme:
        asked = attention.name if attention is not None else "no attention scheme"
        warn(
            f"this model's own {own.what} ({own.describe()}) is discarded: {asked} replaces it, and the pretrained "
            f"weights were trained with it. Patch with {own.scheme!r} to keep it, or inherit=False to start "
            "fresh without this warning"
        )
        return additive, attention
    if not has_table:
        return additive, attention
    if additive is None:
        return get_info("learned2d", ndim=2), attention
    if additive.name != "learned2d":
        warn(
            f"this model's learned pos_embed (beside its {own.what}) is discarded: {additive.name} replaces it. "
            "Leave the additive scheme out (or use learned2d) to keep it"
        )
    return additive, attention




def named_base(name: str, prefix: str) -> tuple[str, type] | None:
    """``(mixin, base class)`` a patched class's module-level name ``<prefix>mixin:module:qualname]`` stands for
    (dots written as ``/``), or None for another name: a host module's ``__getattr__`` rebuilds the class from it."""
    if not (name.startswith(prefix) and name.endswith("]")):
        return None
    mixin, module, qualname = name[len(prefix) : -1].split(":")
    base: Any = importlib.import_module(module.replace("/", "."))
    for part in qualname.split("/"):
        base = getattr(base, part)
    return mixin, base
