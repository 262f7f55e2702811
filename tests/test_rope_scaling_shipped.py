"""RoPE scaling as shipped models use it: Llama 3.1, DeepSeek's YaRN (mscale pair), gpt-oss's YaRN
(``truncate=False``), Phi-3's LongRoPE, against their formulas."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from rope_scaling_refs import (
    BASE,
    L0,
    LONG,
    SHORT,
    D,
    assert_freqs,
    deepseek_attention,
    llama3_reference,
    plain,
    yarn_reference,
)

from vispos.encodings.rope_scaling import RopeScaling, scaled_inv_freq


# --- the scalings shipped models use: Llama 3.1, DeepSeek's YaRN, gpt-oss's YaRN, Phi-3's LongRoPE ----------
@pytest.mark.parametrize(
    ("d", "base", "s", "l0", "low", "high"),
    [(128, 500000.0, 8.0, 8192, 1.0, 4.0), (64, 10000.0, 4.0, 2048, 1.0, 4.0), (64, 10000.0, 16.0, 512, 2.0, 8.0)],
)
def test_llama3_frequencies_equal_llama31_formula(
    d: int, base: float, s: float, l0: int, low: float, high: float
) -> None:
    expected = llama3_reference(d, base, s, l0, low, high)
    wavelengths = [2 * math.pi / f for f in plain(d, base)]
    bands = {w < l0 / high for w in wavelengths} | {w > l0 / low for w in wavelengths}
    assert any(l0 / high <= w <= l0 / low for w in wavelengths) and bands == {True, False}  # all three bands
    sc = RopeScaling("llama3", factor=s, original_length=l0, low_freq_factor=low, high_freq_factor=high)
    for length in (16, l0, 4 * l0):  # a fixed factor: the same frequencies at every length, no temperature
        assert_freqs(scaled_inv_freq(d, base, sc, length), (expected, 1.0))


def test_llama3_defaults_are_llama31s_band_factors() -> None:
    sc = RopeScaling("llama3", factor=8.0, original_length=8192)
    assert (sc.low_freq_factor, sc.high_freq_factor) == (1.0, 4.0)
    assert_freqs(scaled_inv_freq(128, 500000.0, sc, 8192), (llama3_reference(128, 500000.0, 8.0, 8192), 1.0))


@pytest.mark.parametrize(("s", "mscale", "mscale_all_dim"), [(40.0, 0.707, 0.707), (32.0, 1.0, 0.8), (4.0, 0.5, 1.0)])
def test_yarn_mscale_attention_factor_equals_deepseek_formula(s: float, mscale: float, mscale_all_dim: float) -> None:
    sc = RopeScaling("yarn", factor=s, original_length=L0, mscale=mscale, mscale_all_dim=mscale_all_dim)
    inv, attention = scaled_inv_freq(D, BASE, sc, 2 * L0)
    assert_freqs((inv, attention), (yarn_reference(D, BASE, s, L0), deepseek_attention(s, mscale, mscale_all_dim)))
    assert attention != pytest.approx(0.1 * math.log(s) + 1) or mscale == mscale_all_dim == 1.0


@pytest.mark.parametrize(("base", "l0", "beta_fast", "beta_slow"), [(150000.0, 4096, 32.0, 1.0), (BASE, L0, 16.0, 2.0)])
def test_yarn_truncate_false_keeps_the_correction_range_fractional(
    base: float, l0: int, beta_fast: float, beta_slow: float
) -> None:
    common = {"factor": 32.0, "original_length": l0, "beta_fast": beta_fast, "beta_slow": beta_slow}
    exact = scaled_inv_freq(D, base, RopeScaling("yarn", truncate=False, **common), l0)
    rounded = scaled_inv_freq(D, base, RopeScaling("yarn", **common), l0)
    assert_freqs(
        exact, (yarn_reference(D, base, 32.0, l0, beta_fast, beta_slow, truncate=False), 0.1 * math.log(32) + 1)
    )
    assert_freqs(rounded, (yarn_reference(D, base, 32.0, l0, beta_fast, beta_slow), 0.1 * math.log(32) + 1))
    assert (exact[0] - rounded[0]).abs().max() > 1e-3 * exact[0].min()  # the rounding does change frequencies


def test_longrope_fixed_factor_as_phi3_beside_the_length_derived_one() -> None:
    """Phi-3: s = max_position_embeddings / original, fixed: the same temperature at every length (short
    factors within the original length, long beyond); factor=None derives s from the current length."""
    phi3 = RopeScaling("longrope", factor=131072 / 4096, original_length=4096, long_factors=tuple(LONG),
                       short_factors=tuple(SHORT))  # fmt: skip
    attention = math.sqrt(1 + math.log(32.0) / math.log(4096))
    assert_freqs(
        scaled_inv_freq(D, BASE, phi3, 1000), ([f / x for f, x in zip(plain(D, BASE), SHORT, strict=True)], attention)
    )
    assert_freqs(
        scaled_inv_freq(D, BASE, phi3, 5000), ([f / x for f, x in zip(plain(D, BASE), LONG, strict=True)], attention)
    )
    derived = replace(phi3, factor=None)
    assert scaled_inv_freq(D, BASE, derived, 1000)[1] == 1.0  # within the original length: s = 1
    assert scaled_inv_freq(D, BASE, derived, 8192)[1] == pytest.approx(math.sqrt(1 + math.log(2) / math.log(4096)))
