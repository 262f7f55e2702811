"""Scheme registry: name -> builder, with each scheme's properties as data.

``describe()`` and the parametrised tests both read this table, so adding a scheme is one file and
one ``register`` call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

Kind = Literal["additive", "rotary", "bias", "relative_kv", "none"]
KINDS: tuple[str, ...] = ("additive", "rotary", "bias", "relative_kv", "none")


@dataclass(frozen=True)
class SchemeInfo:
    """What a scheme is, as data (the seed survey's property table, per scheme)."""

    name: str
    ndim: int  # 1: token sequences, 2: patch grids
    kind: Kind  # how it enters attention; patch() and Attention dispatch on this
    acts_on: str  # human-readable: "embedding", "q, k", "attention logits", ...
    trainable: bool
    relative: bool  # logits between tokens depend only on their offset
    extrapolation: str  # what happens beyond the training length / grid
    summary: str
    builder: Callable[..., nn.Module] = field(repr=False, compare=False)
    per_layer: bool = False  # trainable attention schemes get one instance per transformer layer
    reference: str = ""


_REGISTRY: dict[str, dict[int, SchemeInfo]] = {}


def register(info: SchemeInfo) -> SchemeInfo:
    if info.kind not in KINDS:
        raise ValueError(f"unknown kind {info.kind!r}; accepted: {', '.join(KINDS)}")
    slot = _REGISTRY.setdefault(info.name, {})
    if info.ndim in slot:
        raise ValueError(f"scheme {info.name!r} ({info.ndim}D) is already registered")
    slot[info.ndim] = info
    return info


def _ensure_loaded() -> None:
    from . import encodings  # noqa: F401  (registers every scheme on import)


def list_encodings(ndim: int | None = None) -> list[str]:
    """Registered scheme names, sorted; ``ndim=1`` or ``2`` keeps the sequence or image schemes."""
    _ensure_loaded()
    if ndim not in (None, 1, 2):
        raise ValueError(f"ndim must be 1, 2 or None, got {ndim!r}")
    return sorted(n for n, slot in _REGISTRY.items() if ndim is None or ndim in slot)


def get_info(name: str, ndim: int | None = None) -> SchemeInfo:
    """Properties of a scheme. ``nope`` exists in 1D and 2D; pass ``ndim`` to choose (default 2)."""
    _ensure_loaded()
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
    params = inspect.signature(get_info(name, ndim).builder).parameters.values()
    return [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


def create_encoding(name: str, *, ndim: int | None = None, **options: object) -> nn.Module:
    """Build a scheme's module by registry name; unknown options fail loudly with the accepted list."""
    info = get_info(name, ndim)
    accepted = accepted_options(name, info.ndim)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(
            f"unknown option(s) {', '.join(unknown)} for scheme {name!r}; accepted: {', '.join(accepted) or 'none'}"
        )
    module = info.builder(**options)
    module.scheme_info = info
    return module


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
