"""Golden-gate RoPE and Circulant-STRING against their sources' definitions.

- ``rope2d_golden`` against golden-gate RoPE (Xiong 2025, jerryxio.ng/posts/nd-rope; its 2D module
  ``GoldenGateRoPE2d``), transcribed below with the reference's defaults: directions (h F + f) x pi / phi
  continued over the heads, magnitudes log-spaced from 0.2 to 20 (its ImageNet setting), coordinates
  linspace(-sqrt(W/H), sqrt(W/H), W) x linspace(-sqrt(H/W), sqrt(H/W), H), pairs (f, f + F);
- the direction gap each ``spacing`` leaves on the half turn, by the reference's rule;
- ``string2d(variant="circulant")`` against STRING's Circulant-STRING (Schenck et al. 2025):
  R(p) = matrix_exp(x L_x + y L_y) with L_k = C_k - C_k^T, C_k circulant, built densely here;
  orthogonal, commuting, exactly relative, through a patched model, compiled and under bf16 autocast.
"""

from __future__ import annotations

import math

import pytest
import timm
import torch
from torch import nn

import vispos
from vispos.diagnostics import cross_term, scheme_logits, translation_error

HEADS, HEAD_DIM = 3, 16
FP, CLEAR = 1e-4, 1e-2
SEEDS = (0, 1)


def content(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# --- golden-gate RoPE: the reference, transcribed ------------------------------------------------------


def reference_golden_rotate(
    x: torch.Tensor,  # [B, H, W, heads, d]
    *,
    min_freq: float = 0.2,
    max_freq: float = 20.0,
    p_zero_freqs: float = 0.0,
    direction_spacing: float = math.pi * (math.sqrt(5) - 1) / 2,
) -> torch.Tensor:
    """GoldenGateRoPE2d's forward on x [B, H, W, heads, d], float64."""
    _, h, w, heads, d = x.shape
    n_freqs = d // 2
    n_zero = round(p_zero_freqs * n_freqs)
    ramp = torch.linspace(0, 1, n_freqs - n_zero, dtype=torch.float64)
    omega = torch.cat((torch.zeros(n_zero, dtype=torch.float64), min_freq * (max_freq / min_freq) ** ramp))  # [F]
    phi = torch.arange(heads * n_freqs, dtype=torch.float64).reshape(heads, n_freqs) * direction_spacing
    freqs = omega[:, None] * torch.stack((phi.cos(), phi.sin()), dim=-1)  # [heads, F, 2]
    xlim, ylim = math.sqrt(w / h), math.sqrt(h / w)
    xs = torch.linspace(-xlim, xlim, w, dtype=torch.float64).reshape(1, w).expand(h, w)
    ys = torch.linspace(-ylim, ylim, h, dtype=torch.float64).reshape(h, 1).expand(h, w)
    pos = torch.stack((xs, ys), dim=-1).reshape(h, w, 1, 1, 2)
    theta = (freqs * pos).sum(-1)  # [H, W, heads, F]
    a, b = x.double().chunk(2, dim=-1)
    return torch.cat((a * theta.cos() - b * theta.sin(), a * theta.sin() + b * theta.cos()), dim=-1)


@pytest.mark.parametrize("grid", [(4, 4), (3, 5), (1, 6)])
@pytest.mark.parametrize(
    ("options", "reference"),
    [
        ({}, {}),  # the defaults are the reference's
        (
            {"zero_freqs": 0.25, "min_freq": 0.5, "max_freq": 40.0},
            {"p_zero_freqs": 0.25, "min_freq": 0.5, "max_freq": 40.0},
        ),
        ({"spacing": "golden_angle"}, {"direction_spacing": math.pi * (3 - math.sqrt(5))}),
    ],
)
def test_rope2d_golden_rotates_q_and_k_as_golden_gate_rope(
    grid: tuple[int, int], options: dict, reference: dict
) -> None:
    h, w = grid
    enc = vispos.create_encoding("rope2d_golden", dim=HEAD_DIM, num_heads=HEADS, **options)
    q, k = content(0, 2, HEADS, h * w, HEAD_DIM), content(1, 2, HEADS, h * w, HEAD_DIM)
    rq, rk = enc(grid).rotate(q, k)
    for got, x in ((rq, q), (rk, k)):
        tokens = x.permute(0, 2, 1, 3).reshape(2, h, w, HEADS, HEAD_DIM)  # [B, H, W, heads, d]
        expected = reference_golden_rotate(tokens, **reference).reshape(2, h * w, HEADS, HEAD_DIM).permute(0, 2, 1, 3)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_rope2d_golden_gives_every_head_its_own_directions() -> None:
    freqs = vispos.create_encoding("rope2d_golden", dim=HEAD_DIM, num_heads=HEADS).freqs.double()  # [heads, 2, F]
    angle = torch.atan2(freqs[:, 1], freqs[:, 0])  # [heads, F]
    n = torch.arange(HEADS * HEAD_DIM // 2, dtype=torch.float64).reshape(HEADS, -1)  # the sequence over heads
    turn = torch.remainder(angle - n * math.pi * (math.sqrt(5) - 1) / 2 + math.pi, 2 * math.pi) - math.pi
    torch.testing.assert_close(turn, torch.zeros_like(turn), rtol=0, atol=1e-6)
    shared = vispos.create_encoding("rope2d_golden", dim=HEAD_DIM, num_heads=HEADS, per_head=False).freqs
    torch.testing.assert_close(shared, shared[:1].expand_as(shared), rtol=0, atol=0)  # per_head=False: alike


def test_rope2d_golden_table_stays_fp32_through_module_casts() -> None:
    enc = vispos.create_encoding("rope2d_golden", dim=HEAD_DIM, num_heads=HEADS)
    exact = enc.freqs.clone()
    enc.to(torch.bfloat16)
    assert enc.freqs.dtype == torch.float32
    torch.testing.assert_close(enc.freqs, exact, rtol=0, atol=0)


def largest_gap_degrees(directions: torch.Tensor) -> float:
    """The widest empty arc between frequency directions [2, n] on the half turn (a direction and its
    opposite turn a pair alike), degrees."""
    angle = torch.remainder(torch.atan2(directions[1].double(), directions[0].double()), math.pi).sort().values
    gaps = torch.cat((angle.diff(), (angle[:1] + math.pi - angle[-1])))
    return math.degrees(gaps.max().item())


@pytest.mark.parametrize("spacing", ["golden_angle", "pi_over_phi"])
def test_direction_gap_is_the_reference_rule(spacing: str) -> None:
    """At head dim 16 (8 pairs) on one head the directions n x spacing (n < 8) leave the gap their rule
    gives: the golden angle 42.5 degrees, pi / phi 26.3, against an ideal 180 / 8 = 22.5."""
    step = {"golden_angle": math.pi * (3 - math.sqrt(5)), "pi_over_phi": math.pi * (math.sqrt(5) - 1) / 2}[spacing]
    rule = sorted((n * step) % math.pi for n in range(8))
    expected = math.degrees(max([b - a for a, b in zip(rule, rule[1:], strict=False)] + [rule[0] + math.pi - rule[-1]]))
    enc = vispos.create_encoding("rope2d_golden", dim=16, num_heads=1, spacing=spacing)
    assert largest_gap_degrees(enc.freqs[0]) == pytest.approx(expected, abs=1e-4)
    assert expected == pytest.approx({"golden_angle": 42.49, "pi_over_phi": 26.26}[spacing], abs=0.01)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"theta": 100.0, "min_freq": 1.0}, r"theta .* or min_freq / max_freq"),
        ({"min_freq": 2.0, "max_freq": 1.0}, r"max_freq must be >= min_freq"),
        ({"zero_freqs": 1.5}, r"zero_freqs .* \[0, 1\]"),
        ({"spacing": "golden"}, r"accepted: pi_over_phi, golden_angle"),
    ],
)
def test_rope2d_golden_refuses_conflicting_options(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        vispos.create_encoding("rope2d_golden", dim=HEAD_DIM, num_heads=HEADS, **options)


def test_string2d_golden_follows_the_per_head_directions() -> None:
    string = vispos.create_encoding("string2d", dim=HEAD_DIM, num_heads=HEADS, freqs="golden")
    golden = vispos.create_encoding("rope2d_golden", dim=HEAD_DIM, num_heads=HEADS, theta=10.0)
    torch.testing.assert_close(string.freqs, golden.freqs, rtol=0, atol=0)
    assert (string.freqs[0] - string.freqs[1]).abs().max() > CLEAR


# --- Circulant-STRING ----------------------------------------------------------------------------------


def circulant_string(seed: int, **options: object) -> nn.Module:
    enc = vispos.create_encoding("string2d", dim=HEAD_DIM, num_heads=HEADS, variant="circulant", **options)
    with torch.no_grad():
        enc.circulant.copy_(content(100 + seed, *enc.circulant.shape) * 0.3)  # no property may rest on the init
    return enc


def dense_generators(c: torch.Tensor) -> torch.Tensor:
    """L = C - C^T [..., d, d] with C[i, j] = c[(i - j) mod d] (the circulant of first column c [..., d])."""
    d = c.shape[-1]
    i, j = torch.meshgrid(torch.arange(d), torch.arange(d), indexing="ij")
    big = c.double()[..., (i - j) % d]  # [..., d, d]
    return big - big.transpose(-1, -2)


def pixel_xy(grid: tuple[int, int]) -> torch.Tensor:
    ys, xs = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    return torch.stack((xs.flatten(), ys.flatten()), dim=-1).double()  # (x, y) per patch, row-major


@pytest.mark.parametrize("seed", SEEDS)
def test_circulant_string_is_the_matrix_exponential_of_its_circulant_generators(seed: int) -> None:
    grid = (3, 4)
    enc = circulant_string(seed)
    gens = dense_generators(enc.circulant.detach())  # [heads, 2, d, d]
    torch.testing.assert_close(gens[:, 0] @ gens[:, 1], gens[:, 1] @ gens[:, 0], rtol=0, atol=1e-10)  # commute
    xy = pixel_xy(grid)  # [N, 2]
    total = xy[None, :, 0, None, None] * gens[:, None, 0] + xy[None, :, 1, None, None] * gens[:, None, 1]
    rotations = torch.linalg.matrix_exp(total)  # [heads, N, d, d]
    eye = torch.eye(HEAD_DIM, dtype=torch.float64)
    torch.testing.assert_close(rotations.transpose(-1, -2) @ rotations, eye.expand_as(rotations), rtol=0, atol=1e-10)
    q, k = content(seed, 2, HEADS, 12, HEAD_DIM), content(seed + 7, 2, HEADS, 12, HEAD_DIM)
    rq, rk = enc(grid).rotate(q, k)
    torch.testing.assert_close(rq.double(), (rotations @ q.double()[..., None])[..., 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rk.double(), (rotations @ k.double()[..., None])[..., 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1), rtol=1e-5, atol=1e-5)  # orthogonal


@pytest.mark.parametrize("seed", SEEDS)
def test_circulant_string_is_exactly_relative_with_cross_terms(seed: int) -> None:
    enc = circulant_string(seed)
    out = scheme_logits(enc, (5, 7), q=content(seed, HEADS, HEAD_DIM), k=content(seed + 7, HEADS, HEAD_DIM))
    assert translation_error(out, (5, 7)).max() < FP
    assert cross_term(out, (5, 7)).min() > CLEAR


def test_circulant_string_starts_at_rope_mixed_frequencies() -> None:
    torch.manual_seed(0)
    enc = vispos.create_encoding("string2d", dim=HEAD_DIM, num_heads=HEADS, variant="circulant")
    torch.manual_seed(0)
    mixed = vispos.create_encoding("rope2d_mixed", dim=HEAD_DIM, num_heads=HEADS).freqs.detach()  # [2, heads, F]
    rates = enc.spectrum().detach()  # [heads, 2, F + 1]
    torch.testing.assert_close(rates[..., 1:-1], mixed.transpose(0, 1)[..., :-1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rates[..., [0, -1]], torch.zeros(HEADS, 2, 2), rtol=0, atol=1e-6)


def test_circulant_prefix_tokens_stay_unrotated_and_points_match_cells() -> None:
    enc = circulant_string(0)
    q = content(3, 1, HEADS, 1 + 12, HEAD_DIM)
    rq, _ = enc((3, 4)).with_prefix(1).rotate(q, q)
    torch.testing.assert_close(rq[:, :, 0], q[:, :, 0], rtol=0, atol=1e-6)
    cells = torch.tensor([[0, 0], [1, 2], [2, 3]])
    at = enc((3, 4), cells=cells.float())
    full = enc((3, 4))
    index = cells[:, 0] * 4 + cells[:, 1]
    torch.testing.assert_close(at.cos, full.cos[:, index], rtol=0, atol=1e-6)


def test_circulant_string_refuses_cayley_options_and_folding() -> None:
    for options in ({"freqs": "axial"}, {"layout": "interleaved"}):
        with pytest.raises(ValueError, match=r"variant='circulant'.*apply to variant='cayley'"):
            vispos.create_encoding("string2d", dim=HEAD_DIM, num_heads=HEADS, variant="circulant", **options)
    model = vispos.patch(timm.create_model("vit_tiny_patch16_224", img_size=32, depth=1), "string2d",
                         variant="circulant")  # fmt: skip
    with pytest.raises(ValueError, match=r"fold_string folds Cayley-STRING.*circulant"):
        vispos.encodings.fold_string(model)


def tiny_circulant(**kwargs: object) -> nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=64, depth=2, num_classes=5, **kwargs)
    return vispos.patch(model, "string2d", variant="circulant")


def test_circulant_string_trains_through_a_patched_vit_compiled_as_one_graph() -> None:
    model = tiny_circulant().train()
    x = torch.randn(2, 3, 64, 96)
    model(x).sum().backward()
    assert all(m.circulant.grad is not None and m.circulant.grad.abs().max() > 0 for m in model.vispos.attention)
    torch.compiler.reset()
    try:
        compiled = torch.compile(model.eval(), backend="eager", fullgraph=True)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x))
            with torch._dynamo.config.patch(error_on_recompile=True):
                compiled(torch.randn(2, 3, 64, 96))
    finally:
        torch.compiler.reset()


def test_circulant_string_under_bf16_autocast_and_in_bf16() -> None:
    model = tiny_circulant().eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = model(x)
    assert torch.isfinite(auto).all()
    torch.testing.assert_close(auto.float(), ref, rtol=0.1, atol=0.1)
    enc = circulant_string(0).to(torch.bfloat16)
    q = content(4, 1, HEADS, 12, HEAD_DIM).to(torch.bfloat16)
    rq, rk = enc((3, 4)).rotate(q, q)
    assert rq.dtype == rk.dtype == torch.bfloat16
    fp32 = circulant_string(0)((3, 4)).rotate(q.float(), q.float())[0]
    torch.testing.assert_close(rq.float(), fp32, rtol=0.05, atol=0.05)
