"""The RoPE scaling formulas of the papers (ANCHORS.md), written out in plain Python: the references the
test_rope_scaling_* files compare vispos against, with the head dim, base and training length they use."""

from __future__ import annotations

import math

import pytest
import torch

from vispos.encodings.rope_scaling import RopeScaling

D, BASE, L0 = 64, 10000.0, 2048


def plain(d: int, base: float) -> list[float]:
    """inv_freq_i = base^(-2i/d), i < d/2."""
    return [base ** (-2 * i / d) for i in range(d // 2)]


def yarn_reference(
    d: int, base: float, s: float, l0: int, beta_fast: float = 32, beta_slow: float = 1, truncate: bool = True
) -> list[float]:
    """YaRN: frequencies that turn more than beta_fast times over l0 are kept, fewer than beta_slow interpolated
    (divided by s), a linear ramp between; the correction dims are floored / ceiled as in transformers, or
    left fractional with truncate=False (gpt-oss)."""

    def correction_dim(rotations: float) -> float:
        return d * math.log(l0 / (2 * math.pi * rotations)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    out = []
    for i, f in enumerate(plain(d, base)):
        interpolate = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f / s * interpolate + f * (1 - interpolate))
    return out


def llama3_reference(d: int, base: float, s: float, l0: int, low: float = 1.0, high: float = 4.0) -> list[float]:
    """Llama 3.1: wavelength 2 pi / f below l0 / high: kept; above l0 / low: f / s; between: a blend with
    weight (l0 / wavelength - low) / (high - low) on the kept frequency."""
    out = []
    for f in plain(d, base):
        wavelength = 2 * math.pi / f
        if wavelength < l0 / high:
            out.append(f)
        elif wavelength > l0 / low:
            out.append(f / s)
        else:
            smooth = (l0 / wavelength - low) / (high - low)
            out.append((1 - smooth) * f / s + smooth * f)
    return out


def deepseek_attention(s: float, mscale: float, mscale_all_dim: float) -> float:
    """YaRN's attention factor with DeepSeek's pair: get_mscale(s, mscale) / get_mscale(s, mscale_all_dim)."""

    def get_mscale(scale: float, m: float) -> float:
        return 0.1 * m * math.log(scale) + 1.0 if scale > 1 else 1.0

    return get_mscale(s, mscale) / get_mscale(s, mscale_all_dim)


def reference(kind: str, s: float, length: int, factors: list[float] | None = None) -> tuple[list[float], float]:
    if kind == "linear":
        return [f / s for f in plain(D, BASE)], 1.0
    if kind == "ntk":
        return plain(D, BASE * s ** (D / (D - 2))), 1.0
    if kind == "dynamic_ntk":
        grown = max(length, L0) / L0
        return plain(D, BASE * (s * grown - (s - 1)) ** (D / (D - 2))), 1.0
    if kind == "yarn":
        return yarn_reference(D, BASE, s, L0), (0.1 * math.log(s) + 1 if s > 1 else 1.0)
    if kind == "llama3":
        return llama3_reference(D, BASE, s, L0), 1.0
    attention = math.sqrt(1 + math.log(s) / math.log(L0)) if s > 1 else 1.0
    return [f / lam for f, lam in zip(plain(D, BASE), factors, strict=True)], attention


LONG = [1.0 + 0.25 * i for i in range(D // 2)]
SHORT = [1.0 + 0.01 * i for i in range(D // 2)]


def scaling(kind: str, factor: float | None) -> RopeScaling:
    extra = {"long_factors": tuple(LONG), "short_factors": tuple(SHORT)} if kind == "longrope" else {}
    return RopeScaling(kind, factor=factor, original_length=L0, **extra)


def assert_freqs(got: tuple[torch.Tensor, float], expected: tuple[list[float], float]) -> None:
    torch.testing.assert_close(got[0].double(), torch.tensor(expected[0], dtype=torch.float64), rtol=1e-5, atol=0)
    assert got[1] == pytest.approx(expected[1], rel=1e-9)
