"""Scheme entries, the rows of a comparison, and the run config that lists them: shared by the image
trainer (``train.config.sections``) and the sequence benchmark (``benchmarks.seq1d.config``).

An entry either trains a positional scheme (``pos``) or re-evaluates the trained model of another entry
(``base``) with evaluation-only settings, e.g. RoPE scaling::

    - {name: rope2d, pos: rope2d}
    - {name: rope2d+yarn, base: rope2d, scaling: yarn}
    - {name: rope+ntk4, base: rope, scaling: ntk, scaling_options: {factor: 4.0}}

A plain string is documented shorthand for these mappings: ``rope2d`` trains ``rope2d``, and trailing
``+word`` parts that name an evaluation setting make an evaluation-only entry of the rest:
``rope2d+yarn`` is ``{name: rope2d+yarn, base: rope2d, scaling: yarn}``. The words are the RoPE scaling
names (``vispos.SCALING_TYPES``) and each tool's own (the trainer's ``logn``, the benchmark's
``learned1d`` out-of-range rules).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import vispos

from .schema import ConfigError


@dataclass
class SchemeEntry:
    """What every tool's scheme entry has; each tool subclasses it with its own ``pos`` type and extras."""

    name: str
    pos: Any = None  # what the entry trains: a registry name (or names); typed by each tool's subclass
    options: dict[str, Any] = field(default_factory=dict)  # forwarded to the scheme
    base: str | None = None  # evaluation-only: reuse the trained model of this entry
    scaling: str | None = None  # RoPE scaling at evaluation, one of vispos.SCALING_TYPES
    scaling_options: dict[str, Any] = field(default_factory=dict)  # vispos.RopeScaling fields, e.g. factor
    drope: float = 0.0  # DroPE: positions switched off for this final fraction of training

    @property
    def trains(self) -> bool:
        return self.base is None


@dataclass
class RunConfig:
    """What every tool's top-level config starts with; subclasses narrow ``schemes`` to their entry type."""

    name: str
    schemes: list[SchemeEntry]
    seed: int = 0
    out_dir: str | None = None  # default runs/<name>
    device: Literal["auto", "cpu", "cuda"] = "auto"
    progress: bool = True  # progress output (bars only when stderr is a terminal)

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) if self.out_dir else Path("runs") / self.name

    def scheme(self, name: str) -> Any:
        """The entry named ``name`` (of the subclass's entry type)."""
        for s in self.schemes:
            if s.name == name:
                return s
        raise ConfigError(f"no scheme named {name!r}; schemes: {', '.join(s.name for s in self.schemes)}")


def expand_shorthand(text: str, where: str, words: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The mapping a shorthand string stands for. ``words`` maps each tool-specific suffix to the fields
    it sets (the RoPE scaling names are always suffixes); the remaining parts are returned joined by
    '+' as ``pos`` (nothing peeled) or as ``base``."""
    parts = [p.strip() for p in text.split("+")]
    suffixes = [*vispos.SCALING_TYPES, *words]
    if not all(parts):
        raise ConfigError(f"{where}: bad scheme {text!r}; write 'name' or 'name+{'|'.join(suffixes)}'")
    fields: dict[str, Any] = {}
    while len(parts) > 1 and parts[-1] in suffixes:
        word = parts.pop()
        update = {"scaling": word} if word in vispos.SCALING_TYPES else dict(words[word])
        clash = sorted(k for k in update if k in fields)
        if clash:
            raise ConfigError(f"{where}: {text!r} sets {', '.join(clash)} twice; give one of each")
        fields.update(update)
    rest = "+".join(parts)
    return {"name": text, "pos": rest} if not fields else {"name": text, "base": rest, **fields}


def check_entries(entries: Sequence[SchemeEntry]) -> dict[str, SchemeEntry]:
    """The checks every tool makes on its entries; returns the trained entries by name."""
    if not entries:
        raise ConfigError("schemes: list at least one scheme")
    names = [s.name for s in entries]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"schemes: names must be unique; repeated: {', '.join(repeated)}")
    trained = {s.name: s for s in entries if s.trains}
    for s in entries:
        where = f"schemes[{s.name}]"
        if s.trains and not s.pos:
            raise ConfigError(f"{where}: give pos (a registry name) or base (a trained scheme)")
        if not s.trains:
            if s.base not in trained:
                raise ConfigError(
                    f"{where}: base {s.base!r} is not a trained scheme of this config; trained: {', '.join(trained)}"
                )
            if s.pos or s.options or s.drope:
                raise ConfigError(f"{where}: an evaluation-only entry (base) takes no pos, options or drope")
        if not 0.0 <= s.drope < 1.0:
            raise ConfigError(f"{where}: drope is a fraction of training in [0, 1), got {s.drope}")
        if s.scaling is not None and s.scaling not in vispos.SCALING_TYPES:
            raise ConfigError(f"{where}: scaling {s.scaling!r} is not accepted; accepted: "
                              f"{', '.join(vispos.SCALING_TYPES)}")
        if s.scaling_options and s.scaling is None:
            raise ConfigError(f"{where}: scaling_options given without scaling ({', '.join(vispos.SCALING_TYPES)})")
    return trained


def check_scaling(entry: SchemeEntry, *, original_length: int, **defaults: Any) -> None:
    """Build the entry's ``vispos.RopeScaling`` once, so that a bad option fails when the config loads.

    ``defaults`` fill fields that are only known later (e.g. LongRoPE factors found by a search).
    """
    if entry.scaling is None:
        return
    trial = {"original_length": original_length, **defaults, "type": entry.scaling, **entry.scaling_options}
    try:
        vispos.RopeScaling(**trial)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"schemes[{entry.name}]: scaling: {e}") from None
