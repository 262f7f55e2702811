"""RoPE scaling read from transformers-style configs (``RopeScaling.from_config``): rope dicts, whole model
configs, VLM text_config, keys transformers drops; equal to transformers' own functions when installed."""

from __future__ import annotations

import pytest
import torch
from rope_scaling_refs import (
    BASE,
    LONG,
    SHORT,
    D,
    assert_freqs,
    plain,
)

import vispos
from vispos.encodings.rope_scaling import RopeScaling, scaled_inv_freq

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
