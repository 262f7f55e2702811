"""RoPE scaling: each type's inverse frequencies and attention factor equal the published formulas
(``rope_scaling_refs``); factor 1 is plain RoPE; the factor follows the length when not given."""

from __future__ import annotations

import pytest
import torch
from rope_scaling_refs import (
    BASE,
    L0,
    LONG,
    SHORT,
    D,
    assert_freqs,
    plain,
    reference,
    scaling,
)

from vispos.encodings.rope_scaling import RopeScaling, rope_inv_freq, scaled_inv_freq


@pytest.mark.parametrize("kind", ["linear", "ntk", "dynamic_ntk", "yarn", "longrope", "llama3"])
@pytest.mark.parametrize("s", [2.0, 4.0, 16.0])
def test_scaled_inv_freq_and_attention_equal_formulas(kind: str, s: float) -> None:
    length = int(s * L0)
    assert_freqs(scaled_inv_freq(D, BASE, scaling(kind, s), length), reference(kind, s, length, LONG))


def test_yarn_ramp_keeps_fast_and_interpolates_slow_frequencies() -> None:
    inv, _ = scaled_inv_freq(D, BASE, scaling("yarn", 4.0), 4 * L0)
    base = torch.tensor(plain(D, BASE))
    ratio = inv / base
    # pair 0 turns L0 / (2 pi) ~ 326 times over the training length (> 32): kept; the last turns < 1: / s
    assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(0.25)
    assert ((ratio[:-1] - ratio[1:]) >= -1e-7).all()  # monotone ramp in between


@pytest.mark.parametrize("kind", ["linear", "ntk", "dynamic_ntk", "yarn", "longrope", "llama3"])
def test_factor_one_is_plain_rope(kind: str) -> None:
    extra = {"long_factors": (1.0,) * (D // 2)} if kind == "longrope" else {}
    s = RopeScaling(kind, factor=1.0, original_length=L0, **extra)
    for length in (10, L0):
        inv, attention = scaled_inv_freq(D, BASE, s, length)
        torch.testing.assert_close(inv.double(), torch.tensor(plain(D, BASE), dtype=torch.float64), rtol=1e-6, atol=0)
        assert attention == 1.0
    torch.testing.assert_close(rope_inv_freq(D, BASE).double(), torch.tensor(plain(D, BASE), dtype=torch.float64))


@pytest.mark.parametrize("kind", ["linear", "ntk", "yarn", "longrope", "llama3"])
def test_factor_follows_the_length_when_not_given(kind: str) -> None:
    length = 3 * L0
    assert_freqs(scaled_inv_freq(D, BASE, scaling(kind, None), length), reference(kind, 3.0, length, LONG))


def test_dynamic_ntk_grows_with_the_length_only() -> None:
    for length in (100, L0):  # within the training length: plain RoPE whatever the factor
        assert_freqs(scaled_inv_freq(D, BASE, scaling("dynamic_ntk", 8.0), length), (plain(D, BASE), 1.0))
    # no factor: the base follows the length alone, i.e. NTK with s = L / L0
    assert_freqs(scaled_inv_freq(D, BASE, scaling("dynamic_ntk", None), 4 * L0), reference("ntk", 4.0, 4 * L0))
    assert_freqs(scaled_inv_freq(D, BASE, scaling("dynamic_ntk", 2.0), 3 * L0), reference("dynamic_ntk", 2.0, 3 * L0))


def test_longrope_uses_short_factors_within_training_length() -> None:
    short = scaled_inv_freq(D, BASE, scaling("longrope", 4.0), L0)
    assert_freqs(short, reference("longrope", 4.0, L0, SHORT))
    long = scaled_inv_freq(D, BASE, scaling("longrope", 4.0), L0 + 1)
    assert_freqs(long, reference("longrope", 4.0, L0 + 1, LONG))
