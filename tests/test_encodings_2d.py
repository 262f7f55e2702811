"""2D schemes: each mathematical property against an independent reference (formulas, loops, timm)."""

from __future__ import annotations

import math

import pytest
import timm.layers
import torch

import vispos
from vispos.encodings.alibi import alibi_slopes
from vispos.encodings.learned import resample_table_2d
from vispos.encodings.relbias import log_spaced_offsets, relative_index_2d
from vispos.encodings.relbias_resize import resize_bias_table

HEADS, HEAD_DIM = 2, 16


def content_logits(rotary, h: int, w: int, dim: int = HEAD_DIM) -> torch.Tensor:
    """Logits [heads, HW, HW] between one fixed random q and one fixed random k placed at every patch, so
    that only the positional part varies between pairs."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, HEADS, 1, dim, generator=g, dtype=torch.float64).float().expand(1, HEADS, h * w, dim)
    k = torch.randn(1, HEADS, 1, dim, generator=g, dtype=torch.float64).float().expand(1, HEADS, h * w, dim)
    rq, rk = rotary.rotate(q, k)
    return (rq @ rk.transpose(-2, -1))[0].detach()


def offsets(h: int, w: int) -> list[tuple[int, int, int, int]]:
    """(query index, key index, dy, dx) for every pair of patches, row-major."""
    cells = [(y, x) for y in range(h) for x in range(w)]
    return [(i, j, yi - yj, xi - xj) for i, (yi, xi) in enumerate(cells) for j, (yj, xj) in enumerate(cells)]


def assert_depends_only_on_offset(logits: torch.Tensor, h: int, w: int) -> None:
    first: dict[tuple[int, int], tuple[int, int]] = {}
    spread = 0.0
    for i, j, dy, dx in offsets(h, w):
        i0, j0 = first.setdefault((dy, dx), (i, j))
        torch.testing.assert_close(logits[:, i, j], logits[:, i0, j0], atol=1e-4, rtol=1e-4)
        spread = max(spread, float((logits[:, i, j] - logits[:, 0, 0]).abs().max()))
    assert spread > 1e-2  # positions do matter


# --- rope2d ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("coords", ["pixel", "normalized"])
def test_rope2d_logits_depend_only_on_offset(layout: str, coords: str) -> None:
    h, w = 4, 5
    rotary = vispos.create_encoding("rope2d", dim=HEAD_DIM, layout=layout, coords=coords)((h, w))
    assert_depends_only_on_offset(content_logits(rotary, h, w), h, w)


@pytest.mark.parametrize("name", ["rope2d_mixed", "relbias2d", "cpb2d", "alibi2d"])
def test_relative_2d_schemes_depend_only_on_offset(name: str) -> None:
    h, w = 3, 4
    assert vispos.get_info(name).relative
    resized = {"train_grid": (2, 3)}  # relbias2d / cpb2d: evaluated away from their training grid
    options = {"rope2d_mixed": {"dim": HEAD_DIM}, "alibi2d": {}}.get(name, resized)
    module = vispos.create_encoding(name, num_heads=HEADS, **options)
    out = module((h, w))
    logits = (content_logits(out, h, w) if name == "rope2d_mixed" else out).detach()
    assert_depends_only_on_offset(logits, h, w)


def mixed_second_difference(logits: torch.Tensor, h: int, w: int) -> float:
    """max |L(dy, dx) - L(dy, 0) - L(0, dx) + L(0, 0)| over offsets from the top-left query."""
    table = logits[:, 0].reshape(-1, h, w)  # query (0, 0), key (y, x): offset (-y, -x)
    second = table - table[:, :, :1] - table[:, :1, :] + table[:, :1, :1]
    return float(second.abs().max())


def test_rope2d_logit_splits_into_x_and_y_terms() -> None:
    h, w = 4, 5
    axial = vispos.create_encoding("rope2d", dim=HEAD_DIM)((h, w))
    mixed = vispos.create_encoding("rope2d_mixed", dim=HEAD_DIM, num_heads=HEADS)((h, w))
    assert mixed_second_difference(content_logits(axial, h, w), h, w) < 1e-4
    assert mixed_second_difference(content_logits(mixed, h, w), h, w) > 1e-2  # relative, not separable


@pytest.mark.parametrize("coords", ["pixel", "normalized"])
def test_rope2d_turns_x_pairs_with_x_and_y_pairs_with_y(coords: str) -> None:
    """Pair j < d/4 turns by x * theta^(-4j/d), pair d/4 + j by y * theta^(-4j/d); half layout: j with j + d/2."""
    h, w, d, theta = 3, 4, HEAD_DIM, 100.0
    rotary = vispos.create_encoding("rope2d", dim=d, theta=theta, coords=coords)((h, w))
    x = torch.randn(1, 1, h * w, d, dtype=torch.float64)
    out = rotary.rotate(x.float(), x.float())[0][0, 0].double()
    for p, (y, xc) in enumerate((y, xc) for y in range(h) for xc in range(w)):
        cy, cx = (
            (y, xc)
            if coords == "pixel"
            else (2 * math.pi * ((y + 0.5) / h * 2 - 1), 2 * math.pi * ((xc + 0.5) / w * 2 - 1))
        )
        for j in range(d // 2):
            angle = (cx if j < d // 4 else cy) * theta ** (-4 * (j % (d // 4)) / d)
            a, b = float(x[0, 0, p, j]), float(x[0, 0, p, j + d // 2])
            expected = (a * math.cos(angle) - b * math.sin(angle), a * math.sin(angle) + b * math.cos(angle))
            assert float(out[p, j]) == pytest.approx(expected[0], abs=1e-5)
            assert float(out[p, j + d // 2]) == pytest.approx(expected[1], abs=1e-5)


@pytest.mark.parametrize("name", ["rope2d", "rope2d_mixed"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rotation_preserves_norms(name: str, layout: str) -> None:
    rotary = (
        vispos.create_encoding(name, dim=HEAD_DIM, num_heads=HEADS, layout=layout)((5, 6))
        if name == "rope2d_mixed"
        else (vispos.create_encoding(name, dim=HEAD_DIM, layout=layout)((5, 6)))
    )
    q, k = torch.randn(2, 2, HEADS, 30, HEAD_DIM).unbind(0)
    rq, rk = rotary.rotate(q, k)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close(rk.norm(dim=-1), k.norm(dim=-1))
    assert (rq - q).abs().max() > 1e-2


def half_to_interleaved(x: torch.Tensor) -> torch.Tensor:
    """Half-layout channel i (pair with i + d/2) -> interleaved channels 2i and 2i + 1."""
    d = x.shape[-1]
    perm = [c for i in range(d // 2) for c in (i, i + d // 2)]
    return x[..., perm]


@pytest.mark.parametrize("name", ["rope2d", "rope2d_mixed"])
def test_rope2d_layouts_give_same_logits_after_channel_permutation(name: str) -> None:
    h, w = 3, 4
    if name == "rope2d":
        half = vispos.create_encoding(name, dim=HEAD_DIM)((h, w))
        inter = vispos.create_encoding(name, dim=HEAD_DIM, layout="interleaved")((h, w))
    else:
        m_half = vispos.create_encoding(name, dim=HEAD_DIM, num_heads=HEADS)
        m_inter = vispos.create_encoding(name, dim=HEAD_DIM, num_heads=HEADS, layout="interleaved")
        m_inter.load_state_dict(m_half.state_dict())
        half, inter = m_half((h, w)), m_inter((h, w))
    q, k = torch.randn(2, 1, HEADS, h * w, HEAD_DIM).unbind(0)
    hq, hk = half.rotate(q, k)
    iq, ik = inter.rotate(half_to_interleaved(q), half_to_interleaved(k))
    torch.testing.assert_close(iq @ ik.transpose(-2, -1), hq @ hk.transpose(-2, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(iq, half_to_interleaved(hq), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["rope2d", "rope2d_mixed"])
def test_rotary_with_prefix_leaves_prefix_tokens_unrotated(name: str) -> None:
    module = vispos.create_encoding(name, dim=HEAD_DIM, num_heads=HEADS) if name == "rope2d_mixed" else None
    rotary = (module or vispos.create_encoding(name, dim=HEAD_DIM))((3, 4))
    padded = rotary.with_prefix(2)
    q, k = torch.randn(2, 1, HEADS, 2 + 12, HEAD_DIM).unbind(0)
    pq, pk = padded.rotate(q, k)
    assert torch.equal(pq[..., :2, :], q[..., :2, :]) and torch.equal(pk[..., :2, :], k[..., :2, :])
    rq, rk = rotary.rotate(q[..., 2:, :], k[..., 2:, :])
    assert torch.equal(pq[..., 2:, :], rq) and torch.equal(pk[..., 2:, :], rk)


# --- sincos2d --------------------------------------------------------------------------------------------
def vaswani_1d(pos: int, d: int, temperature: float = 1e4) -> list[float]:
    """PE[2i] = sin(pos / T^(2i/d)), PE[2i+1] = cos(pos / T^(2i/d))."""
    out = []
    for i in range(d // 2):
        angle = pos / temperature ** (2 * i / d)
        out += [math.sin(angle), math.cos(angle)]
    return out


@pytest.mark.parametrize(("h", "w", "dim"), [(3, 5, 16), (4, 4, 32)])
def test_sincos2d_equals_survey_formula(h: int, w: int, dim: int) -> None:
    table = vispos.create_encoding("sincos2d", dim=dim)((h, w))
    expected = [vaswani_1d(x, dim // 2) + vaswani_1d(y, dim // 2) for y in range(h) for x in range(w)]
    torch.testing.assert_close(table, torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0)


def test_sincos2d_matches_timm_up_to_channel_order() -> None:
    h, w, dim = 5, 7, 32
    ours = vispos.create_encoding("sincos2d", dim=dim)((h, w))
    theirs = timm.layers.build_sincos2d_pos_embed([h, w], dim=dim)
    distance = (ours.T[:, None] - theirs.T[None]).abs().amax(-1)  # [dim, dim]: column against column
    close = distance < 1e-6
    assert (close.sum(1) == 1).all() and (close.sum(0) == 1).all()  # each column matches exactly one
    match = close.float().argmax(1)
    assert sorted(match.tolist()) == list(range(dim))  # a permutation of the channels
    torch.testing.assert_close(ours, theirs[:, match], atol=1e-6, rtol=0)


# --- relbias2d / cpb2d -----------------------------------------------------------------------------------
def swin_relative_index(h: int, w: int) -> list[list[int]]:
    """Swin's relative_position_index, step by step as in its window attention, with loops."""
    coords = [(y, x) for y in range(h) for x in range(w)]
    index = []
    for yq, xq in coords:
        row = []
        for yk, xk in coords:
            dy, dx = yq - yk, xq - xk  # relative_coords = coords[:, :, None] - coords[:, None, :]
            dy, dx = dy + h - 1, dx + w - 1  # shift to start from 0
            row.append(dy * (2 * w - 1) + dx)
        index.append(row)
    return index


@pytest.mark.parametrize(("h", "w"), [(3, 3), (2, 5), (4, 3)])
def test_swin_relative_index_equals_swin_rule(h: int, w: int) -> None:
    index = relative_index_2d((h, w))
    assert index.tolist() == swin_relative_index(h, w)
    assert int(index.max()) == (2 * h - 1) * (2 * w - 1) - 1 and index.unique().numel() == (2 * h - 1) * (2 * w - 1)


def test_relbias2d_reproduces_its_table_at_the_training_grid() -> None:
    h, w = 3, 4
    module = vispos.create_encoding("relbias2d", num_heads=HEADS, train_grid=(h, w))
    bias = module((h, w)).detach()
    index = swin_relative_index(h, w)
    for head in range(HEADS):
        for i in range(h * w):
            for j in range(h * w):
                assert float(bias[head, i, j]) == float(module.table.detach()[index[i][j], head])
    table = module.table.detach()
    assert torch.equal(resize_bias_table(table, (h, w), (h, w)), table)


def test_relbias2d_resized_table_keeps_constants_and_the_zero_offset() -> None:
    h, w = 3, 4
    constant = torch.full(((2 * h - 1) * (2 * w - 1), HEADS), 0.7)
    for grid in [(5, 6), (2, 3), (3, 8)]:
        torch.testing.assert_close(
            resize_bias_table(constant, (h, w), grid), torch.full_like(resize_bias_table(constant, (h, w), grid), 0.7)
        )
    table = torch.randn((2 * h - 1) * (2 * w - 1), HEADS)
    bigger = resize_bias_table(table, (h, w), (5, 7))  # upsampling: the centre sample (dy = dx = 0) is kept
    torch.testing.assert_close(bigger[4 * 13 + 6], table[(h - 1) * (2 * w - 1) + (w - 1)], atol=1e-5, rtol=1e-5)


def test_cpb2d_inputs_are_swinv2_log_spaced_offsets() -> None:
    grid, train = (3, 4), (5, 6)
    table = log_spaced_offsets(grid, train)
    for a, dy in enumerate(range(-(grid[0] - 1), grid[0])):
        for b, dx in enumerate(range(-(grid[1] - 1), grid[1])):
            for c, (t, n) in enumerate(((dy, train[0]), (dx, train[1]))):
                t = t / (n - 1) * 8
                expected = math.copysign(math.log2(abs(t) + 1) / math.log2(8), t) if t else 0.0
                assert float(table[a, b, c]) == pytest.approx(expected, abs=1e-6)


def test_cpb2d_is_sixteen_sigmoid_of_its_mlp_on_the_offsets() -> None:
    h, w = 3, 3
    module = vispos.create_encoding("cpb2d", num_heads=HEADS, train_grid=(h, w), hidden=8)
    bias = module((h, w)).detach()
    inputs = log_spaced_offsets((h, w), (h, w))
    index = swin_relative_index(h, w)
    with torch.no_grad():
        for i in range(h * w):
            for j in range(h * w):
                r = index[i][j]
                expected = 16 * torch.sigmoid(module.mlp(inputs[r // (2 * w - 1), r % (2 * w - 1)]))
                torch.testing.assert_close(bias[:, i, j], expected)


# --- learned2d -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("factorized", [False, True])
def test_learned2d_reproduces_its_table_at_the_training_grid(factorized: bool) -> None:
    h, w, d = 3, 4, 8
    module = vispos.create_encoding("learned2d", dim=d, train_grid=(h, w), factorized=factorized)
    table = module.row[:, None] + module.col[None] if factorized else module.table
    torch.testing.assert_close(module((h, w)), table.reshape(h * w, d), atol=0, rtol=0)
    assert torch.equal(resample_table_2d(table, (h, w)), table)


@pytest.mark.parametrize("new_grid", [(6, 8), (2, 3), (5, 2)])
def test_learned2d_resampling_matches_timm(new_grid: tuple[int, int]) -> None:
    h, w, d = 4, 5, 8
    module = vispos.create_encoding("learned2d", dim=d, train_grid=(h, w))
    ours = module(new_grid).detach()
    theirs = timm.layers.resample_abs_pos_embed(
        module.table.detach().reshape(1, h * w, d), list(new_grid), old_size=[h, w], num_prefix_tokens=0
    )[0]
    torch.testing.assert_close(ours, theirs)


def test_learned2d_factorized_resamples_rows_and_columns_like_timm() -> None:
    h, w, d, new = 4, 5, 8, (7, 3)
    module = vispos.create_encoding("learned2d", dim=d, train_grid=(h, w), factorized=True)
    # the row table resampled as a 1 x H image: timm's own (new, 1) call hits a torch bug on width-1 outputs
    rows = timm.layers.resample_abs_pos_embed(module.row.detach()[None], [1, new[0]], [1, h], num_prefix_tokens=0)[0]
    cols = timm.layers.resample_abs_pos_embed(module.col.detach()[None], [1, new[1]], [1, w], num_prefix_tokens=0)[0]
    torch.testing.assert_close(module(new).detach(), (rows[:, None] + cols[None]).reshape(-1, d))


def test_width_one_tables_resample_like_their_transpose() -> None:
    """Bicubic resampling is separable and symmetric in H and W: an (H, 1) table must resample like (1, H)."""
    column = torch.randn(4, 1, 3)
    torch.testing.assert_close(
        resample_table_2d(column, (7, 1)), resample_table_2d(column.transpose(0, 1), (1, 7)).transpose(0, 1)
    )
    bias = torch.randn(5, HEADS)  # relbias table of a (3, 1) grid: offsets dy in -2..2
    torch.testing.assert_close(resize_bias_table(bias, (3, 1), (5, 1)), resize_bias_table(bias, (1, 3), (1, 5)))
    single = vispos.create_encoding("learned2d", dim=1, train_grid=(4, 1))  # one channel: the worst case for torch
    expected = resample_table_2d(single.table.detach().transpose(0, 1), (1, 6)).reshape(6, 1)
    torch.testing.assert_close(single((6, 1)).detach(), expected)


# --- alibi2d ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("heads", "slopes"),
    [
        (4, [2**-2, 2**-4, 2**-6, 2**-8]),
        (6, [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]),  # 4 of n = 4, then every other one of n = 8
        (8, [2**-1, 2**-2, 2**-3, 2**-4, 2**-5, 2**-6, 2**-7, 2**-8]),
    ],
)
def test_alibi2d_slopes_follow_alibi_rule(heads: int, slopes: list[float]) -> None:
    h, w = 3, 4
    torch.testing.assert_close(alibi_slopes(heads), torch.tensor(slopes))
    bias = vispos.create_encoding("alibi2d", num_heads=heads)((h, w))
    for i, j, dy, dx in offsets(h, w):
        for head in range(heads):
            assert float(bias[head, i, j]) == pytest.approx(-slopes[head] * math.hypot(dy, dx), rel=1e-6)
