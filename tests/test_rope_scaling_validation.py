"""RoPE scaling settings refused with a message naming what is accepted: bad input, and every field a
type does not read (an ignored option would be a silent wrong result), a field given twice."""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
import torch
from rope_scaling_refs import (
    BASE,
)

import vispos
from vispos.encodings.rope_scaling import RopeScaling, scaled_inv_freq


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
