"""mrope (multimodal RoPE, Qwen2-VL): on text it is 1D RoPE; on an image with t fixed it is an axial 2D RoPE
(relative in x and y, no row/column cross term, by the diagnostics that prove it for rope2d); on a mixed
text + image + video sequence it equals hand-written references of the published formulas (Qwen2-VL's
sections, Qwen3-VL's interleaving); its position ids follow Qwen2-VL's get_rope_index."""

from __future__ import annotations

import functools
import math
import types

import pytest
import torch

import vispos
from vispos.diagnostics import cross_term, mixed_difference, offset_map, separability_error, translation_error
from vispos.encodings import mrope_positions
from vispos.layers import Attention

HEADS, HEAD_DIM = 4, 16
GRID = (5, 7)  # not square: a row/column mix-up cannot hide
SEEDS = (0, 1, 2)
FP, CLEAR = 1e-4, 1e-2
MIXED = [3, (2, 3), 2, (2, 2, 2), 1]  # text, a 2 x 3 image, text, a 2-frame 2 x 2 video, text


def content(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()


def mrope(**options: object) -> torch.nn.Module:
    return vispos.create_encoding("mrope", ndim=1, dim=options.pop("dim", HEAD_DIM), **options)


def logits_of(rotary, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Content q, k [heads, d], the same at every token, rotated: the position part of the logits [heads, N, N]."""
    n = rotary.cos.shape[-2]
    qs, ks = q[None, :, None].expand(1, -1, n, -1), k[None, :, None].expand(1, -1, n, -1)
    rq, rk = rotary.rotate(qs, ks)
    return (rq @ rk.transpose(-2, -1))[0] / math.sqrt(q.shape[-1])


# --- text only: 1D RoPE ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options", [{}, {"section_layout": "interleaved"}, {"layout": "interleaved", "theta": 100.0, "sections": (0, 5, 3)}]
)
def test_mrope_on_text_equals_1d_rope(options: dict) -> None:
    rope = vispos.create_encoding("rope", ndim=1, dim=HEAD_DIM, layout=options.get("layout", "half"),
                                  theta=options.get("theta", 10000.0))  # fmt: skip
    module = mrope(**options)
    packed = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 2, 4, 6, 8, 10]])  # [B, N]
    cases = [  # (mrope positions, rope positions)
        (mrope_positions([6]), torch.arange(6)),  # ids [3, N], the same on every axis
        (6, torch.arange(6)),
        (torch.arange(6) + 40, torch.arange(6) + 40),  # [N]: text
        (packed.expand(3, -1, -1), packed),  # [3, B, N]
    ]
    for ids, positions in cases:
        got, want = module(ids), rope(positions)
        torch.testing.assert_close(got.cos, want.cos, rtol=0, atol=0)
        torch.testing.assert_close(got.sin, want.sin, rtol=0, atol=0)


def test_mrope_attention_on_text_equals_rope_attention() -> None:
    torch.manual_seed(0)
    with_rope = Attention(32, HEADS, pos="rope", causal=True).eval()
    with_mrope = Attention(32, HEADS, pos="mrope", causal=True).eval()
    with_mrope.qkv.load_state_dict(with_rope.qkv.state_dict())
    with_mrope.proj.load_state_dict(with_rope.proj.state_dict())
    x, positions = content(1, 2, 9, 32), torch.stack((torch.arange(9), torch.arange(9) * 2))
    with torch.no_grad():
        torch.testing.assert_close(with_mrope(x, positions.expand(3, -1, -1)), with_rope(x, positions), rtol=0, atol=0)
        torch.testing.assert_close(with_mrope(x), with_rope(x), rtol=0, atol=0)


# --- an image with t fixed: axial 2D RoPE ---------------------------------------------------------------
IMAGE_OPTIONS = [  # theta 10: every pair turns visibly over a 5 x 7 grid
    {"theta": 10.0},
    {"theta": 10.0, "section_layout": "interleaved"},
    {"theta": 10.0, "layout": "interleaved", "sections": (2, 3, 3)},
    {"theta": 10.0, "sections": (0, 4, 4)},
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("options", IMAGE_OPTIONS)
def test_mrope_on_an_image_is_axial_2d_rope(options: dict, seed: int) -> None:
    """Patch tokens (one t, h = row, w = column): relative in (dy, dx) and free of row/column cross terms,
    by rope2d's measures (translation error, cross-term energy, separable offset map), in every head."""
    module = mrope(**options)
    q, k = content(seed, HEADS, HEAD_DIM), content(seed + 7, HEADS, HEAD_DIM)
    logits = logits_of(module(mrope_positions([GRID])), q, k)  # [heads, HW, HW]
    assert (translation_error(logits, GRID) < FP).all()
    assert (cross_term(logits, GRID) < FP).all()
    s = offset_map(logits, GRID)  # [heads, 2H-1, 2W-1]: S(dy, dx)
    assert (separability_error(s) < FP).all()
    assert mixed_difference(s).abs().max() < FP * s.abs().max()  # S(dx, dy) - S(dx, 0) - S(0, dy) + S(0, 0)
    h, w = GRID
    assert (s[:, h - 1, :].std(-1) > CLEAR * s.abs().amax((-2, -1))).all()  # it does turn with x ...
    assert (s[:, :, w - 1].std(-1) > CLEAR * s.abs().amax((-2, -1))).all()  # ... and with y
    after_text = module(mrope_positions([4, GRID])[:, 4:])  # the same image after 4 text tokens (t, h, w + 4)
    torch.testing.assert_close(logits_of(after_text, q, k), logits, atol=FP, rtol=FP)


@pytest.mark.parametrize("seed", SEEDS)
def test_raster_order_text_ids_on_an_image_leak_cross_terms(seed: int) -> None:
    """The contrast that shows the measure bites: the same patches numbered as text (y * W + x on every axis)."""
    module = mrope(theta=100.0)
    raster = torch.arange(GRID[0] * GRID[1])
    logits = logits_of(module(raster), content(seed, HEADS, HEAD_DIM), content(seed + 7, HEADS, HEAD_DIM))
    assert (cross_term(logits, GRID) > CLEAR).all()


# --- the published formulas on a mixed sequence ---------------------------------------------------------
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)


def qwen2vl_reference(x: torch.Tensor, ids: torch.Tensor, sections: tuple, theta: float) -> torch.Tensor:
    """Qwen2-VL: cos / sin per axis, [3, N, d] = cat(freqs, freqs); the last dim split into
    sections * 2 = (t, h, w, t, h, w) chunks, chunk i taken from axis i % 3; x cos + rotate_half(x) sin."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = ids.double()[..., None] * inv_freq  # [3, N, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = torch.cat([m[i % 3] for i, m in enumerate(emb.cos().split(list(sections) * 2, dim=-1))], dim=-1)
    sin = torch.cat([m[i % 3] for i, m in enumerate(emb.sin().split(list(sections) * 2, dim=-1))], dim=-1)
    return x * cos + rotate_half(x) * sin


def qwen3vl_reference(x: torch.Tensor, ids: torch.Tensor, sections: tuple, theta: float) -> torch.Tensor:
    """Qwen3-VL: start from the t frequencies, overwrite pairs offset, offset + 3, .. below 3 * section with
    axis h (offset 1) and w (offset 2); then cat(freqs, freqs) as usual."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = ids.double()[..., None] * inv_freq  # [3, N, d/2]
    merged = freqs[0].clone()
    for axis in (1, 2):
        idx = slice(axis, sections[axis] * 3, 3)
        merged[..., idx] = freqs[axis, ..., idx]
    emb = torch.cat((merged, merged), dim=-1)
    return x * emb.cos() + rotate_half(x) * emb.sin()


def pairwise_reference(x: torch.Tensor, ids: torch.Tensor, sections: tuple, theta: float, interleave: bool,
                       layout: str) -> torch.Tensor:  # fmt: skip
    """A loop over tokens and pairs: pair j (channels j, j + d/2, or 2j, 2j + 1) turns by the id of its axis."""
    d, (t, h, _) = x.shape[-1], sections
    out = x.double().clone()
    for j in range(d // 2):
        if interleave:
            axis = 1 if j % 3 == 1 and j < 3 * h else 2 if j % 3 == 2 and j < 3 * sections[2] else 0
        else:
            axis = 0 if j < t else 1 if j < t + h else 2
        c1, c2 = (j, j + d // 2) if layout == "half" else (2 * j, 2 * j + 1)
        for n in range(x.shape[-2]):
            angle = float(ids[axis, n]) * theta ** (-2 * j / d)
            a, b = x[..., n, c1].double(), x[..., n, c2].double()
            out[..., n, c1] = a * math.cos(angle) - b * math.sin(angle)
            out[..., n, c2] = a * math.sin(angle) + b * math.cos(angle)
    return out


@pytest.mark.parametrize(
    ("dim", "sections", "theta"),
    [(128, (16, 24, 24), 1e6), (HEAD_DIM, (2, 3, 3), 1e4), (HEAD_DIM, (4, 0, 4), 100.0)],
)
def test_mrope_equals_qwen2vl_formula_on_a_mixed_sequence(dim: int, sections: tuple, theta: float) -> None:
    ids = mrope_positions(MIXED)
    x = content(3, 1, 2, ids.shape[-1], dim)
    got, _ = mrope(dim=dim, sections=sections, theta=theta)(ids).rotate(x, x)
    torch.testing.assert_close(got.double(), qwen2vl_reference(x.double(), ids, sections, theta), atol=2e-5, rtol=0)


@pytest.mark.parametrize(("dim", "sections", "theta"), [(128, (24, 20, 20), 5e6), (HEAD_DIM, (4, 2, 2), 1e4)])
def test_mrope_interleaved_equals_qwen3vl_formula_on_a_mixed_sequence(dim: int, sections: tuple, theta: float) -> None:
    ids = mrope_positions(MIXED)
    x = content(4, 1, 2, ids.shape[-1], dim)
    module = mrope(dim=dim, sections=sections, theta=theta, section_layout="interleaved")
    got, _ = module(ids).rotate(x, x)
    torch.testing.assert_close(got.double(), qwen3vl_reference(x.double(), ids, sections, theta), atol=2e-5, rtol=0)


@pytest.mark.parametrize("section_layout", ["contiguous", "interleaved"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_mrope_equals_a_pairwise_loop_in_both_channel_layouts(section_layout: str, layout: str) -> None:
    ids = mrope_positions(MIXED)
    x = content(5, 1, 1, ids.shape[-1], HEAD_DIM)
    sections = (2, 3, 3) if section_layout == "contiguous" else (4, 2, 2)
    module = mrope(sections=sections, theta=100.0, section_layout=section_layout, layout=layout)
    got, _ = module(ids).rotate(x, x)
    expected = pairwise_reference(x, ids, sections, 100.0, section_layout == "interleaved", layout)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=0)


# --- position ids ----------------------------------------------------------------------------------------
def test_mrope_positions_follow_qwen2vl_rope_index() -> None:
    """Text: s, s + 1, ..; a grid: t = s + frame, h = s + row, w = s + column; the next span starts after
    the largest id so far (Qwen2-VL's get_rope_index, written out by hand)."""
    expected = [
        [0, 1, 2, 2, 2, 2, 2, 2, 5, 6],  # t: text 0 1 | image (one frame) | text continues at 2 + 2 + 1
        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],  # h: rows 0, 1 of the 2 x 3 image
        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6],  # w: columns 0, 1, 2 -> largest id 4
    ]
    assert mrope_positions([2, (2, 3), 2]).tolist() == expected
    video = mrope_positions([(3, 1, 2), 1], start=10)  # 3 frames of 1 x 2, then a text token
    assert video.tolist() == [[10, 10, 11, 11, 12, 12, 13], [10] * 6 + [13], [10, 11] * 3 + [13]]
    assert mrope_positions([(4, 8), 1])[:, -1].tolist() == [8, 8, 8]  # after a wide image: its largest w + 1
    assert mrope_positions([(1, 4, 8), (2, 2)])[:, -4:].tolist() == [[8] * 4, [8, 8, 9, 9], [8, 9, 8, 9]]


@pytest.mark.parametrize(
    ("spans", "error", "match"),
    [
        ([], TypeError, r"non-empty list of text lengths and \(H, W\) / \(T, H, W\) grids"),
        ([3, (2, 3, 4, 5)], ValueError, r"spans\[1\]: an image grid is \(H, W\) and a video \(T, H, W\)"),
        ([0], ValueError, r"spans\[0\] \(text tokens\) must be >= 1"),
        ([(2, 0)], ValueError, r"spans\[0\] size must be >= 1"),
        ([2.5], TypeError, r"spans\[0\] \(text tokens\) must be an int"),
    ],
)
def test_mrope_positions_bad_spans_name_what_is_accepted(spans: list, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        mrope_positions(spans)


# --- in vispos.layers.Attention ---------------------------------------------------------------------------
def test_mrope_attention_takes_ids_per_sequence() -> None:
    torch.manual_seed(0)
    module = Attention(32, HEADS, pos="mrope", causal=True).eval()
    first, second = mrope_positions(MIXED), mrope_positions([(4, 3), 8])  # 20 tokens each
    ids = torch.stack((first, second), dim=1)  # [3, B, N]
    x = content(6, 2, 20, 32)
    with torch.no_grad():
        batched = module(x, ids)
        alone = torch.cat([module(x[i : i + 1], ids[:, i]) for i in range(2)])
        torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(module(x, ids + 100), batched, atol=1e-4, rtol=1e-4)  # relative on every axis
        as_text = torch.arange(20).expand(3, 2, -1)  # the same tokens numbered as text
        assert not torch.allclose(module(x, as_text), batched, atol=1e-3)  # the ids matter


def test_mrope_attention_bad_positions_name_the_shapes() -> None:
    module = Attention(32, HEADS, pos="mrope")
    x = content(7, 2, 10, 32)
    with pytest.raises(ValueError, match=r"must have shape \[3, N\] or \[3, B, N\] \(3 ids per token\), or \[N\]"):
        module(x, torch.zeros(2, 10, dtype=torch.long))  # [B, N] is ambiguous here: refused
    with pytest.raises(ValueError, match=r"positions cover 7 tokens, the input has 10"):
        module(x, mrope_positions([7]))
    with pytest.raises(ValueError, match=r"non-negative"):
        module(x, mrope_positions([10]) - 1)


# --- options ----------------------------------------------------------------------------------------------
def test_mrope_default_sections_are_the_shipped_proportions() -> None:
    assert mrope(dim=128).sections == (16, 24, 24)  # Qwen2-VL
    assert mrope(dim=128, section_layout="interleaved").sections == (24, 20, 20)  # Qwen3-VL
    assert mrope(dim=HEAD_DIM).sections == (2, 3, 3)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"sections": (4, 2, 1)}, ValueError, r"must sum to dim / 2 = 8 rotary pairs, got \(4, 2, 1\)"),
        ({"sections": (8, 0)}, TypeError, r"three ints \(t, h, w\) counted in rotary pairs"),
        ({"sections": (10, -1, -1)}, ValueError, r"mrope sections\[1\] must be >= 0"),
        ({"sections": (2, 3, 3), "section_layout": "interleaved"}, ValueError, r"do not fit 8 pairs"),
        ({"section_layout": "blocks"}, ValueError, r"accepted: contiguous, interleaved"),
        ({"dim": 15}, ValueError, r"mrope needs a head dimension divisible by 2"),
    ],
)
def test_mrope_bad_options_name_what_is_accepted(options: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        mrope(**options)


# --- the optional cross-check against transformers ---------------------------------------------------------
def test_mrope_equals_transformers_qwen_vl_when_installed() -> None:
    """transformers' Qwen2-VL / Qwen3-VL rotary embeddings and Qwen2-VL's get_rope_index (skipped without it)."""
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
    from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig

    ids = mrope_positions(MIXED)
    x = content(8, 1, 2, ids.shape[-1], 128)
    for config, embedding, section_layout in [
        (Qwen2VLTextConfig(hidden_size=256, num_attention_heads=2, rope_parameters={
            "rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
         qwen2.Qwen2VLRotaryEmbedding, "contiguous"),
        (Qwen3VLTextConfig(hidden_size=256, num_attention_heads=2, head_dim=128, rope_parameters={
            "rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
         qwen3.Qwen3VLTextRotaryEmbedding, "interleaved"),
    ]:  # fmt: skip
        cos, sin = embedding(config)(x, ids[:, None])
        expected, _ = qwen2.apply_rotary_pos_emb(x, x, cos, sin)
        rope = config.rope_parameters
        module = mrope(dim=128, theta=rope["rope_theta"], sections=tuple(rope["mrope_section"]),
                       section_layout=section_layout)  # fmt: skip
        torch.testing.assert_close(module(ids).rotate(x, x)[0], expected, atol=1e-5, rtol=0)
    # get_rope_index on token types (0 text, 1 image, 2 video) and grids; no vision tower needed
    host = types.SimpleNamespace(
        config=types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=1))
    )
    host.get_vision_position_ids = functools.partial(qwen2.Qwen2VLModel.get_vision_position_ids, host)
    kinds = torch.tensor([[0] * 3 + [1] * 6 + [0] * 2 + [2] * 8 + [0]])
    got, _ = qwen2.Qwen2VLModel.get_rope_index(host, torch.zeros_like(kinds), kinds,
        image_grid_thw=torch.tensor([[1, 2, 3]]), video_grid_thw=torch.tensor([[2, 2, 2]]))  # fmt: skip
    assert got[:, 0].tolist() == ids.tolist()
