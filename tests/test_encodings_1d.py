"""1D schemes: each mathematical property against an independent reference (formulas, loops)."""

from __future__ import annotations

import math

import pytest
import torch

import vispos
from vispos.attention import shaw_attention
from vispos.encodings.alibi import alibi_slopes
from vispos.encodings.shaw import shaw_index
from vispos.encodings.t5 import t5_bucket

HEADS, HEAD_DIM = 2, 8


def pair_channels(d: int, layout: str) -> list[tuple[int, int]]:
    """The channels of rotary pair i: (i, i + d/2) in the half layout, (2i, 2i + 1) interleaved."""
    return [(i, i + d // 2) if layout == "half" else (2 * i, 2 * i + 1) for i in range(d // 2)]


def rotary_logit_reference(
    q: torch.Tensor, k: torch.Tensor, n: int, m: int, theta: float, layout: str, zeta_power: float | None = None
) -> float:
    """q at position n, k at m: sum over pairs of q_i^T R((m - n) w_i) k_i, pair i weighted by zeta_i^power."""
    d = q.shape[-1]
    total = 0.0
    for i, (c1, c2) in enumerate(pair_channels(d, layout)):
        a, b, c, e = float(q[c1]), float(q[c2]), float(k[c1]), float(k[c2])
        alpha = (m - n) * theta ** (-2 * i / d)
        term = (a * c + b * e) * math.cos(alpha) + (b * c - a * e) * math.sin(alpha)
        if zeta_power is not None:
            term *= ((2 * i + 0.4 * d) / (1.4 * d)) ** zeta_power
        total += term
    return total


def rotate_one(rotary, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One q and one k vector [d] placed at every position -> rotated [N, d] each."""
    n = rotary.cos.shape[-2]
    rq, rk = rotary.rotate(q.expand(1, 1, n, -1), k.expand(1, 1, n, -1))
    return rq[0, 0], rk[0, 0]


# --- rope / xpos -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_logits_depend_only_on_relative_position(layout: str) -> None:
    n, theta = 12, 10000.0
    q, k = torch.randn(2, HEAD_DIM)
    rope = vispos.create_encoding("rope", dim=HEAD_DIM, layout=layout)
    rq, rk = rotate_one(rope(n), q, k)
    logits = rq @ rk.T
    for i in range(n):
        for j in range(n):
            assert float(logits[i, j]) == pytest.approx(rotary_logit_reference(q, k, i, j, theta, layout), abs=1e-4)
            torch.testing.assert_close(logits[i, j], logits[i - min(i, j), j - min(i, j)], atol=1e-4, rtol=1e-4)
    shifted = rope(torch.arange(n) + 1000)  # all positions shifted: same logits
    sq, sk = rotate_one(shifted, q, k)
    torch.testing.assert_close(sq @ sk.T, logits, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_xpos_decays_with_distance_by_zeta_power(layout: str) -> None:
    n, theta, scale_base = 10, 10000.0, 4.0
    q, k = torch.randn(2, HEAD_DIM)
    xpos = vispos.create_encoding("xpos", dim=HEAD_DIM, scale_base=scale_base, layout=layout)
    rq, rk = rotate_one(xpos(n), q, k)
    logits = rq @ rk.T
    for i in range(n):
        for j in range(n):
            expected = rotary_logit_reference(q, k, i, j, theta, layout, zeta_power=(i - j) / scale_base)
            assert float(logits[i, j]) == pytest.approx(expected, abs=1e-4, rel=1e-4)


def test_xpos_scales_are_centred_so_their_range_halves() -> None:
    """The decay power is (n - c) / scale_base with c the middle of the positions: the centre cancels in
    q.k (same logits as the uncentred zeta ** (n / scale_base)), and the largest scale of N tokens is
    zeta_0 ** (-N / (2 scale_base)), not zeta_0 ** (-N / scale_base) (5e8 at N = 8192, far past fp16)."""
    n, scale_base = 8192, 512.0
    rot = vispos.create_encoding("xpos", dim=HEAD_DIM)(n)
    zeta0 = 0.4 / 1.4
    largest = max(float(rot.q_scale.max()), float(rot.k_scale.max()))
    assert largest == pytest.approx(zeta0 ** (-(n - 1) / (2 * scale_base)), rel=1e-4)  # 2.3e4
    assert largest < torch.finfo(torch.float16).max
    # products are the uncentred ones: q at n against k at m carries zeta ** ((n - m) / scale_base)
    zeta = torch.tensor([(2 * i + 0.4 * HEAD_DIM) / (1.4 * HEAD_DIM) for i in range(HEAD_DIM // 2)] * 2)
    for i, j in [(0, 0), (8191, 0), (5000, 4999), (100, 3000)]:
        expected = zeta.double() ** ((i - j) / scale_base)
        torch.testing.assert_close((rot.q_scale[i] * rot.k_scale[j]).double(), expected, rtol=1e-4, atol=0)
    packed = vispos.create_encoding("xpos", dim=HEAD_DIM)(torch.stack((torch.arange(10), torch.arange(10) + 5000)))
    torch.testing.assert_close(packed.q_scale[0], packed.q_scale[1])  # each sequence is centred on its own


@pytest.mark.parametrize("axis", ["x", "y"])
def test_rope1d_equals_rope2d_along_one_axis(axis: str) -> None:
    """rope2d (half layout) on a 1 x N grid turns pairs [0, d/4) with x; on N x 1, pairs [d/4, d/2) with y.
    Either set is 1D RoPE with d/2 channels and the same theta; the other set stays unrotated."""
    d, n = 16, 9
    rope2d = vispos.create_encoding("rope2d", dim=d, theta=100.0)((1, n) if axis == "x" else (n, 1))
    rope1d = vispos.create_encoding("rope", dim=d // 2, theta=100.0)(n)
    q, k = torch.randn(2, 1, 1, n, d).unbind(0)
    q2, k2 = rope2d.rotate(q, k)
    x_channels = [*range(d // 4), *range(d // 2, 3 * d // 4)]
    y_channels = [*range(d // 4, d // 2), *range(3 * d // 4, d)]
    moving, still = (x_channels, y_channels) if axis == "x" else (y_channels, x_channels)
    q1, k1 = rope1d.rotate(q[..., moving], k[..., moving])
    torch.testing.assert_close(q2[..., moving], q1)
    torch.testing.assert_close(k2[..., moving], k1)
    torch.testing.assert_close(q2[..., still], q[..., still])


def test_rotary_1d_preserves_norms() -> None:
    q, k = torch.randn(2, 2, HEADS, 7, HEAD_DIM).unbind(0)
    for layout in ("half", "interleaved"):
        rq, rk = vispos.create_encoding("rope", dim=HEAD_DIM, layout=layout)(7).rotate(q, k)
        torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
        torch.testing.assert_close(rk.norm(dim=-1), k.norm(dim=-1))


# --- sinusoidal ------------------------------------------------------------------------------------------
def test_sincos1d_equals_vaswani_formula() -> None:
    d, n = 12, 20
    table = vispos.create_encoding("sincos1d", dim=d)(n)
    for pos in range(n):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert float(table[pos, 2 * i]) == pytest.approx(math.sin(angle), abs=1e-6)
            assert float(table[pos, 2 * i + 1]) == pytest.approx(math.cos(angle), abs=1e-6)


@pytest.mark.parametrize("shift", [1, 5, 37])
def test_sincos1d_shift_is_a_linear_map_independent_of_position(shift: int) -> None:
    """PE(pos + k) = M_k PE(pos), M_k block-diagonal with [[cos kw, sin kw], [-sin kw, cos kw]] on (sin, cos)."""
    d = 16
    m_k = torch.zeros(d, d, dtype=torch.float64)
    for i in range(d // 2):
        w = 10000 ** (-2 * i / d)
        c, s = math.cos(shift * w), math.sin(shift * w)
        m_k[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.tensor([[c, s], [-s, c]], dtype=torch.float64)
    module = vispos.create_encoding("sincos1d", dim=d)
    positions = torch.tensor([0, 3, 11, 50, 200])
    pe, pe_shifted = module(positions).double(), module(positions + shift).double()
    torch.testing.assert_close(pe @ m_k.T, pe_shifted, atol=1e-5, rtol=0)


# --- T5 --------------------------------------------------------------------------------------------------
def t5_reference(relative_position: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """T5's _relative_position_bucket, one scalar at a time (relative_position = key - query)."""
    ret = 0
    n = -relative_position
    if bidirectional:
        num_buckets //= 2
        if n < 0:
            ret += num_buckets
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return ret + min(large, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (16, 64), (64, 256), (32, 40)])
def test_t5_buckets_equal_t5_algorithm(bidirectional: bool, num_buckets: int, max_distance: int) -> None:
    rel = torch.arange(-300, 301)
    got = t5_bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    expected = [t5_reference(r, bidirectional, num_buckets, max_distance) for r in range(-300, 301)]
    assert got.tolist() == expected
    last = num_buckets // (2 if bidirectional else 1) - 1
    assert expected[0] == last  # 300 tokens back: clamped to the last bucket of that direction


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_bias_looks_up_each_pair_bucket(bidirectional: bool) -> None:
    n = 40
    module = vispos.create_encoding("t5", num_heads=HEADS, num_buckets=16, max_distance=32, causal=not bidirectional)
    bias = module(n).detach()
    weight = module.embedding.weight.detach()
    for i in range(n):
        for j in range(n):
            if not bidirectional and j > i:
                assert torch.isneginf(bias[:, i, j]).all()
            else:
                torch.testing.assert_close(bias[:, i, j], weight[t5_reference(j - i, bidirectional, 16, 32)])


# --- ALiBi -----------------------------------------------------------------------------------------------
ALIBI_SLOPES = {
    8: [2**-1, 2**-2, 2**-3, 2**-4, 2**-5, 2**-6, 2**-7, 2**-8],
    # 12 = 8 + 4: the 8-head slopes, then every other slope of 16 heads (2^-0.5, 2^-1.5, ...)
    12: [2**-1, 2**-2, 2**-3, 2**-4, 2**-5, 2**-6, 2**-7, 2**-8, 2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5],
    # 20 = 16 + 4: the 16-head slopes 2^(-k/2), then every other slope of 32 heads (2^-0.25, 2^-0.75, ...)
    20: [2 ** (-k / 2) for k in range(1, 17)] + [2**-0.25, 2**-0.75, 2**-1.25, 2**-1.75],
}


@pytest.mark.parametrize("heads", sorted(ALIBI_SLOPES))
def test_alibi_slopes_equal_published_rule(heads: int) -> None:
    torch.testing.assert_close(alibi_slopes(heads), torch.tensor(ALIBI_SLOPES[heads]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_alibi_bias_is_minus_slope_times_distance(causal: bool) -> None:
    n, heads = 6, 12
    bias = vispos.create_encoding("alibi", num_heads=heads, causal=causal)(n)
    for h in range(heads):
        for i in range(n):
            for j in range(n):
                if causal and j > i:
                    assert math.isinf(float(bias[h, i, j])) and float(bias[h, i, j]) < 0
                else:
                    assert float(bias[h, i, j]) == pytest.approx(-ALIBI_SLOPES[heads][h] * abs(i - j), rel=1e-6)


# --- Shaw ------------------------------------------------------------------------------------------------
def shaw_naive(q, k, v, key_table, value_table, max_distance, mask=None):
    """Shaw et al. written out with the [N, N, d] tensors: e_ij = q_i . (k_j + aK_ij) / sqrt(d)."""
    n, d = q.shape[-2], q.shape[-1]
    clip = [[min(max(j - i, -max_distance), max_distance) + max_distance for j in range(n)] for i in range(n)]
    a_k, a_v = key_table[torch.tensor(clip)], value_table[torch.tensor(clip)]  # [N, N, d]
    logits = torch.einsum("bhid,bhijd->bhij", q, k[:, :, None] + a_k) / math.sqrt(d)
    if mask is not None:
        logits = logits + mask
    probs = logits.softmax(-1)
    return torch.einsum("bhij,bhijd->bhid", probs, v[:, :, None] + a_v)


@pytest.mark.parametrize("causal", [False, True])
def test_shaw_clipping_and_value_term_match_naive_reference(causal: bool) -> None:
    n, k_max = 9, 3
    module = vispos.create_encoding("shaw", dim=HEAD_DIM, max_distance=k_max, init_std=1.0)
    tables = module(n)
    assert tables.index.tolist() == [[min(max(j - i, -k_max), k_max) + k_max for j in range(n)] for i in range(n)]
    q, k, v = torch.randn(3, 2, HEADS, n, HEAD_DIM).unbind(0)
    mask = torch.full((n, n), float("-inf")).triu(1) if causal else None
    with torch.no_grad():
        out = shaw_attention(q, k, v, tables, mask=mask)
        expected = shaw_naive(q, k, v, module.key_table, module.value_table, k_max, mask)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_shaw_without_values_is_key_term_only() -> None:
    n, k_max = 7, 2
    module = vispos.create_encoding("shaw", dim=HEAD_DIM, max_distance=k_max, values=False, init_std=1.0)
    q, k, v = torch.randn(3, 1, HEADS, n, HEAD_DIM).unbind(0)
    with torch.no_grad():
        out = shaw_attention(q, k, v, module(n))
        expected = shaw_naive(q, k, v, module.key_table, torch.zeros_like(module.key_table), k_max)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert shaw_index(torch.tensor([[0, 5, 6]]), 2).tolist() == [[[2, 4, 4], [0, 2, 3], [0, 1, 2]]]


# --- bad input -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["rope", "xpos", "sincos1d", "learned1d", "alibi", "t5", "shaw"])
def test_bad_positions_are_refused(name: str) -> None:
    options = {"dim": HEAD_DIM} if name in ("rope", "xpos", "sincos1d", "learned1d", "shaw") else {"num_heads": HEADS}
    module = vispos.create_encoding(name, ndim=1, **options)
    with pytest.raises(ValueError, match=r"non-negative"):
        module(torch.tensor([-1, 0, 1]))
    with pytest.raises(ValueError, match=r"integer tensor, got dtype torch.float32"):
        module(torch.tensor([0.0, 1.5]))
    with pytest.raises(ValueError, match=r"sequence length must be >= 1"):
        module(0)
    with pytest.raises(TypeError, match=r"int length or an integer tensor"):
        module(3.5)


def test_learned1d_beyond_its_table_names_the_choices() -> None:
    module = vispos.create_encoding("learned1d", dim=4, max_len=5)
    with pytest.raises(ValueError, match=r"out_of_range='clamp' or 'interpolate'"):
        module(6)
    clamped = vispos.create_encoding("learned1d", dim=4, max_len=5, out_of_range="clamp")
    torch.testing.assert_close(clamped(8)[5:], clamped.table[4].expand(3, 4))
    with pytest.raises(ValueError, match=r"accepted: error, clamp, interpolate"):
        vispos.create_encoding("learned1d", dim=4, out_of_range="wrap")
