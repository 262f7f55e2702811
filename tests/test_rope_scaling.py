"""RoPE scaling: inverse frequencies and attention factors against the published formulas (ANCHORS.md),
written out here in plain Python; factor 1 is plain RoPE; rope2d scales each axis by its own factor;
transformers-style configs (``RopeScaling.from_config``) give the scalings shipped models use."""

from __future__ import annotations

import math
from dataclasses import fields, replace

import pytest
import torch

import vispos
from vispos.encodings.rope_scaling import RopeScaling, rope_inv_freq, scaled_inv_freq

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


# --- transformers-style configs -------------------------------------------------------------------------
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192, "rope_theta": 500000.0}  # fmt: skip
DEEPSEEK_V2 = {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
               "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096}  # fmt: skip
GPT_OSS = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
           "original_max_position_embeddings": 4096, "rope_theta": 150000}  # fmt: skip
PHI3 = {"max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
        "rope_scaling": {"type": "longrope", "long_factor": LONG, "short_factor": SHORT}}  # fmt: skip


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (LLAMA31, RopeScaling("llama3", factor=8.0, original_length=8192)),
        (DEEPSEEK_V2, RopeScaling("yarn", factor=40, original_length=4096, mscale=0.707, mscale_all_dim=0.707)),
        (GPT_OSS, RopeScaling("yarn", factor=32.0, original_length=4096, truncate=False)),
        (
            PHI3,
            RopeScaling(
                "longrope", factor=32.0, original_length=4096, long_factors=tuple(LONG), short_factors=tuple(SHORT)
            ),
        ),  # fmt: skip
        ({"rope_type": "linear", "factor": 4.0}, RopeScaling("linear", factor=4.0)),
        (
            {"max_position_embeddings": 2048, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
            RopeScaling("dynamic_ntk", factor=2.0, original_length=2048),
        ),  # fmt: skip
        ({"rope_type": "default", "rope_theta": 1e6}, None),
        ({"max_position_embeddings": 4096, "rope_scaling": None}, None),
        ({"type": "mrope", "mrope_section": [16, 24, 24]}, None),  # Qwen2-VL: plain frequencies
    ],
)
def test_from_config_reads_transformers_rope_dicts(config: dict, expected: RopeScaling | None) -> None:
    assert vispos.RopeScaling.from_config(config) == expected


def test_from_config_follows_transformers_defaults() -> None:
    # yarn without factor: max_position_embeddings / original (DeepSeek-V3 style); a lone mscale is not read
    sc = RopeScaling.from_config({"rope_type": "yarn", "original_max_position_embeddings": 4096, "mscale": 0.5},
                                 max_position_embeddings=16384)  # fmt: skip
    assert sc == RopeScaling("yarn", factor=4.0, original_length=4096)
    # yarn / llama3 without original_max_position_embeddings: max_position_embeddings stands for it
    llama = {k: v for k, v in LLAMA31.items() if k != "original_max_position_embeddings"}
    assert RopeScaling.from_config(llama, max_position_embeddings=1024).original_length == 1024
    # the model config's original_max_position_embeddings wins (Phi-3 keeps it at the top level)
    nested = {**PHI3, "rope_scaling": {**PHI3["rope_scaling"], "original_max_position_embeddings": 8192}}
    assert RopeScaling.from_config(nested).original_length == 4096


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({"rope_type": "cubic"}, ValueError, r"unknown rope_type 'cubic'; accepted: default, mrope, linear, dynamic"),
        ({"rope_type": "yarn", "factor": 4.0, "scale": 2}, TypeError, r"unknown RoPE config key\(s\) scale .*factor"),
        ({"rope_type": "dynamic", "factor": 2.0}, ValueError, r"grows from max_position_embeddings"),
        ({"rope_type": "longrope", "long_factor": LONG}, ValueError, r"without factor needs max_position_embeddings"),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "original_max_position_embeddings": 8192,
                "low_freq_factor": 4.0,
                "high_freq_factor": 1.0,
            },
            ValueError,
            r"high_freq_factor must exceed low_freq_factor",
        ),  # fmt: skip
    ],
)
def test_from_config_bad_input_names_what_is_accepted(config: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        RopeScaling.from_config(config)


MISTRAL = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096, "head_dim": 128,
           "num_attention_heads": 32, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
           "sliding_window": None}  # fmt: skip


@pytest.mark.parametrize(
    "config",
    [
        MISTRAL,  # no rope_scaling key at all
        {**MISTRAL, "rope_scaling": None},
        {**MISTRAL, "rope_scaling": {}},
        {**MISTRAL, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},  # transformers 5 writes this
        {"model_type": "llava", "vision_config": {"image_size": 336}, "text_config": MISTRAL},
        {"model_type": "llava", "text_config": {"model_type": "llama", "max_position_embeddings": 4096}},
    ],
)
def test_from_config_of_a_model_without_scaling_is_none(config: dict) -> None:
    assert RopeScaling.from_config(config) is None


# a VLM keeps its language model's settings under text_config (Llava, Qwen2-VL / Qwen2.5-VL as transformers saves them)
LLAVA_LLAMA31 = {
    "model_type": "llava",
    "architectures": ["LlavaForConditionalGeneration"],
    "vision_config": {"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14},
    "text_config": {"model_type": "llama", "max_position_embeddings": 131072, "rope_scaling": LLAMA31},
}
QWEN25_VL_YARN = {
    "model_type": "qwen2_5_vl",
    "vision_config": {"depth": 32},
    "text_config": {
        "model_type": "qwen2_5_vl_text",
        "max_position_embeddings": 128000,
        "rope_scaling": {
            "type": "yarn",
            "mrope_section": [16, 24, 24],
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    },
}
QWEN2_VL = {
    "model_type": "qwen2_vl",
    "vision_config": {"depth": 32},
    "text_config": {"max_position_embeddings": 32768, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
}
NESTED_YARN_NO_FACTOR = {
    "model_type": "some_vlm",
    "text_config": {
        "max_position_embeddings": 131072,
        "rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 32768},
    },
}


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (LLAVA_LLAMA31, RopeScaling("llama3", factor=8.0, original_length=8192)),
        (QWEN25_VL_YARN, RopeScaling("yarn", factor=4.0, original_length=32768)),
        (QWEN2_VL, None),
        (NESTED_YARN_NO_FACTOR, RopeScaling("yarn", factor=4.0, original_length=32768)),  # the text model's max length
        ({**LLAVA_LLAMA31, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, RopeScaling("linear", factor=2.0)),
    ],
)
def test_from_config_follows_text_config(config: dict, expected: RopeScaling | None) -> None:
    """Top-level settings win; without them the nested ``text_config`` is read (with its own max length)."""
    assert RopeScaling.from_config(config) == expected


# Phi-3.5-MoE: LongRoPE whose attention factor is given, one for lengths beyond the original, one within;
# the shipped values are equal (1.2431...), distinct ones here show which is used where
PHI35_MOE = {"model_type": "phimoe", "max_position_embeddings": 131072, "rope_theta": 10000.0,
             "rope_scaling": {"type": "longrope", "long_factor": LONG, "short_factor": SHORT, "long_mscale": 1.3,
                              "short_mscale": 1.1, "original_max_position_embeddings": 4096}}  # fmt: skip


def test_from_config_reads_phi35_moe_longrope_mscale_pair() -> None:
    sc = RopeScaling.from_config(PHI35_MOE)
    assert sc == RopeScaling("longrope", factor=32.0, original_length=4096, long_factors=tuple(LONG),
                             short_factors=tuple(SHORT), long_mscale=1.3, short_mscale=1.1)  # fmt: skip
    # PhiMoE: mscale = long_mscale if seq_len > original_max_position_embeddings else short_mscale, multiplying
    # cos and sin in place of LongRoPE's sqrt(1 + ln s / ln L0); the factor sets follow the same rule
    for length, factors, mscale in ((4096, SHORT, 1.1), (1000, SHORT, 1.1), (4097, LONG, 1.3), (131072, LONG, 1.3)):
        expected = [f / x for f, x in zip(plain(D, BASE), factors, strict=True)]
        assert_freqs(scaled_inv_freq(D, BASE, sc, length), (expected, mscale))


def test_from_config_reads_the_old_su_type_as_longrope() -> None:
    su = {**PHI3, "rope_scaling": {**PHI3["rope_scaling"], "type": "su"}}
    assert RopeScaling.from_config(su) == RopeScaling.from_config(PHI3)
    assert RopeScaling.from_config({"rope_type": "su", "long_factor": LONG, "factor": 2.0,
                                    "original_max_position_embeddings": 64}).type == "longrope"  # fmt: skip


@pytest.mark.parametrize(
    ("config", "expected"),
    [  # keys transformers knows but does not read for this type: dropped, as transformers drops them
        ({"rope_type": "linear", "factor": 4.0, "original_max_position_embeddings": 2048, "attention_factor": 1.5},
         RopeScaling("linear", factor=4.0)),
        ({**LLAMA31, "beta_fast": 32, "attention_factor": 1.2},
         RopeScaling("llama3", factor=8.0, original_length=8192)),
        ({"max_position_embeddings": 2048, "rope_scaling": {"type": "dynamic", "factor": 2.0, "beta_slow": 1,
          "original_max_position_embeddings": 1024}}, RopeScaling("dynamic_ntk", factor=2.0, original_length=2048)),
        ({**DEEPSEEK_V2, "low_freq_factor": 1.0, "long_mscale": 1.0},
         RopeScaling("yarn", factor=40, original_length=4096, mscale=0.707, mscale_all_dim=0.707)),
    ],
)  # fmt: skip
def test_from_config_drops_keys_transformers_does_not_read_for_the_type(config: dict, expected: RopeScaling) -> None:
    assert RopeScaling.from_config(config) == expected


def test_from_config_per_layer_type_parameters_name_the_layer_types() -> None:
    gemma3 = {"max_position_embeddings": 131072, "layer_types": ["sliding_attention", "full_attention"],
              "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}  # fmt: skip
    with pytest.raises(ValueError, match=r"per layer type \(full_attention, sliding_attention\).*\['full_attention'\]"):
        RopeScaling.from_config(gemma3)
    full = {**gemma3, "rope_parameters": gemma3["rope_parameters"]["full_attention"]}
    assert RopeScaling.from_config(full) == RopeScaling("linear", factor=8.0)


def test_phimoe_values_equal_transformers_when_installed() -> None:
    """PhiMoE's rotary embedding itself (cos at position 0 is its mscale) against ours, within and beyond 4096."""
    pytest.importorskip("transformers")
    from transformers import PhimoeConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.phimoe.modeling_phimoe import PhimoeRotaryEmbedding

    d = D
    hf = PhimoeConfig(hidden_size=4 * d, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=131072,
                      rope_theta=10000.0,
                      rope_scaling=dict(PHI35_MOE["rope_scaling"]))  # fmt: skip
    ours = RopeScaling.from_config(PHI35_MOE)
    rotary = PhimoeRotaryEmbedding(hf)
    for n in (1000, 4096, 5000):
        inv, att = scaled_inv_freq(d, 10000.0, ours, n)
        inv_hf, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=n)  # long factors beyond 4096, short within
        cos, _ = rotary(torch.zeros(1, 1, d), torch.tensor([[0, n - 1]]))  # [1, 2, d]
        torch.testing.assert_close(inv.double(), inv_hf.double(), rtol=1e-6, atol=0)
        assert att == pytest.approx(cos[0, 0, 0].item(), rel=1e-6)


def test_from_config_values_equal_transformers_when_installed() -> None:
    """The optional cross-check: transformers' own rope init functions on the same configs (skipped without it)."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = 64
    cases = [  # (config class, rope dict, max_position_embeddings, seq_len, extra config fields)
        (LlamaConfig, {**LLAMA31, "rope_theta": 500000.0}, 131072, None, {}),
        (LlamaConfig, {**DEEPSEEK_V2, "rope_type": "yarn", "rope_theta": 10000.0}, 163840, None, {}),
        (LlamaConfig, {**DEEPSEEK_V2, "rope_type": "yarn", "mscale": 1.0, "mscale_all_dim": 0.8}, 163840, None, {}),
        (LlamaConfig, {**GPT_OSS, "rope_theta": 150000.0}, 131072, None, {}),
        (LlamaConfig, {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, 2048, 6000, {}),
        (LlamaConfig, {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}, 2048, None, {}),
        # keys transformers knows but does not read for the type: it drops them, and so does from_config
        (
            LlamaConfig,
            {
                "rope_type": "linear",
                "factor": 4.0,
                "rope_theta": 10000.0,
                "attention_factor": 1.5,
                "original_max_position_embeddings": 512,
            },
            2048,
            None,
            {},
        ),
        (LlamaConfig, {**LLAMA31, "beta_fast": 8.0, "attention_factor": 1.5}, 131072, None, {}),
    ]
    long, short = [1.0 + 0.25 * i for i in range(d // 2)], [1.0 + 0.01 * i for i in range(d // 2)]
    phi3 = {"rope_type": "longrope", "long_factor": long, "short_factor": short, "rope_theta": 10000.0}
    cases += [(Phi3Config, phi3, 131072, n, {"original_max_position_embeddings": 4096}) for n in (1000, 5000)]
    for config_class, rope, max_len, seq_len, extra in cases:
        theta = rope.get("rope_theta", 10000.0)
        hf = config_class(hidden_size=4 * d, num_attention_heads=4, max_position_embeddings=max_len,
                          rope_parameters={k: v for k, v in rope.items() if k != "type"}, **extra)  # fmt: skip
        inv_hf, att_hf = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf, "cpu", seq_len=seq_len)
        ours = RopeScaling.from_config({"max_position_embeddings": max_len, "rope_scaling": rope, **extra})
        inv, att = scaled_inv_freq(d, theta, ours, seq_len or max_len)
        torch.testing.assert_close(inv.double(), inv_hf.double(), rtol=1e-6, atol=0)
        assert att == pytest.approx(att_hf, rel=1e-9)


@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_rope_module_rotates_by_scaled_angles(kind: str) -> None:
    d, l0, n = 16, 8, 32
    rope = vispos.create_encoding("rope", dim=d, scaling={"type": kind, "factor": 4.0, "original_length": l0})
    rot = rope(n)
    inv = [f / 4 for f in plain(d, 1e4)] if kind == "linear" else yarn_reference(d, 1e4, 4.0, l0)
    att = 1.0 if kind == "linear" else 0.1 * math.log(4) + 1
    angles = torch.tensor([[p * f for f in inv] for p in range(n)], dtype=torch.float64)
    torch.testing.assert_close(rot.cos.double(), att * torch.cat((angles.cos(), angles.cos()), -1), atol=1e-5, rtol=0)
    torch.testing.assert_close(rot.sin.double(), att * torch.cat((angles.sin(), angles.sin()), -1), atol=1e-5, rtol=0)


def test_rope2d_scales_each_axis_by_its_own_factor() -> None:
    d, train, grid = 16, (4, 6), (8, 6)  # y grows 2x, x not at all
    rope2d = vispos.create_encoding("rope2d", dim=d, scaling="linear", train_grid=train)
    rot = rope2d(grid)
    f = plain(d // 2, 100.0)  # each axis: d / 2 channels, d / 4 pairs
    cells = [(y, x) for y in range(grid[0]) for x in range(grid[1])]
    angles = torch.tensor([[x * fj for fj in f] + [y * fj / 2 for fj in f] for y, x in cells], dtype=torch.float64)
    torch.testing.assert_close(rot.cos.double(), torch.cat((angles.cos(), angles.cos()), -1), atol=1e-5, rtol=0)
    plain_rot = vispos.create_encoding("rope2d", dim=d)(train)
    torch.testing.assert_close(rope2d(train).cos, plain_rot.cos)  # at the training grid: unchanged


def test_rope2d_yarn_attention_factor_is_geometric_mean_of_axes() -> None:
    d = 16
    rope2d = vispos.create_encoding("rope2d", dim=d, scaling={"type": "yarn"}, train_grid=(4, 4))
    rot = rope2d((8, 4))
    att_y, att_x = 0.1 * math.log(2) + 1, 1.0
    assert float(rot.cos[0, 0]) == pytest.approx(math.sqrt(att_y * att_x), rel=1e-6)  # angle 0 at (0, 0)


# --- bad input -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"type": "linear", "factor": 0.5}, ValueError, r"scaling factor must be >= 1"),
        ({"type": "cubic", "factor": 2.0}, ValueError, r"accepted: linear, ntk, dynamic_ntk, yarn, longrope, llama3"),
        ({"type": "yarn", "factor": 2.0}, ValueError, r"'yarn' scaling needs original_length"),
        ({"type": "longrope", "factor": 2.0, "long_factors": [1.0] * 4}, ValueError, r"needs original_length"),
        ({"type": "dynamic_ntk", "factor": 2.0}, ValueError, r"needs original_length"),
        ({"type": "linear"}, ValueError, r"factor=None needs original_length"),
        ({"type": "longrope", "original_length": 8}, ValueError, r"needs long_factors"),
        ({"type": "longrope", "original_length": 8, "long_factors": [1.0] * 3}, ValueError, r"dim / 2 = 4\), got 3"),
        (
            {"type": "longrope", "original_length": 8, "long_factors": [1.0] * 4, "short_factors": [1.0] * 5},
            ValueError,
            r"short_factors must have one entry per rotary frequency \(dim / 2 = 4\), got 5",
        ),
        (
            {"type": "linear", "factor": 2.0, "long_factors": [1.0] * 4},
            ValueError,
            r"long_factors: not used by 'linear' scaling \(options of 'longrope'\)",
        ),
        (
            {"type": "linear", "factr": 2.0},
            TypeError,
            r"unknown RoPE scaling option\(s\) factr; accepted: type, factor",
        ),
        ({"type": "yarn", "original_length": 8, "beta_fast": 1.0}, ValueError, r"beta_fast must exceed beta_slow"),
        ({"type": "yarn", "original_length": 8, "mscale": 1.0}, ValueError, r"mscale and mscale_all_dim go together"),
        ({"type": "yarn", "original_length": 8, "truncate": "no"}, TypeError, r"truncate must be a bool"),
        ({"type": "llama3", "factor": 8.0}, ValueError, r"'llama3' scaling needs original_length"),
        (
            {"type": "llama3", "original_length": 8, "low_freq_factor": 2.0, "high_freq_factor": 2.0},
            ValueError,
            r"high_freq_factor must exceed low_freq_factor, got 2.0 <= 2.0",
        ),
        (
            {"type": "yarn", "original_length": 8, "low_freq_factor": 2.0},
            ValueError,
            r"low_freq_factor: not used by 'yarn' scaling \(options of 'llama3'\); 'yarn' takes factor, "
            r"original_length, attention_factor, beta_fast, beta_slow, mscale, mscale_all_dim, truncate",
        ),
        (
            {"type": "ntk", "factor": 2.0, "truncate": False},
            ValueError,
            r"truncate: not used by 'ntk' scaling \(options of 'yarn'\)",
        ),
    ],
)
def test_bad_scaling_names_what_is_accepted(options: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        vispos.create_encoding("rope", dim=8, scaling=options)


def test_bad_scaling_type_object() -> None:
    with pytest.raises(TypeError, match=r"scaling must be None, a type name, a dict or RopeScaling"):
        vispos.create_encoding("rope", dim=8, scaling=2.0)


def test_rope2d_scaling_needs_train_grid_and_theta_frequencies() -> None:
    with pytest.raises(ValueError, match=r"needs train_grid=\(H, W\)"):
        vispos.create_encoding("rope2d", dim=16, scaling="linear")
    with pytest.raises(ValueError, match=r"defined on theta's frequencies"):
        vispos.create_encoding(
            "rope2d", dim=16, coords="normalized", min_period=0.5, max_period=20.0, scaling="linear", train_grid=(4, 4)
        )
    with pytest.raises(ValueError, match=r"dim / 2 = 4\), got 8"):  # per axis: dim / 4 pairs
        vispos.create_encoding(
            "rope2d", dim=16, scaling={"type": "longrope", "long_factors": [1.0] * 8}, train_grid=(4, 4)
        )


def test_rope_scaling_switched_after_training_is_validated() -> None:
    rope = vispos.create_encoding("rope", ndim=1, dim=16)
    with pytest.raises(ValueError, match="dim / 2 = 8"):
        rope.set_scaling(vispos.RopeScaling("longrope", original_length=8, long_factors=(1.0,) * 3))
    rope.set_scaling({"type": "yarn", "factor": 2.0, "original_length": 8})
    assert isinstance(rope.scaling, vispos.RopeScaling) and rope.scaling.type == "yarn"
    assert rope(torch.arange(16)).temperature == pytest.approx(0.1 * math.log(2.0) + 1.0)
    with pytest.raises(AttributeError):  # one way to switch it: set_scaling (or vispos.configure)
        rope.scaling = None


# --- every field a type does not use is refused (an ignored option would be a silent wrong result) ----------
# What each type's formula reads (module docstring, ANCHORS.md); type, factor, original_length (the training
# length: the factor follows it when not given) and attention_factor (an override of the temperature) are
# read by every type.
COMMON_FIELDS = {"factor", "original_length", "attention_factor"}
USED_FIELDS = {
    "linear": COMMON_FIELDS,
    "ntk": COMMON_FIELDS,
    "dynamic_ntk": COMMON_FIELDS,
    "yarn": COMMON_FIELDS | {"beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"},
    "longrope": COMMON_FIELDS | {"long_factors", "short_factors", "long_mscale", "short_mscale"},
    "llama3": COMMON_FIELDS | {"low_freq_factor", "high_freq_factor"},
}
VALID_VALUES = {"factor": 2.0, "original_length": 64, "attention_factor": 1.5, "beta_fast": 16.0, "beta_slow": 2.0,
                "mscale": 0.8, "mscale_all_dim": 0.9, "truncate": False, "long_factors": (1.5,) * 4,
                "short_factors": (1.1,) * 4, "long_mscale": 1.3, "short_mscale": 1.1, "low_freq_factor": 2.0,
                "high_freq_factor": 8.0}  # fmt: skip
PARTNERS = {"mscale": "mscale_all_dim", "mscale_all_dim": "mscale", "long_mscale": "short_mscale",
            "short_mscale": "long_mscale"}  # fmt: skip


def base_options(kind: str) -> dict[str, object]:
    extra = {"long_factors": (1.5,) * 4} if kind == "longrope" else {}
    return {"type": kind, "factor": 2.0, "original_length": 64, **extra}


def test_used_fields_table_covers_every_type_and_field() -> None:
    assert set(USED_FIELDS) == set(vispos.SCALING_TYPES)
    names = {f.name for f in fields(RopeScaling)} - {"type"}
    assert set(VALID_VALUES) == names and set().union(*USED_FIELDS.values()) == names


@pytest.mark.parametrize("kind", sorted(USED_FIELDS))
@pytest.mark.parametrize("name", sorted(VALID_VALUES))
def test_a_field_the_type_does_not_use_is_refused(kind: str, name: str) -> None:
    options = {**base_options(kind), name: VALID_VALUES[name]}
    if name in PARTNERS:
        options[PARTNERS[name]] = VALID_VALUES[PARTNERS[name]]
    if name in USED_FIELDS[kind]:
        sc = vispos.create_encoding("rope", dim=8, scaling=options).scaling
        assert getattr(sc, name) == VALID_VALUES[name]
        inv, attention = scaled_inv_freq(8, BASE, sc, 256)
        assert torch.isfinite(inv).all() and math.isfinite(attention)
        return
    accepted = ", ".join(f for f in ("factor", "original_length", "attention_factor"))
    with pytest.raises(
        ValueError,
        match=rf"^(\w+, )?{name}(, \w+)?: not used by {kind!r} scaling \(options of '\w+'\); {kind!r} takes {accepted}",
    ):
        vispos.create_encoding("rope", dim=8, scaling=options)


def test_ignored_scaling_keywords_are_refused_by_configure_and_set_scaling() -> None:
    """The user's forms: keywords to vispos.configure (1D and 2D RoPE), a dict, set_scaling."""
    stack = torch.nn.Sequential(vispos.layers.Attention(16, 2, pos="rope"))
    with pytest.raises(
        ValueError, match=r"beta_fast: not used by 'linear' scaling \(options of 'yarn'\); 'linear' takes factor"
    ):
        vispos.configure(stack, scaling="linear", factor=2.0, beta_fast=8)
    with pytest.raises(ValueError, match=r"mscale, mscale_all_dim: not used by 'ntk' scaling.*\(options of 'yarn'\)"):
        vispos.configure(stack, scaling={"type": "ntk", "factor": 2.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    rope2d = vispos.create_encoding("rope2d", dim=16, train_grid=(4, 4))
    with pytest.raises(ValueError, match=r"beta_slow: not used by 'llama3' scaling"):
        rope2d.set_scaling("llama3", beta_slow=2.0)
    assert stack[0].pos.scaling is None and rope2d.scaling_y is None  # nothing was half-applied
    vispos.configure(stack, scaling="yarn", factor=2.0, original_length=8, beta_fast=8)  # yarn's own: accepted
    assert stack[0].pos.scaling.beta_fast == 8


def test_a_field_given_twice_with_two_values_is_refused() -> None:
    """Neither value may be dropped silently: in the dict and as a keyword, or against the training length."""
    rope = vispos.create_encoding("rope", dim=8)
    with pytest.raises(ValueError, match=r"given twice with two values \(factor: 2.0 in scaling=, 4.0 beside it"):
        rope.set_scaling({"type": "yarn", "factor": 2.0, "original_length": 8}, factor=4.0)
    with pytest.raises(ValueError, match=r"original_length: 8 in scaling=, 16 beside it"):
        rope.set_scaling({"type": "yarn", "original_length": 8}, original_length=16)
    rope.set_scaling({"type": "yarn", "factor": 2.0, "original_length": 8}, factor=2.0)  # the same value twice: fine
    assert rope.scaling == RopeScaling("yarn", factor=2.0, original_length=8)
    rope2d = vispos.create_encoding("rope2d", dim=16, train_grid=(4, 6))
    with pytest.raises(ValueError, match=r"rope2d reads each axis's original length from train_grid"):
        rope2d.set_scaling("yarn", original_length=128)
    with pytest.raises(ValueError, match=r"original_length: 128 in scaling=, 4 beside it"):
        rope2d.set_scaling(RopeScaling("yarn", original_length=128))
    rope2d.set_scaling(RopeScaling("yarn", original_length=4))  # the training height: what rope2d uses anyway
    assert (rope2d.scaling_y.original_length, rope2d.scaling_x.original_length) == (4, 6)
