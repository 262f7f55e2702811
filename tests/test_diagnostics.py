"""The diagnostics themselves: each measure is zero on maps built to have its property and clearly
non-zero on maps built without it (a measure that cannot fail proves nothing), plus the API and CLI."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import vispos
from vispos.diagnostics import (
    axis_pairs,
    cross_term,
    layer_logits,
    mixed_difference,
    offset_ids,
    offset_map,
    query_map,
    scheme_logits,
    separability_error,
    translation_error,
)
from vispos.diagnostics.__main__ import main

GRID = (4, 6)
H, W = GRID
N = H * W
FP = 1e-10  # the measures run in fp64: exact properties measure at rounding level of fp64
SEEDS = (0, 1, 2)


def rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def coords() -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major (y, x) of each grid index. [N], [N]."""
    return torch.arange(N) // W, torch.arange(N) % W


def relative_map(s: torch.Tensor) -> torch.Tensor:
    """L(p, q) = S[dy, dx] with (dy, dx) = q - p: [..., 2H-1, 2W-1] -> [..., N, N]."""
    return s.flatten(-2)[..., offset_ids(GRID)]


# --- separability ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_separability_error_zero_exactly_on_additive_tables(seed: int) -> None:
    f, g = rand(seed, 3, 9, 1), rand(seed + 1, 3, 1, 11)
    assert (separability_error(f + g) < FP).all()
    assert (separability_error(f * g) > 0.5).all()  # a product of non-constant factors is not a sum
    bump = (f + g).clone()
    bump[:, 4, 5] += 1.0  # one entry off: detected
    assert (separability_error(bump) > 0.05).all()


@pytest.mark.parametrize("seed", SEEDS)
def test_mixed_difference_vanishes_with_the_separability_error(seed: int) -> None:
    f, g = rand(seed, 9, 1), rand(seed + 1, 1, 11)
    assert mixed_difference(f + g).abs().max() < FP
    assert mixed_difference(f + g, anchor=(2, 7)).abs().max() < FP
    t = rand(seed + 2, 9, 11)
    assert mixed_difference(t).abs().max() > 0.1
    # the double-centred interaction is the mixed second difference averaged over every anchor
    mean_over_anchors = torch.stack([mixed_difference(t, anchor=(a, b)) for a in range(9) for b in range(11)]).mean(0)
    interaction = t - t.mean(-1, keepdim=True) - t.mean(-2, keepdim=True) + t.mean()
    torch.testing.assert_close(mean_over_anchors, interaction)


def test_separability_error_is_a_fraction_of_the_spread() -> None:
    t = rand(0, 64, 7, 8)
    err = separability_error(t)
    assert ((err > 0) & (err <= 1)).all()
    assert torch.allclose(separability_error(3.0 * t + 5.0), err)  # scale and offset free


@pytest.mark.parametrize("seed", SEEDS)
def test_cross_term_zero_on_axis_separable_maps_absolute_or_relative(seed: int) -> None:
    py, px = coords()
    fx, gy = rand(seed, W, W), rand(seed + 1, H, H)
    absolute = fx[px[:, None], px[None, :]] + gy[py[:, None], py[None, :]]  # F(px, qx) + G(py, qy), not relative
    assert cross_term(absolute, GRID) < FP
    assert translation_error(absolute, GRID) > 0.1
    sx, sy = rand(seed + 2, 1, 2 * W - 1), rand(seed + 3, 2 * H - 1, 1)
    assert cross_term(relative_map(sx + sy), GRID) < FP  # S = f(dx) + g(dy)


@pytest.mark.parametrize("seed", SEEDS)
def test_cross_term_nonzero_when_x_meets_y(seed: int) -> None:
    py, px = coords()
    a, b = rand(seed, W), rand(seed + 1, H)
    leak = a[px][:, None] * b[py][None, :]  # query x times key y: the survey's Q_row K_col^T
    assert cross_term(leak, GRID) > 0.5
    sx, sy = rand(seed + 2, 1, 2 * W - 1), rand(seed + 3, 2 * H - 1, 1)
    product = relative_map(sx * sy)  # relative but S = f(dx) g(dy)
    assert cross_term(product, GRID) > 0.1
    assert translation_error(product, GRID) < FP
    assert cross_term(rand(seed, N, N), GRID) > 0.5


def test_axis_pairs_regroups_by_axis() -> None:
    logits = rand(0, 2, N, N)
    pairs = axis_pairs(logits, GRID)  # [2, W*W, H*H]
    assert pairs.shape == (2, W * W, H * H)
    (py, px), (qy, qx) = (1, 2), (3, 5)
    assert pairs[1, px * W + qx, py * H + qy] == logits[1, py * W + px, qy * W + qx]


# --- translation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_translation_error_zero_exactly_on_relative_maps(seed: int) -> None:
    s = rand(seed, 3, 2 * H - 1, 2 * W - 1)
    logits = relative_map(s)
    assert (translation_error(logits, GRID) < FP).all()
    torch.testing.assert_close(offset_map(logits, GRID), s)  # the offset map recovers S
    shifted = logits.clone()
    shifted[:, 5, 11] += 1.0  # one pair off: detected
    assert (translation_error(shifted, GRID) > 0.01).all()
    assert (translation_error(rand(seed, 3, N, N), GRID) > 0.5).all()


def test_offsets_are_key_minus_query() -> None:
    ids = offset_ids(GRID)
    p, q = 1 * W + 2, 3 * W + 1  # query (y=1, x=2), key (y=3, x=1): (dy, dx) = (2, -1)
    assert ids[p, q] == (2 + H - 1) * (2 * W - 1) + (-1 + W - 1)
    s = torch.zeros(2 * H - 1, 2 * W - 1, dtype=torch.float64)
    s[H - 1 + 2, W - 1 - 1] = 1.0
    assert relative_map(s)[p, q] == 1.0


def test_one_dimensional_maps_are_a_one_row_grid() -> None:
    n = 9
    i = torch.arange(n)
    s = rand(0, 2 * n - 1)
    relative = s[i[None, :] - i[:, None] + n - 1]
    assert translation_error(relative, n) < FP
    causal = relative.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    assert translation_error(causal, n) < FP  # masked entries are left out
    assert translation_error(rand(0, n, n), n) > 0.5
    assert offset_map(causal, n).shape == (1, 2 * n - 1)
    assert offset_map(causal, n)[0, n:].isnan().all()  # later keys never visible


def test_constant_map_has_no_positional_scale() -> None:
    const = torch.full((2, N, N), 3.0)
    assert translation_error(const, GRID).isnan().all()
    assert cross_term(const, GRID).isnan().all()


def test_measures_reject_maps_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match="H \\* W = 24"):
        translation_error(torch.zeros(N + 1, N + 1), GRID)
    with pytest.raises(ValueError, match="outside the grid"):
        query_map(torch.zeros(N, N), GRID, query=(H, 0))


def test_query_map_is_one_row_of_the_map() -> None:
    logits = rand(0, 3, N, N)
    m = query_map(logits, GRID, query=(1, 4))
    assert m.shape == (3, H, W)
    assert torch.equal(m[2, 3, 0], logits[2, 1 * W + 4, 3 * W + 0])


# --- logits API --------------------------------------------------------------------------------------


def test_scheme_logits_shapes_and_errors() -> None:
    rope = vispos.create_encoding("rope2d", ndim=2, dim=8)
    q, k = torch.randn(3, 8), torch.randn(8)
    assert scheme_logits(rope, GRID, q=q, k=k).shape == (3, N, N)
    with pytest.raises(ValueError, match="needs content vectors"):
        scheme_logits(rope, GRID)
    table = vispos.create_encoding("sincos2d", ndim=2, dim=16)
    with pytest.raises(ValueError, match="needs projections wq= and wk="):
        scheme_logits(table, GRID, q=q, k=k)
    bias = vispos.create_encoding("alibi2d", ndim=2, num_heads=3)
    torch.testing.assert_close(scheme_logits(bias, GRID), bias(GRID))  # the bias is the position part
    assert torch.equal(scheme_logits(vispos.create_encoding("nope"), GRID), torch.zeros(1, N, N))
    with pytest.raises(TypeError, match="vispos.create_encoding"):
        scheme_logits(torch.nn.Linear(2, 2), GRID)
    with pytest.raises(ValueError, match="tensor \\[N\\]"):
        scheme_logits(vispos.create_encoding("rope", ndim=1, dim=8), torch.zeros(2, 5, dtype=torch.long), q=q, k=k)


def test_scheme_logits_rotary_matches_a_direct_computation() -> None:
    rope = vispos.create_encoding("rope", ndim=1, dim=8)
    q, k = torch.randn(8), torch.randn(8)
    rot = rope(5)
    qs, ks = rot.rotate(q.expand(1, 1, 5, 8), k.expand(1, 1, 5, 8))
    torch.testing.assert_close(scheme_logits(rope, 5, q=q, k=k)[0], (qs @ ks.transpose(-2, -1))[0, 0] / math.sqrt(8))


def test_layer_logits_requires_a_patched_model() -> None:
    model = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=0)
    with pytest.raises(ValueError, match="not patched"):
        layer_logits(model, (4, 4))
    vispos.patch(model, "rope2d")
    with pytest.raises(ValueError, match="out of range"):
        layer_logits(model, (4, 4), layer=1)
    assert layer_logits(model, (3, 5), content=torch.randn(32)).shape == (2, 15, 15)  # any grid


def tiny_vit(scheme: str | list[str]) -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=0)
    return vispos.patch(model, scheme).eval()


@pytest.mark.parametrize("scheme", ["rope2d", "rope2d_mixed"])
def test_layer_logits_of_a_rotary_scheme_needs_content(scheme: str) -> None:
    """Zero tokens give a rotation nothing to turn (all-zero logits, NaN measures): refused, naming content=."""
    model = tiny_vit(scheme)
    with pytest.raises(ValueError, match=rf"layer_logits on {scheme} \(rotary\) needs content= \[32\]"):
        layer_logits(model, (4, 4))
    with torch.no_grad():
        logits = layer_logits(model, (4, 4), content=torch.randn(32))
    assert logits.abs().max() > 0 and translation_error(logits, (4, 4)).isfinite().all()


@pytest.mark.parametrize("scheme", ["learned2d", "alibi2d", ["learned2d", "rope2d"]])
def test_layer_logits_without_content_is_the_position_only_part(scheme: str | list[str]) -> None:
    """Where position alone makes logits (an additive table, a bias), content=None is their position-only part:
    the tokens are the table alone, i.e. the map equals the one for content 0 and is not constant."""
    model = tiny_vit(scheme)
    with torch.no_grad():
        default, zero = layer_logits(model, (4, 4)), layer_logits(model, (4, 4), content=torch.zeros(32))
    torch.testing.assert_close(default, zero, rtol=0, atol=0)
    assert default.std() > 0


@pytest.mark.parametrize("content", [torch.randn(16), torch.randn(2, 32), [1.0] * 32])
def test_layer_logits_content_must_be_one_token_vector(content: object) -> None:
    with pytest.raises((TypeError, ValueError), match=r"content must be a tensor \[32\]"):
        layer_logits(tiny_vit("rope2d"), (4, 4), content=content)


@pytest.mark.parametrize("log_n", [False, True])
@pytest.mark.parametrize("scheme", ["rope2d", "alibi2d", ["learned2d", "relbias2d"]])
def test_layer_logits_equal_the_logits_the_patched_attention_feeds_to_sdpa(
    scheme: str | list[str], log_n: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The diagnostics and the forward pass share one q/k path, logit scale (log-n) and mask included."""
    torch.manual_seed(0)
    model = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=0)
    vispos.patch(model, scheme).eval()
    vispos.configure(model, log_n_attention=log_n)
    grid, content = (6, 5), torch.randn(32)  # above the 4x4 training grid: log-n scale 1.29 when on
    fed = {}

    def recording_sdpa(q, k, v, *, mask=None, scale=None, **_):  # noqa: ANN001, ANN202
        fed["logits"] = ((q @ k.transpose(-2, -1)) * scale + (0 if mask is None else mask))[0]
        return torch.zeros_like(q)

    monkeypatch.setattr("vispos.timm.attention.sdpa", recording_sdpa)
    with torch.no_grad():  # the block's input is exactly the tokens layer_logits builds (norm=True)
        model.blocks[0].attn(model.blocks[0].norm1(model.norm_pre(model._pos_embed(
            torch.zeros(1, *grid, 32) + content))), attn_mask=model.vispos.context(grid, torch.device("cpu")))
        diagnosed = layer_logits(model, grid, content=content, norm=True)
    p = model.num_prefix_tokens
    torch.testing.assert_close(diagnosed, fed["logits"][:, p:, p:], rtol=0, atol=0)
    assert model.vispos.logit_scale(grid) == (pytest.approx(math.log(30) / math.log(16)) if log_n else 1.0)


# --- report and CLI ----------------------------------------------------------------------------------


def test_cli_writes_table_and_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = torch.random.get_rng_state()
    assert main(["--out", str(tmp_path), "--grid", "5", "5", "--embed-dim", "32", "--heads", "2"]) == 0
    assert torch.equal(torch.random.get_rng_state(), state)  # the report leaves global RNG state alone
    for name in ("diagnostics.md", "logit_maps.png", "measures.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "logit_maps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (tmp_path / "diagnostics.md").read_text()
    assert table in capsys.readouterr().out
    rows = {line.split("|")[1].strip(" `"): line for line in table.splitlines() if line.startswith("| `")}
    assert sorted(rows) == vispos.list_encodings(ndim=2)
    for name, row in rows.items():  # the measured verdicts agree with the registry's declarations
        cells = [c.strip() for c in row.split("|")]
        declared, measured = cells[3], cells[5]
        if name == "nope":
            assert measured == "n/a"
        else:
            assert declared == measured, row
    assert rows["rope2d"].split("|")[7].strip() == "yes"  # separable
    for name in ("sincos2d", "learned2d", "rope2d_mixed"):
        assert rows[name].split("|")[7].strip() == "no"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--heads", "5"], r"--embed-dim 128 must be divisible by --heads 5"),
        (["--heads", "0"], r"--embed-dim and --heads must be >= 1, got 128 and 0"),
        (["--heads", "-2"], r"--embed-dim and --heads must be >= 1"),
        (["--embed-dim", "0"], r"--embed-dim and --heads must be >= 1"),
        (["--embed-dim", "24", "--heads", "2"], r"\(head dim 12\) does not fit \w+: .*(divisible by|must be >=)"),
        (["--embed-dim", "8", "--heads", "2"], r"\(head dim 4\) does not fit \w+"),
        (["--grid", "1", "5"], r"--grid needs at least 2 patches per axis"),
        (["--grid", "0", "-3"], r"--grid needs at least 2 patches per axis"),
        (["--seed", str(2**70)], r"--seed must fit in 64 bits"),
        (["--heads", "four"], r"argument --heads: invalid int value: 'four'"),  # argparse's own
        (["--grid", "5"], r"argument --grid: expected 2 arguments"),
    ],
)
def test_cli_bad_input_is_one_error_line_and_exit_2(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path / "report"), *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("python -m vispos.diagnostics: error: "), err
    assert "Traceback" not in err
    assert re.search(message, errors[0]), errors[0]
    assert not (tmp_path / "report").exists() or not any((tmp_path / "report").iterdir())  # nothing was written


def test_cli_bad_out_folder_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    for out, message in ((a_file, r"is a file; give a folder"), (a_file / "sub", r"cannot create the folder")):
        with pytest.raises(SystemExit) as exit_info:
            main(["--out", str(out), "--grid", "3", "3", "--embed-dim", "32", "--heads", "2"])
        assert exit_info.value.code == 2
        assert re.search(message, capsys.readouterr().err.splitlines()[-1])


def test_cli_entry_point_bad_head_count_exits_2_without_traceback(tmp_path: Path) -> None:
    """The probe as a user runs it: python -m vispos.diagnostics --heads 5."""
    run = subprocess.run(
        [sys.executable, "-m", "vispos.diagnostics", "--out", str(tmp_path), "--heads", "5"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "python -m vispos.diagnostics: error: --embed-dim 128 must be divisible by --heads 5"
    )
