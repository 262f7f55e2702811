"""Every option of every registered scheme refuses bad values with an error that names the option.

The table of bad values is keyed by option name and read for every scheme that has the option, so a new
scheme is covered by the options it shares; an option that is in no table (a new name) fails
``test_every_option_of_every_scheme_has_bad_values``, so that it gets values here and a check in its
constructor.
"""

from __future__ import annotations

import math

import pytest

import vispos
from vispos.registry import get_info

NAN, INF = math.nan, math.inf
NUMBER = [NAN, INF, -INF, True, "1.0", [1.0]]  # never a valid number: non-finite, bool, str, list
POSITIVE = [-1.0, 0.0, *NUMBER]
NON_NEGATIVE = [-1.0, -1e-9, *NUMBER, None]  # a std of 0 is a valid (constant) initialisation
COUNT = [0, -1, 2.5, 4.0, True, "4", None]  # a positive int: no float, no bool, no str
CHOICE = ["bogus", 1, True, None]
FLAG = ["no", "yes", 1, 0, None, 1.0]  # a bool only: "no" is truthy, 1 is not True
GRID = [(0, 4), (4,), 4, (4.0, 4.0), (True, 4), (-1, 4), "44"]
SEQUENCE = ["abc", 4, (-1, 2), (1.5, 2), (True, 2)]

BAD: dict[str, list[object]] = {
    # numbers
    "theta": POSITIVE,
    "temperature": POSITIVE,
    "scale_base": POSITIVE,
    "max_bias": POSITIVE,
    "global_slope": NON_NEGATIVE,
    "ratio": POSITIVE,
    "init_c": POSITIVE,
    "threshold": POSITIVE,
    "eps": POSITIVE,
    "min_period": POSITIVE,
    "max_period": POSITIVE,
    "init_std": NON_NEGATIVE,
    "init_range": NON_NEGATIVE,
    "offset": [*NUMBER, None],
    "shift_coords": [-0.1, *NUMBER],
    "jitter_coords": [0.5, -1.0, *NUMBER],
    "rescale_coords": [0.5, -2.0, *NUMBER],
    "min_freq": POSITIVE,
    "max_freq": POSITIVE,
    "zero_freqs": [-0.1, 1.5, *NUMBER, None],
    "dropout": [-0.1, 1.0, 1.5, *NUMBER, None],  # a probability below 1
    # counts
    "hidden": COUNT,
    "parabolas": COUNT,
    "pad_to": COUNT,
    "mlp_width": COUNT,
    "max_len": COUNT,
    "max_distance": COUNT,
    "num_buckets": COUNT,
    "block_size": COUNT[:-1],  # liere2d: None = the head dimension (dense)
    "kernel_size": [*COUNT, 2],  # odd only: the grid keeps its size
    "after": [-1, 2.5, 1.0, True, "0", None],  # a block index: an int >= 0
    # choices
    "layout": CHOICE[:-1],  # ropend: None = the preset's
    "coords": CHOICE,
    "axes": CHOICE,
    "normalize": CHOICE,
    "section_layout": CHOICE,
    "out_of_range": CHOICE,
    "resample": CHOICE,
    "resize": CHOICE,
    "interpolation": CHOICE,
    "variant": CHOICE,
    "freqs": CHOICE,
    "preset": CHOICE[:-1],  # None: no preset
    "spacing": CHOICE,
    "offset_scale": CHOICE,
    "output": CHOICE,
    "distance": CHOICE,
    "method": CHOICE,
    "bands": CHOICE,
    "on": [*CHOICE, "q", "v", "qk", "qkv"],  # irpe2d: the keys only
    "fill": CHOICE,
    # flags
    "factorized": FLAG,
    "antialias": FLAG,
    "per_head": FLAG,
    "per_layer": FLAG,
    "prefix_entries": FLAG,
    "rotate": FLAG,
    "values": FLAG,
    "out_bias": FLAG,
    "learn_threshold": FLAG,
    "shared_head": FLAG,
    # structured
    "ref_grid": GRID,
    "sections": [(1, 2), (-1, 5, 4), (1.0, 3, 4), (True, 3, 4), "abc", 8],
    "split": SEQUENCE,
    "train_size": SEQUENCE,
    "scale_axes": SEQUENCE,
    "riflex": [(0, 50), (4,), (5, 50), (1, 0), (1.5, 50), "ab", 4.0],  # (k, N_k); k within the time axis's pairs
    "riflex_finetuned": FLAG,
    "fields": ["bogus", "corners-bogus", "center", "", 1, None],
    "layer_slopes": [(1.0,), (1.0, -1.0), (NAN, 1.0), "ab", 1.0, None],
    "head_slopes": [(0.5,), (0.5, -1.0), (0.5, NAN), "ab", 1.0],  # None: the released slopes
    "scaling": [2.0, "cubic", {"type": "linear", "factor": 0.5}, {"type": "linear", "factor": 2.0, "beta_fast": 8}],
}
# an option whose name two schemes share with different types: the bad values of the one named here
BAD_FOR: dict[str, dict[str, list[object]]] = {"pape2d": {"normalize": FLAG}}  # a flag (the released name)
# the context a host fills in: given by hand to create_encoding, it is checked the same way
CONTEXT = {"dim": 16, "width": 32, "num_heads": 2, "train_grid": (4, 4), "num_prefix_tokens": 1, "causal": False,
           "layer": 0, "depth": 1}
CONTEXT_BAD: dict[str, list[object]] = {
    "dim": [0, -4, 16.0, True, "16", None],
    "num_heads": [0, -1, 2.0, True, None],
    "width": [0, -4, 32.0, True, "32", None],
    "train_grid": GRID,
    "num_prefix_tokens": [-1, 1.0, True, None],
    "causal": FLAG,
    "layer": [-1, 1, 1.0, True, None],  # 1: not below the depth (1)
    "depth": [0, -1, 2.0, True, None],
}
# options that only take effect beside another one: the bad value is given with a valid partner
PARTNERS: dict[str, dict[str, object]] = {
    "min_period": {"max_period": 100.0},
    "max_period": {"min_period": 1.0},
    "scale_axes": {"split": (8, 8)},
    "train_size": {"split": (8, 8)},
}
GOOD: dict[str, object] = {"min_period": 1.0, "max_period": 100.0, "scale_axes": (0,), "train_size": (4, 4)}
# names an error may use for an option instead of its own
ALIASES: dict[str, tuple[str, ...]] = {"scaling": ("scaling", "factor", "beta_fast")}


def schemes() -> list[tuple[str, int]]:
    out = []
    for name in vispos.list_encodings():
        for ndim in (1, 2):
            if name in vispos.list_encodings(ndim):
                out.append((name, ndim))
    return out


def context(name: str, ndim: int) -> dict[str, object]:
    return {k: CONTEXT[k] for k in get_info(name, ndim).context}


def cases() -> list[tuple[str, int, str, object]]:
    return [
        (name, ndim, option, value)
        for name, ndim in schemes()
        for option in get_info(name, ndim).options
        for value in BAD_FOR.get(name, {}).get(option, BAD.get(option, ()))
    ]


@pytest.mark.parametrize(("name", "ndim"), schemes())
def test_every_option_of_every_scheme_has_bad_values(name: str, ndim: int) -> None:
    missing = sorted(set(get_info(name, ndim).options) - set(BAD))
    assert not missing, f"{name} ({ndim}D): add bad values for {missing} to BAD (and a check to its constructor)"
    assert set(get_info(name, ndim).context) <= set(CONTEXT_BAD)


@pytest.mark.parametrize(("name", "ndim"), schemes())
def test_defaults_and_partners_are_accepted(name: str, ndim: int) -> None:
    """The control: the context alone, and each partner set with a good value, build the scheme (so that a
    refusal below is the bad value's)."""
    vispos.create_encoding(name, ndim=ndim, **context(name, ndim))
    for option in get_info(name, ndim).options:
        if option in PARTNERS:
            vispos.create_encoding(name, ndim=ndim, **context(name, ndim), **PARTNERS[option], **{option: GOOD[option]})


def _refused(name: str, ndim: int, option: str, value: object, options: dict[str, object]) -> None:
    with pytest.raises((TypeError, ValueError)) as info:
        vispos.create_encoding(name, ndim=ndim, **options)
    names = ALIASES.get(option, (option,))
    assert any(n in str(info.value) for n in names), f"{name} {option}={value!r}: unnamed in {info.value}"


@pytest.mark.parametrize(("name", "ndim", "option", "value"), cases(), ids=lambda v: repr(v)[:24])
def test_bad_option_values_are_refused_naming_the_option(name: str, ndim: int, option: str, value: object) -> None:
    _refused(name, ndim, option, value, {**context(name, ndim), **PARTNERS.get(option, {}), option: value})


@pytest.mark.parametrize(
    ("name", "ndim", "option", "value"),
    [(n, d, o, v) for n, d in schemes() for o in get_info(n, d).context for v in CONTEXT_BAD[o]],
    ids=lambda v: repr(v)[:24],
)
def test_bad_context_values_are_refused_naming_the_option(name: str, ndim: int, option: str, value: object) -> None:
    _refused(name, ndim, option, value, {**context(name, ndim), option: value})
