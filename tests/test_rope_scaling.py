"""RoPE scaling: inverse frequencies and attention factors against the published formulas (ANCHORS.md),
written out here in plain Python; factor 1 is plain RoPE; rope2d scales each axis by its own factor."""

from __future__ import annotations

import math

import pytest
import torch

import vispos
from vispos.encodings.rope_scaling import RopeScaling, rope_inv_freq, scaled_inv_freq

D, BASE, L0 = 64, 10000.0, 2048


def plain(d: int, base: float) -> list[float]:
    """inv_freq_i = base^(-2i/d), i < d/2."""
    return [base ** (-2 * i / d) for i in range(d // 2)]


def yarn_reference(d: int, base: float, s: float, l0: int, beta_fast: float = 32, beta_slow: float = 1) -> list[float]:
    """YaRN: frequencies that turn more than beta_fast times over l0 are kept, fewer than beta_slow interpolated
    (divided by s), a linear ramp between; the correction dims are floored / ceiled as in transformers."""

    def correction_dim(rotations: float) -> float:
        return d * math.log(l0 / (2 * math.pi * rotations)) / (2 * math.log(base))

    low, high = max(math.floor(correction_dim(beta_fast)), 0), min(math.ceil(correction_dim(beta_slow)), d - 1)
    out = []
    for i, f in enumerate(plain(d, base)):
        interpolate = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f / s * interpolate + f * (1 - interpolate))
    return out


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


@pytest.mark.parametrize("kind", ["linear", "ntk", "dynamic_ntk", "yarn", "longrope"])
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


@pytest.mark.parametrize("kind", ["linear", "ntk", "dynamic_ntk", "yarn", "longrope"])
def test_factor_one_is_plain_rope(kind: str) -> None:
    extra = {"long_factors": (1.0,) * (D // 2)} if kind == "longrope" else {}
    s = RopeScaling(kind, factor=1.0, original_length=L0, **extra)
    for length in (10, L0):
        inv, attention = scaled_inv_freq(D, BASE, s, length)
        torch.testing.assert_close(inv.double(), torch.tensor(plain(D, BASE), dtype=torch.float64), rtol=1e-6, atol=0)
        assert attention == 1.0
    torch.testing.assert_close(rope_inv_freq(D, BASE).double(), torch.tensor(plain(D, BASE), dtype=torch.float64))


@pytest.mark.parametrize("kind", ["linear", "ntk", "yarn", "longrope"])
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
        ({"type": "cubic", "factor": 2.0}, ValueError, r"accepted: linear, ntk, dynamic_ntk, yarn, longrope"),
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
        ({"type": "linear", "factor": 2.0, "long_factors": [1.0] * 4}, ValueError, r"options of 'longrope' scaling"),
        (
            {"type": "linear", "factr": 2.0},
            TypeError,
            r"unknown RoPE scaling option\(s\) factr; accepted: type, factor",
        ),
        ({"type": "yarn", "original_length": 8, "beta_fast": 1.0}, ValueError, r"beta_fast must exceed beta_slow"),
    ],
)
def test_bad_scaling_names_what_is_accepted(options: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        vispos.create_encoding("rope", dim=8, scaling=options)


def test_bad_scaling_type_object() -> None:
    with pytest.raises(TypeError, match=r"scaling must be None, a type name, a dict or RopeScaling"):
        vispos.create_encoding("rope", dim=8, scaling=2.0)


def test_rope2d_scaling_needs_train_grid_and_pixel_coords() -> None:
    with pytest.raises(ValueError, match=r"needs train_grid=\(H, W\)"):
        vispos.create_encoding("rope2d", dim=16, scaling="linear")
    with pytest.raises(ValueError, match=r"applies to coords='pixel'"):
        vispos.create_encoding("rope2d", dim=16, coords="normalized", scaling="linear", train_grid=(4, 4))
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
