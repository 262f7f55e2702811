"""RoPE scaling: inverse frequencies and attention factors for inputs longer than training.

All functions are pure: ``(head dim, theta, scaling, current length) -> (inv_freq [dim/2], attention factor)``.
The formulas follow the papers and Hugging Face transformers' rope utilities:

- ``linear`` (position interpolation, Chen et al. 2023): inv_freq / s.
- ``ntk`` (NTK-aware, bloc97): base' = base * s ** (d / (d - 2)).
- ``dynamic_ntk``: base' = base * (s * L / L0 - (s - 1)) ** (d / (d - 2)), with L = max(L, L0).
- ``yarn`` (Peng et al. 2023): per-frequency ramp between interpolation and extrapolation, set by how
  many rotations a frequency makes over the original length (beta_fast, beta_slow); attention factor
  0.1 ln s + 1 multiplies cos and sin.
- ``longrope`` (Ding et al. 2024): inv_freq / lambda_i with given per-frequency factors (a short set for
  lengths within the original, a long set beyond); attention factor sqrt(1 + ln s / ln L0).

``s`` is ``factor`` when given, else derived from the current length: max(1, L / L0) (for ``dynamic_ntk``
s = 1, since its formula already grows with L).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from .._validate import check_choice, check_float, check_int

SCALING_TYPES: tuple[str, ...] = ("linear", "ntk", "dynamic_ntk", "yarn", "longrope")


def rope_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """Plain RoPE inverse frequencies theta ** (-2i / dim), i < dim / 2, fp32. Shape [dim // 2]."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)).float()


@dataclass(frozen=True)
class RopeScaling:
    """How to stretch RoPE beyond its training length; validated on construction."""

    type: str
    factor: float | None = None  # None: max(1, length / original_length), recomputed for each length
    original_length: int | None = None  # training length (tokens per axis for 2D grids)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # override the method's default temperature
    long_factors: tuple[float, ...] | None = None
    short_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        check_choice("RoPE scaling type", self.type, SCALING_TYPES)
        if self.factor is not None:
            if check_float("scaling factor", self.factor) < 1.0:
                raise ValueError(f"scaling factor must be >= 1 (1 = no scaling), got {self.factor}")
        if self.original_length is not None:
            check_int("original_length", self.original_length, minimum=1)
        needs_length = self.type in ("yarn", "longrope", "dynamic_ntk") or self.factor is None
        if needs_length and self.original_length is None:
            why = f"{self.type!r} scaling" if self.type != "linear" and self.type != "ntk" else "factor=None"
            raise ValueError(f"{why} needs original_length (the training length)")
        check_float("beta_fast", self.beta_fast, positive=True)
        check_float("beta_slow", self.beta_slow, positive=True)
        if self.beta_fast <= self.beta_slow:
            raise ValueError(f"beta_fast must exceed beta_slow, got {self.beta_fast} <= {self.beta_slow}")
        if self.attention_factor is not None:
            check_float("attention_factor", self.attention_factor, positive=True)
        if self.type == "longrope":
            if self.long_factors is None:
                raise ValueError("'longrope' scaling needs long_factors (one per rotary frequency, dim / 2)")
            for name in ("long_factors", "short_factors"):
                values = getattr(self, name)
                if values is not None:
                    object.__setattr__(self, name, tuple(check_float(name, v, positive=True) for v in values))
        elif self.long_factors is not None or self.short_factors is not None:
            raise ValueError("long_factors / short_factors are options of 'longrope' scaling only")

    def resolve_factor(self, length: int) -> float:
        if self.factor is not None:
            return self.factor
        return max(1.0, length / self.original_length)  # type: ignore[operator]


def as_scaling(
    scaling: RopeScaling | str | dict | None, *, original_length: int | None = None, **options: object
) -> RopeScaling | None:
    """The one way to read a scaling setting: a ``RopeScaling``, a type name with its fields as keyword
    options, or a dict of fields (as from a YAML config). ``original_length`` is the training length to
    use when the setting gives none."""
    if scaling is None:
        if options:
            raise ValueError(f"scaling options {sorted(options)} given without scaling=; accepted: {SCALING_TYPES}")
        return None
    if isinstance(scaling, RopeScaling):
        if options:
            raise ValueError(f"scaling options {sorted(options)} given beside a RopeScaling; set them inside it")
        if scaling.original_length is None and original_length is not None:
            return replace(scaling, original_length=original_length)
        return scaling
    if isinstance(scaling, str):
        scaling = {"type": scaling}
    if not isinstance(scaling, dict):
        raise TypeError(f"scaling must be None, a type name, a dict or RopeScaling; got {type(scaling).__name__}")
    accepted = [f.name for f in fields(RopeScaling)]
    merged = {**scaling, **options}
    unknown = sorted(map(str, set(merged) - set(accepted)))
    if unknown:
        raise TypeError(f"unknown RoPE scaling option(s) {', '.join(unknown)}; accepted: {', '.join(accepted)}")
    for key in ("long_factors", "short_factors"):
        if isinstance(merged.get(key), Sequence):
            merged[key] = tuple(merged[key])
    if merged.get("original_length") is None and original_length is not None:
        merged["original_length"] = original_length
    return RopeScaling(**merged)


def _yarn_correction_dim(rotations: float, dim: int, theta: float, original_length: int) -> float:
    """The (fractional) frequency index that completes ``rotations`` turns over ``original_length``."""
    return dim * math.log(original_length / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_ramp(dim: int, theta: float, original_length: int, beta_fast: float, beta_slow: float) -> torch.Tensor:
    """YaRN's extrapolation weight per frequency, [dim // 2]: 1 keeps the frequency, 0 interpolates it."""
    low = max(math.floor(_yarn_correction_dim(beta_fast, dim, theta, original_length)), 0)
    high = min(math.ceil(_yarn_correction_dim(beta_slow, dim, theta, original_length)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return 1.0 - ramp


def check_scaling_dim(scaling: RopeScaling | None, dim: int) -> None:
    """LongRoPE's factor lists need one entry per rotary frequency of a ``dim``-channel rotation."""
    if scaling is None or scaling.type != "longrope":
        return
    for name in ("long_factors", "short_factors"):
        factors = getattr(scaling, name)
        if factors is not None and len(factors) != dim // 2:
            raise ValueError(
                f"longrope {name} must have one entry per rotary frequency (dim / 2 = {dim // 2}), got {len(factors)}"
            )


def scaled_inv_freq(dim: int, theta: float, scaling: RopeScaling | None, length: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim // 2] and the attention factor for a sequence of ``length`` tokens."""
    if scaling is None:
        return rope_inv_freq(dim, theta), 1.0
    s = scaling.resolve_factor(length)
    kind = scaling.type
    attention = 1.0
    if kind == "linear":
        inv_freq = rope_inv_freq(dim, theta) / s
    elif kind == "ntk":
        inv_freq = rope_inv_freq(dim, theta * s ** (dim / (dim - 2)))
    elif kind == "dynamic_ntk":
        a = scaling.factor if scaling.factor is not None else 1.0  # L / L0 below already follows the length
        grown = max(length, scaling.original_length) / scaling.original_length  # type: ignore[operator]
        inv_freq = rope_inv_freq(dim, theta * (a * grown - (a - 1)) ** (dim / (dim - 2)))
    elif kind == "yarn":
        base = rope_inv_freq(dim, theta)
        keep = yarn_ramp(dim, theta, scaling.original_length, scaling.beta_fast, scaling.beta_slow)  # type: ignore[arg-type]
        inv_freq = base / s * (1 - keep) + base * keep
        attention = 0.1 * math.log(s) + 1.0 if s > 1 else 1.0
    else:  # longrope
        check_scaling_dim(scaling, dim)
        use_long = length > scaling.original_length or scaling.short_factors is None  # type: ignore[operator]
        factors = scaling.long_factors if use_long else scaling.short_factors
        inv_freq = rope_inv_freq(dim, theta) / torch.tensor(factors, dtype=torch.float32)
        if s > 1:
            attention = math.sqrt(1 + math.log(s) / math.log(scaling.original_length))  # type: ignore[arg-type]
    if scaling.attention_factor is not None:
        attention = scaling.attention_factor
    return inv_freq, attention
