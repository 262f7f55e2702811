"""RoPE scaling: inverse frequencies and attention factors for inputs longer than training.

All functions are pure: ``(head dim, theta, scaling, current length) -> (inv_freq [dim/2], attention factor)``.
The formulas follow the papers and Hugging Face transformers' rope utilities:

- ``linear`` (position interpolation, Chen et al. 2023): inv_freq / s.
- ``ntk`` (NTK-aware, bloc97): base' = base * s ** (d / (d - 2)).
- ``dynamic_ntk``: base' = base * (s * L / L0 - (s - 1)) ** (d / (d - 2)), with L = max(L, L0).
- ``yarn`` (Peng et al. 2023): per-frequency ramp between interpolation and extrapolation, set by how
  many rotations a frequency makes over the original length (beta_fast, beta_slow; the ramp's ends
  rounded to whole pairs unless ``truncate=False``, as in gpt-oss); attention factor m(s) = 0.1 ln s + 1
  multiplies cos and sin, or m(s, mscale) / m(s, mscale_all_dim) with m(s, a) = 0.1 a ln s + 1 when
  both are given (DeepSeek-V2/V3).
- ``longrope`` (Ding et al. 2024): inv_freq / lambda_i with given per-frequency factors (a short set for
  lengths within the original, a long set beyond); attention factor sqrt(1 + ln s / ln L0), or the given
  ``long_mscale`` beyond the original length and ``short_mscale`` within it (Phi-3.5-MoE).
- ``llama3`` (Llama 3.1): frequencies whose wavelength 2 pi / f exceeds L0 / low_freq_factor are
  interpolated (f / s), those below L0 / high_freq_factor kept, a smooth blend in between; no attention
  factor.

``s`` is ``factor`` when given, else derived from the current length: max(1, L / L0) (for ``dynamic_ntk``
s = 1, since its formula already grows with L). Shipped models fix it: Phi-3's LongRoPE uses
s = max_position_embeddings / original_max_position_embeddings, which ``RopeScaling.from_config`` reads.

The setting itself (``RopeScaling``, ``as_scaling``: which type, with which fields) is
``rope_scaling_setting``; its public names are importable from here too.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .rope_scaling_setting import (
    SCALING_TYPES,
    TYPE_OPTIONS,
    RopeScaling,
    as_scaling,
    canonical_scaling,
    fold_scaling_fields,
)

__all__ = [
    "SCALING_TYPES",
    "TYPE_OPTIONS",
    "RopeScaling",
    "as_scaling",
    "canonical_scaling",
    "check_scaling_dim",
    "fold_scaling_fields",
    "llama3_blend",
    "rope_inv_freq",
    "scaled_inv_freq",
    "yarn_mscale",
    "yarn_ramp",
]


def rope_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """Plain RoPE inverse frequencies theta ** (-2i / dim), i < dim / 2, fp32. Shape [dim // 2].

    Made on the host, in float64, as every scaling formula built on it: a function of the settings alone, the
    same on every device (MPS has no float64); callers copy the [dim / 2] result to the device, and nothing is
    read back from it (``tests/fake_cuda.py`` lists it as the one host constant of a forward)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)).float()


def _yarn_correction_dim(rotations: float, dim: int, theta: float, original_length: float) -> float:
    """The (fractional) frequency index that completes ``rotations`` turns over ``original_length``."""
    return dim * math.log(original_length / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_ramp(
    dim: int, theta: float, original_length: float, beta_fast: float, beta_slow: float, *, truncate: bool = True
) -> torch.Tensor:
    """YaRN's extrapolation weight per frequency, [dim // 2]: 1 keeps the frequency, 0 interpolates it.

    The ramp runs between the pairs that turn ``beta_fast`` and ``beta_slow`` times over the original
    length, floored / ceiled to whole pairs when ``truncate`` (gpt-oss keeps them fractional)."""
    low = _yarn_correction_dim(beta_fast, dim, theta, original_length)
    high = _yarn_correction_dim(beta_slow, dim, theta, original_length)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return 1.0 - ramp


def yarn_mscale(s: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature m(s, a) = 0.1 a ln s + 1 (1 when s <= 1)."""
    return 0.1 * mscale * math.log(s) + 1.0 if s > 1 else 1.0


def llama3_blend(
    dim: int, theta: float, original_length: float, low_freq_factor: float, high_freq_factor: float
) -> torch.Tensor:
    """Llama 3.1's weight of the unscaled frequency per pair, [dim // 2]: 1 for wavelengths 2 pi / f below
    L0 / high_freq_factor, 0 above L0 / low_freq_factor, (L0 / wavelength - low) / (high - low) between."""
    wavelength = 2 * math.pi / rope_inv_freq(dim, theta)
    return ((original_length / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0, 1)


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


# --- one function per type: (dim, theta, scaling, factor s, length, span) -> (inv_freq [dim // 2], attention factor);
# ``span``: the angle (radians) the training length turns at inverse frequency 1, where YaRN and Llama 3 count
# rotations (``original_length`` for integer positions; ``scaled_inv_freq``)
Method = Callable[[int, float, RopeScaling, float, int, float], tuple[torch.Tensor, float]]


def _linear(dim: int, theta: float, sc: RopeScaling, s: float, length: int, span: float) -> tuple[torch.Tensor, float]:
    return rope_inv_freq(dim, theta) / s, 1.0


def _ntk(dim: int, theta: float, sc: RopeScaling, s: float, length: int, span: float) -> tuple[torch.Tensor, float]:
    return rope_inv_freq(dim, theta * s ** (dim / (dim - 2))), 1.0


def _dynamic_ntk(
    dim: int, theta: float, sc: RopeScaling, s: float, length: int, span: float
) -> tuple[torch.Tensor, float]:
    a = sc.factor if sc.factor is not None else 1.0  # L / L0 below already follows the length
    grown = max(length, sc.original_length) / sc.original_length  # type: ignore[operator]
    return rope_inv_freq(dim, theta * (a * grown - (a - 1)) ** (dim / (dim - 2))), 1.0


def _yarn(dim: int, theta: float, sc: RopeScaling, s: float, length: int, span: float) -> tuple[torch.Tensor, float]:
    base = rope_inv_freq(dim, theta)
    keep = yarn_ramp(dim, theta, span, sc.beta_fast, sc.beta_slow, truncate=sc.truncate)  # type: ignore[arg-type]
    if sc.mscale is None:
        attention = yarn_mscale(s)
    else:
        attention = yarn_mscale(s, sc.mscale) / yarn_mscale(s, sc.mscale_all_dim)  # type: ignore[arg-type]
    return base / s * (1 - keep) + base * keep, attention


def _longrope(
    dim: int, theta: float, sc: RopeScaling, s: float, length: int, span: float
) -> tuple[torch.Tensor, float]:
    check_scaling_dim(sc, dim)
    use_long = length > sc.original_length or sc.short_factors is None  # type: ignore[operator]
    factors = sc.long_factors if use_long else sc.short_factors
    if sc.long_mscale is not None:  # Phi-3.5-MoE: the attention factor is given, beyond / within the original length
        attention = sc.long_mscale if length > sc.original_length else sc.short_mscale  # type: ignore[operator]
    else:
        attention = math.sqrt(1 + math.log(s) / math.log(sc.original_length)) if s > 1 else 1.0  # type: ignore[arg-type]
    return rope_inv_freq(dim, theta) / torch.tensor(factors, dtype=torch.float32), attention


def _llama3(dim: int, theta: float, sc: RopeScaling, s: float, length: int, span: float) -> tuple[torch.Tensor, float]:
    base = rope_inv_freq(dim, theta)
    keep = llama3_blend(dim, theta, span, sc.low_freq_factor, sc.high_freq_factor)  # type: ignore[arg-type]
    return base / s * (1 - keep) + base * keep, 1.0


METHODS: dict[str, Method] = {
    "linear": _linear, "ntk": _ntk, "dynamic_ntk": _dynamic_ntk, "yarn": _yarn, "longrope": _longrope,
    "llama3": _llama3,
}  # fmt: skip


def scaled_inv_freq(
    dim: int, theta: float, scaling: RopeScaling | None, length: int, *, span: float | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim // 2] and the attention factor for a sequence of ``length`` tokens.

    ``span``: the coordinate extent of the training length, where YaRN and Llama 3 count each frequency's
    rotations (a pair turns span x inv_freq radians over it); None: ``original_length``, the span of
    integer positions. Coordinates on another scale (DINOv3's 2 pi x normalized coordinates, 4 pi over any
    training grid) give theirs, so the ramp keeps the pairs that turn often over the training image."""
    if scaling is None:
        return rope_inv_freq(dim, theta), 1.0
    span = float(scaling.original_length) if span is None and scaling.original_length is not None else span
    factor = scaling.resolve_factor(length)
    inv_freq, attention = METHODS[scaling.type](dim, theta, scaling, factor, length, span)  # type: ignore[arg-type]
    if scaling.attention_factor is not None:
        attention = scaling.attention_factor
    return inv_freq, attention
