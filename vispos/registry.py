"""Scheme registry: name -> builder, with each scheme's properties as data.

Schemes register themselves beside their class with the ``register`` decorator; ``describe()``, the
hosts (``vispos.patch``, ``vispos.layers.Attention``) and the parametrised tests all read this table.
The registry imports no scheme: ``vispos/encodings/__init__.py`` imports every family module, and
importing ``vispos`` imports that package, so the table is full before any lookup.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import torch
from torch import nn

Kind = Literal["additive", "rotary", "bias", "query_bias", "channels", "relative_kv", "conditional", "none"]
# How each kind enters a transformer (also the "acts on" column of the property table).
ACTS_ON: dict[str, str] = {
    "additive": "embedding (added)",
    "rotary": "q, k",
    "bias": "attention logits",
    "query_bias": "attention logits (from q)",
    "channels": "q, k (channels appended: a bias inside fused attention)",
    "relative_kv": "q.k and value sum",
    "conditional": "tokens after a block (conv on the grid)",
    "none": "-",
}
KINDS: tuple[str, ...] = tuple(ACTS_ON)

# What a host injects into a scheme's constructor, by name; each scheme declares the subset it takes.
CONTEXT: dict[str, str] = {
    "dim": "channels the scheme acts on: the token width (additive and conditional schemes) or the head width "
    "(attention schemes)",
    "num_heads": "attention heads",
    "train_grid": "the (H, W) patch grid of the training resolution (2D)",
    "num_prefix_tokens": "prefix tokens (cls, distillation, registers) the scheme gives entries of their own (2D): "
    "those timm's pos_embed covers (additive schemes), all of them (attention schemes)",
    "width": "the token width the attention takes (schemes computing from the attention's input)",
    "causal": "whether attention is causal (1D)",
    "layer": "the index of the layer an instance serves (per-layer schemes whose form changes with depth)",
    "depth": "the number of layers the instances of a per-layer scheme serve",
}

M = TypeVar("M", bound=type[nn.Module])


@dataclass(frozen=True)
class SchemeInfo:
    """What a scheme is, as data (the seed survey's property table, per scheme)."""

    name: str
    ndim: int  # 1: token sequences, 2: patch grids
    kind: Kind  # how it enters attention; hosts dispatch on this
    trainable: bool
    relative: bool  # logits between tokens depend only on their offset
    extrapolation: str  # what happens beyond the training length / grid
    summary: str
    builder: Callable[..., nn.Module] = field(repr=False, compare=False)
    context: tuple[str, ...] = ()  # constructor arguments the host fills in (keys of CONTEXT)
    per_layer: bool = False  # one instance per transformer layer (a ``per_layer`` option's default where it has one)
    scalable: bool = False  # RoPE whose frequencies ``vispos.configure(scaling=...)`` can stretch
    reference: str = ""
    position_axes: int = 1  # 1D: position ids per token; > 1 takes positions [axes, (B,) N] (mrope: t, h, w)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r}; accepted: {', '.join(KINDS)}")
        if self.ndim not in (1, 2):
            raise ValueError(f"ndim must be 1 or 2, got {self.ndim!r}")
        if self.position_axes != 1 and (self.ndim != 1 or self.position_axes < 1):
            raise ValueError(f"position_axes > 1 is for 1D schemes, got {self.position_axes!r} for {self.ndim}D")
        unknown = sorted(set(self.context) - set(CONTEXT))
        if unknown:
            raise ValueError(f"unknown context {', '.join(unknown)} for {self.name!r}; accepted: {', '.join(CONTEXT)}")
        missing = sorted(set(self.context) - set(_parameters(self.builder)))
        if missing:
            raise ValueError(f"{self.name!r} declares context {', '.join(missing)} that its builder does not take")
        option = inspect.signature(self.builder).parameters.get("per_layer")
        if option is not None and option.default is not self.per_layer:
            raise ValueError(
                f"{self.name!r} registers per_layer={self.per_layer} but its per_layer option defaults to "
                f"{option.default!r}: the registered flag is the option's default"
            )

    @property
    def acts_on(self) -> str:
        return ACTS_ON[self.kind]

    def builds_per_layer(self, options: Mapping[str, object]) -> bool:
        """Whether a host builds one instance per transformer layer: the scheme's ``per_layer`` option where
        its builder has one (LieRE: shared or per layer), else the registered flag."""
        return bool(options.get("per_layer", self.per_layer)) if "per_layer" in self.options else self.per_layer

    @property
    def options(self) -> list[str]:
        """The keyword options a user may set (the builder's parameters less the injected context)."""
        return [p for p in _parameters(self.builder) if p not in self.context]


_REGISTRY: dict[str, dict[int, SchemeInfo]] = {}


def _parameters(builder: Callable[..., nn.Module]) -> list[str]:
    params = inspect.signature(builder).parameters.values()
    return [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


def register(
    name: str,
    *,
    ndim: int,
    kind: Kind,
    trainable: bool,
    relative: bool,
    extrapolation: str,
    summary: str,
    context: tuple[str, ...] = (),
    per_layer: bool = False,
    scalable: bool = False,
    reference: str = "",
    position_axes: int = 1,
) -> Callable[[M], M]:
    """Class decorator: add the decorated ``nn.Module`` to the catalogue under ``name`` (one per ndim)."""

    def add(cls: M) -> M:
        info = SchemeInfo(
            name, ndim, kind, trainable, relative, extrapolation, summary, builder=cls, context=context,
            per_layer=per_layer, scalable=scalable, reference=reference, position_axes=position_axes,
        )  # fmt: skip
        slot = _REGISTRY.setdefault(name, {})
        if ndim in slot:
            raise ValueError(f"scheme {name!r} ({ndim}D) is already registered")
        slot[ndim] = info
        return cls

    return add


def list_encodings(ndim: int | None = None, *, kind: str | tuple[str, ...] | None = None) -> list[str]:
    """Registered scheme names, sorted; ``ndim=1`` or ``2`` keeps the sequence or image schemes,
    ``kind`` (one kind or several) keeps the schemes of that kind in that ndim (or either)."""
    if ndim not in (None, 1, 2):
        raise ValueError(f"ndim must be 1, 2 or None, got {ndim!r}")
    kinds = (kind,) if isinstance(kind, str) else kind
    return sorted(
        name
        for name, slot in _REGISTRY.items()
        if any((ndim is None or d == ndim) and (kinds is None or i.kind in kinds) for d, i in slot.items())
    )


def get_info(name: str, ndim: int | None = None) -> SchemeInfo:
    """Properties of a scheme. ``nope`` exists in 1D and 2D; pass ``ndim`` to choose (default 2)."""
    if not isinstance(name, str):
        raise TypeError(f"scheme name must be a str, got {type(name).__name__}")
    slot = _REGISTRY.get(name)
    if slot is None:
        raise ValueError(f"unknown scheme {name!r}; known: {', '.join(list_encodings())}")
    if ndim is None:
        return slot[2] if 2 in slot else next(iter(slot.values()))
    if ndim not in slot:
        names = ", ".join(list_encodings(ndim))
        raise ValueError(f"scheme {name!r} has no {ndim}D form; {ndim}D schemes: {names}")
    return slot[ndim]


def accepted_options(name: str, ndim: int | None = None) -> list[str]:
    """Every keyword ``create_encoding`` accepts for the scheme: its options and its context."""
    return _parameters(get_info(name, ndim).builder)


def create_encoding(name: str, *, ndim: int | None = None, **options: object) -> nn.Module:
    """Build a scheme's module by registry name; unknown options fail loudly with the accepted list.

    Standalone use passes the context (``dim``, ``num_heads``...) as ordinary keywords; hosts use
    ``build_in_context``, which fills it in and refuses it from the user.
    """
    info = get_info(name, ndim)
    accepted = accepted_options(name, info.ndim)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(
            f"unknown option(s) {', '.join(unknown)} for scheme {name!r}; accepted: {', '.join(accepted) or 'none'}"
        )
    module = info.builder(**options)
    module.scheme_info = info
    module.scheme_build = (name, info.ndim, dict(options))  # how it was built: ``reset_scheme`` builds it again
    if not hasattr(module, "reset_parameters"):  # what model libraries' init protocols call (timm's init_weights)
        module.reset_parameters = functools.partial(reset_scheme, module)
    return module


@torch.no_grad()
def reset_scheme(module: nn.Module) -> None:
    """Initialise a scheme module's weights as it was initialised when built (``create_encoding`` with its options;
    its own random draws): what a model library's init protocol asks of it after a meta-device build
    (``to_empty``). A weight marked as loaded (``_is_hf_initialized``, transformers' mark) is left as it is, as is one
    the module took after it was built (no counterpart of its shape in a fresh build)."""
    if getattr(module, "scheme_build", None) is None:  # built before modules kept how they were built
        return
    name, ndim, options = module.scheme_build
    fresh = create_encoding(name, ndim=ndim, **options)
    made = dict(fresh.named_parameters()) | dict(fresh.named_buffers())
    for key, tensor in [*module.named_parameters(), *module.named_buffers()]:
        new = made.get(key)
        if new is None or new.shape != tensor.shape or tensor.is_meta or getattr(tensor, "_is_hf_initialized", False):
            continue
        tensor.copy_(new)


def build_in_context(info: SchemeInfo, context: dict[str, object], options: dict[str, object]) -> nn.Module:
    """A host builds a scheme: the context it declares comes from ``context``, the rest from the user."""
    split_options([info], options)
    return create_encoding(info.name, ndim=info.ndim, **{k: context[k] for k in info.context}, **options)


def split_options(infos: list[SchemeInfo], options: dict[str, object]) -> list[dict[str, object]]:
    """Hand each scheme the user options it accepts; an option no scheme takes is an error."""
    accepted = [set(i.options) for i in infos]
    known = set().union(*accepted)
    derived = sorted((set(options) & set().union(*(i.context for i in infos))) - known)
    if derived:
        raise TypeError(
            f"option(s) {', '.join(derived)} of {', '.join(i.name for i in infos)} are set from the model, "
            f"not by hand; accepted: {', '.join(sorted(known)) or 'none'}"
        )
    unknown = sorted(set(options) - known)
    if unknown:
        names = ", ".join(i.name for i in infos) or "nope"
        listed = ", ".join(sorted(known)) or "none"
        raise TypeError(f"unknown option(s) {', '.join(unknown)} for {names}; accepted: {listed}")
    return [{k: v for k, v in options.items() if k in acc} for acc in accepted]


def describe(ndim: int | None = None) -> str:
    """The property table of every registered scheme, as Markdown."""
    rows = [
        "| name | dims | kind | acts on | trainable | relative | extrapolation | what |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in list_encodings(ndim):
        for d, info in sorted(_REGISTRY[name].items(), reverse=True):
            if ndim is not None and d != ndim:
                continue
            rows.append(
                f"| `{name}` | {d}D | {info.kind} | {info.acts_on} | {'yes' if info.trainable else 'no'} | "
                f"{'yes' if info.relative else 'no'} | {info.extrapolation} | {info.summary} |"
            )
    return "\n".join(rows)
