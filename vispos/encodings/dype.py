"""Per-axis RoPE scaling as tensor maths, and its timestep-aware schedule for diffusion (DyPE).

A diffusion transformer's grid size and denoising timestep arrive as tensors, so the scaling factor of each axis,
s = max(1, L / L0) (L: the axis's extent now, L0: at training), is one too: nothing here reads a tensor back into
Python, so a compiled model is neither split nor recompiled across sizes and timesteps. The formulas are those of
``rope_scaling`` (whose ``yarn_ramp`` this module uses) for a tensor s; ``axis_inv_freq`` returns inverse frequencies
in s's dtype and the attention factor that multiplies cos and sin. That dtype is ``angle_dtype``'s, diffusers' device
rule: float64 (diffusers' FLUX builds its angles in float64), float32 on MPS and NPU, which have no float64.

- ``linear``: base / s. ``ntk``: theta' = theta s ** (d / (d - 2)). ``yarn``: YaRN's ramp between the pairs
  turning ``beta_fast`` and ``beta_slow`` times over L0 (``rope_scaling.yarn_ramp``), attention factor 0.1 ln s + 1.
- ``schedule`` (``TimestepSchedule``, DyPE: Issachar et al. 2025, "DyPE: Dynamic Position Extrapolation for
  Ultra High Resolution Diffusion", arXiv 2510.20766, and the authors' released code): the strength follows the
  noise level sigma in [0, 1] (1: pure noise) through kappa(sigma) = sigma ** exponent (lambda_t = 2). Early,
  noisy steps settle the low frequencies of the image and take the full scaling; the late steps, which add the
  high frequencies, approach the model's own RoPE.

  - ``ntk``: theta' = theta (s ** (d / (d - 2))) ** (ntk_scale kappa) (the released code: ntk_scale = 2).
  - ``yarn``: the released code's three bands: pairs turning more than beta_0 kappa times over L0 (beta_0 = 1.25)
    take NTK frequencies, fewer than beta_1 kappa (0.75) linear ones, a ramp between; then pairs turning more
    than gamma_0 kappa (16) keep the model's own frequencies, fewer than gamma_1 kappa (2) keep the first blend, a
    ramp between. Attention factor 0.1 ln s + 1 at every step. Ramp ends as ``yarn_ramp`` takes them (floor /
    ceil to whole pairs), both clamped into [0, d / 2], so that as kappa falls to 0 every pair returns to the
    model's frequency, as the paper states. Here vispos departs from the released code, which clamps only the upper
    end: once a band's lower end passes d / 2 (for FLUX's axes of 56, theta 1e4 and 64 training patches, below sigma
    of about 0.03 for the first band and 0.008 for the second) its ramp runs backwards and gives the linear
    frequencies, and at kappa = 0 it divides by zero.
  - ``linear``: the paper and the code define no schedule for it: refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .._validate import check_float
from .rope_scaling import RopeScaling, yarn_ramp

SCHEDULES: tuple[str, ...] = ("dype",)
SCHEDULED_TYPES: tuple[str, ...] = ("ntk", "yarn")  # scalings DyPE defines a schedule for
TENSOR_TYPES: tuple[str, ...] = ("linear", "ntk", "yarn")  # scalings computed here (a tensor factor)


@dataclass(frozen=True)
class TimestepSchedule:
    """DyPE's schedule, defaults from the authors' released code: kappa(sigma) = sigma ** ``exponent``; NTK's
    exponent multiplied by ``ntk_scale`` kappa; YaRN's band edges ``beta`` and ``gamma`` (rotations over the
    training length) multiplied by kappa. ``exponent=0`` holds kappa at 1 at every step: with ``yarn`` the DyPE
    paper's YaRN baseline (its three bands at kappa = 1, which ``scaling="yarn"`` alone, YaRN's own single ramp,
    does not give)."""

    type: str = "dype"
    exponent: float = 2.0
    ntk_scale: float = 2.0
    beta: tuple[float, float] = (1.25, 0.75)
    gamma: tuple[float, float] = (16.0, 2.0)

    def __post_init__(self) -> None:
        if self.type not in SCHEDULES:
            raise ValueError(f"unknown timestep schedule {self.type!r}; accepted: {', '.join(SCHEDULES)}")
        check_float("exponent", self.exponent, minimum=0.0)  # 0: kappa = 1 at every step (the paper's baselines)
        check_float("ntk_scale", self.ntk_scale, positive=True)
        for name in ("beta", "gamma"):
            pair = tuple(float(v) for v in getattr(self, name))
            if len(pair) != 2 or not pair[0] > pair[1] > 0:
                raise ValueError(f"{name} must be two rotation counts, the first larger, both > 0; got {pair}")
            object.__setattr__(self, name, pair)


def as_schedule(schedule: TimestepSchedule | str | dict[str, Any] | None) -> TimestepSchedule | None:
    """A schedule from its name (``"dype"``), a dict of its fields, or itself; None: no schedule."""
    if schedule is None or isinstance(schedule, TimestepSchedule):
        return schedule
    if isinstance(schedule, str):
        return TimestepSchedule(type=schedule)
    if isinstance(schedule, dict):
        fields = set(TimestepSchedule.__dataclass_fields__)
        unknown = sorted(set(schedule) - fields)
        if unknown:
            raise TypeError(f"unknown timestep schedule option(s) {', '.join(unknown)}; accepted: {', '.join(fields)}")
        return TimestepSchedule(**schedule)
    raise TypeError(f"schedule must be None, 'dype', a dict or a TimestepSchedule; got {type(schedule).__name__}")


FLOAT32_DEVICES: tuple[str, ...] = ("mps", "npu")  # no float64 there: diffusers computes its angles in float32


def angle_dtype(device: torch.device | str | None) -> torch.dtype:
    """The dtype angles are computed in on ``device``: float64, float32 on MPS and NPU (diffusers' rule)."""
    kind = "cpu" if device is None else device.split(":")[0] if isinstance(device, str) else device.type
    return torch.float32 if kind in FLOAT32_DEVICES else torch.float64


def kappa(sigma: torch.Tensor, exponent: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """DyPE's strength at noise level ``sigma`` (1: pure noise, 0: clean): sigma ** exponent, sigma within [0, 1]."""
    return sigma.to(dtype).clamp(0.0, 1.0) ** exponent


def base_inv_freq(dim: int, theta: float, device: torch.device | None = None,
                  dtype: torch.dtype = torch.float64) -> torch.Tensor:  # fmt: skip
    """theta ** (-2i / dim), i < dim / 2, in ``dtype``."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=dtype, device=device) / dim)


def correction_dim(rotations: torch.Tensor, dim: int, theta: float, original_length: float) -> torch.Tensor:
    """The fractional pair index that turns ``rotations`` times over ``original_length`` (YaRN's formula, for a
    tensor of rotations; +inf at zero rotations)."""
    return dim * torch.log(original_length / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def band(dim: int, theta: float, original_length: float, fast: torch.Tensor, slow: torch.Tensor) -> torch.Tensor:
    """Weight of the faster frequencies per pair, [dim // 2]: 1 for pairs turning more than ``fast`` times over the
    original length, 0 below ``slow``, a ramp between (ends floored / ceiled to whole pairs, within [0, dim / 2])."""
    half = dim // 2
    low = torch.floor(correction_dim(fast, dim, theta, original_length)).clamp(0, half)
    high = torch.ceil(correction_dim(slow, dim, theta, original_length)).clamp(0, half)
    high = torch.where(high == low, high + 0.001, high)
    pairs = torch.arange(half, dtype=fast.dtype, device=fast.device)
    return 1.0 - ((pairs - low) / (high - low)).clamp(0, 1)


def _ntk(base: torch.Tensor, dim: int, s: torch.Tensor, power: torch.Tensor | float) -> torch.Tensor:
    """theta' = theta s ** (power d / (d - 2)): base frequencies times s ** (-power d / (d - 2) 2i / d)."""
    exponents = torch.arange(0, dim, 2, dtype=base.dtype, device=base.device) / dim
    return base * s ** (-(dim / (dim - 2)) * power * exponents)


def _yarn_factor(scaling: RopeScaling, s: torch.Tensor) -> torch.Tensor:
    if scaling.mscale is None:
        return 0.1 * torch.log(s) + 1.0
    return (0.1 * scaling.mscale * torch.log(s) + 1.0) / (0.1 * scaling.mscale_all_dim * torch.log(s) + 1.0)


def axis_inv_freq(
    dim: int,
    theta: float,
    scaling: RopeScaling | None,
    s: torch.Tensor,
    *,
    schedule: TimestepSchedule | None = None,
    sigma: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One axis's inverse frequencies [dim // 2] and attention factor (0-dim) at factor ``s`` (a tensor: max(1,
    L / L0), or the scaling's fixed ``factor``), with ``schedule`` at noise level ``sigma``, in ``angle_dtype`` of s's
    device. ``scaling.original_length`` is L0, where YaRN counts rotations."""
    dtype = angle_dtype(s.device)
    base = base_inv_freq(dim, theta, s.device, dtype)
    one = torch.ones((), dtype=dtype, device=s.device)
    if scaling is None:
        return base, one
    s = (s.to(dtype) if scaling.factor is None else torch.full((), float(scaling.factor), dtype=dtype,
                                                               device=s.device)).clamp(min=1.0)  # fmt: skip
    k = None if schedule is None else kappa(sigma, schedule.exponent, dtype)  # type: ignore[arg-type]
    if scaling.type == "linear":
        inv, factor = base / s, one
    elif scaling.type == "ntk":
        inv, factor = _ntk(base, dim, s, 1.0 if k is None else schedule.ntk_scale * k), one  # type: ignore[union-attr]
    elif k is None:  # yarn, static
        keep = yarn_ramp(dim, theta, scaling.original_length, scaling.beta_fast, scaling.beta_slow,  # type: ignore[arg-type]
                         truncate=scaling.truncate).to(base)  # fmt: skip
        inv, factor = base / s * (1 - keep) + base * keep, _yarn_factor(scaling, s)
    else:  # yarn under DyPE: the released code's three bands
        length = float(scaling.original_length)  # type: ignore[arg-type]
        (b0, b1), (g0, g1) = schedule.beta, schedule.gamma  # type: ignore[union-attr]
        ntk = band(dim, theta, length, b0 * k, b1 * k)
        inv = base / s * (1 - ntk) + _ntk(base, dim, s, 1.0) * ntk
        keep = band(dim, theta, length, g0 * k, g1 * k)
        inv, factor = inv * (1 - keep) + base * keep, 0.1 * torch.log(s) + 1.0
    if scaling.attention_factor is not None:
        factor = torch.full((), float(scaling.attention_factor), dtype=dtype, device=s.device)
    return inv, factor
