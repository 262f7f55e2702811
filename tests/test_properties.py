"""The positional schemes' mathematical properties, proved on random content and random parameters.

- relative schemes: logits depend on the offset alone (translation error at floating-point level);
- axial rope2d: no row/column cross term (x never meets y), for every head, alone and in a patched ViT;
- sincos2d, learned2d: after the model's own q/k projections, cross terms and translation error are
  clearly non-zero (the survey's Q_row K_col^T + Q_col K_row^T);
- rope2d_mixed: relative but not separable; separable (and equal to rope2d) when axis-aligned.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import vispos
from vispos.diagnostics import (
    cross_term,
    layer_logits,
    mixed_difference,
    offset_map,
    scheme_logits,
    separability_error,
    translation_error,
)

GRID = (5, 7)  # not square: a row/column mix-up cannot hide
EMBED, HEADS, HEAD_DIM, PATCH = 64, 4, 16, 4
N_1D = 12
SEEDS = (0, 1, 2)
FP = 1e-4  # "zero" to floating-point precision: the rotations and biases are computed in fp32
CLEAR = 1e-2  # "clearly above zero"
# from the registry's declared properties, so a new scheme is covered without editing this file
# options that put a scheme where its declared property shows: FIRE is relative among the queries before its
# threshold L (512 tokens by default) and not past it, so it is measured with L = 1
MEASURED_WITH: dict[str, dict[str, object]] = {"fire": {"threshold": 1.0}}
RELATIVE_2D = tuple(n for n in vispos.list_encodings(ndim=2) if vispos.get_info(n, 2).relative)


@torch.no_grad()
def randomize_(module: nn.Module, seed: int) -> nn.Module:
    """Every parameter drawn afresh (normal, 1/sqrt(fan-in) for matrices): no property may rest on an init."""
    g = torch.Generator().manual_seed(1000 + seed)
    for p in module.parameters():
        scale = p.shape[-1] ** -0.5 if p.dim() >= 2 else 0.5
        p.copy_(torch.randn(p.shape, generator=g) * scale)
    return module


def encoding(name: str, ndim: int, seed: int, **options: object) -> nn.Module:
    info = vispos.get_info(name, ndim)
    context = {"dim": EMBED if info.kind in ("additive", "conditional") else HEAD_DIM, "num_heads": HEADS,
               "width": EMBED}  # fmt: skip
    context["train_grid"] = GRID
    context |= {"num_prefix_tokens": 0, "causal": False, "layer": 0, "depth": 1}
    enc = vispos.create_encoding(name, ndim=ndim, **{k: context[k] for k in info.context} | options)
    return randomize_(enc, seed)


def content(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def vit(pos: str | list[str], seed: int, **options: object) -> nn.Module:
    """A random 2-block ViT with a cls token and a register (prefix tokens), patched and randomised."""
    torch.manual_seed(seed)
    model = VisionTransformer(
        img_size=(GRID[0] * PATCH, GRID[1] * PATCH),
        patch_size=PATCH,
        embed_dim=EMBED,
        depth=2,
        num_heads=HEADS,
        reg_tokens=1,
        num_classes=0,
    )
    vispos.patch(model, pos, **options)
    return randomize_(model, seed).eval()


def qk_weights(model: nn.Module, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's q and k projections as [heads, C, head_dim]."""
    w = model.blocks[layer].attn.qkv.weight  # [3C, C]
    wq, wk, _ = w.reshape(3, HEADS, HEAD_DIM, EMBED).permute(0, 1, 3, 2)
    return wq, wk


# --- relative schemes: the logit depends on the offset alone ---------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", RELATIVE_2D)
def test_relative_2d_scheme_alone_is_translation_invariant(name: str, seed: int) -> None:
    logits = scheme_logits(
        encoding(name, 2, seed), GRID, q=content(seed, HEADS, HEAD_DIM), k=content(seed + 7, HEAD_DIM)
    )
    assert logits.shape == (HEADS, 35, 35)
    assert translation_error(logits, GRID).max() < FP


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", RELATIVE_2D)
def test_relative_2d_scheme_in_patched_vit_is_translation_invariant(name: str, seed: int) -> None:
    model = vit(name, seed)
    with torch.no_grad():
        for layer in range(2):
            logits = layer_logits(model, GRID, layer=layer, content=content(seed, EMBED), norm=True)
            assert translation_error(logits, GRID).max() < FP


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("rope", {}),
        ("rope", {"layout": "interleaved", "theta": 100.0}),
        ("rope", {"scaling": {"type": "linear", "factor": 2.0}}),
        ("rope", {"scaling": {"type": "yarn", "factor": 2.0, "original_length": 6}}),
        ("xpos", {}),
        ("xpos", {"scale_base": 8.0, "layout": "interleaved"}),
        ("t5", {"num_buckets": 8, "max_distance": 6}),
        ("t5", {"causal": True}),
        ("alibi", {}),
        ("alibi", {"num_heads": 6}),
        ("alibi", {"causal": True}),
        ("shaw", {"max_distance": 3}),
    ],
)
@pytest.mark.parametrize("seed", SEEDS)
def test_relative_1d_scheme_is_translation_invariant(name: str, options: dict, seed: int) -> None:
    heads = options.get("num_heads", HEADS)
    enc = encoding(name, 1, seed, **options)
    logits = scheme_logits(enc, N_1D, q=content(seed, heads, HEAD_DIM), k=content(seed + 7, heads, HEAD_DIM))
    assert logits.shape == (heads, N_1D, N_1D)
    assert translation_error(logits, N_1D).max() < FP  # causal forms: the -inf entries are left out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("ndim", (1, 2))
def test_declared_relative_property_matches_behaviour(ndim: int, seed: int) -> None:
    """Every registered scheme (but nope, which has nothing to measure): declared relative <=> measured."""
    for name in vispos.list_encodings(ndim=ndim):
        info = vispos.get_info(name, ndim)
        if info.kind == "none":
            continue
        where = GRID if ndim == 2 else N_1D
        enc = encoding(name, ndim, seed, **MEASURED_WITH.get(name, {}))
        if info.kind in ("additive", "conditional"):  # tokens (content + table, or transformed content) projected
            wq, wk = content(seed, HEADS, EMBED, HEAD_DIM), content(seed + 1, HEADS, EMBED, HEAD_DIM)
            logits = scheme_logits(enc, where, wq=wq, wk=wk, content=content(seed + 2, EMBED))
        else:
            logits = scheme_logits(enc, where, q=content(seed, HEADS, HEAD_DIM), k=content(seed + 7, HEADS, HEAD_DIM))
        err = translation_error(logits, where)
        if info.relative:
            assert err.max() < FP, name
        else:
            assert err.min() > CLEAR, name


# --- axial rope2d: no cross term ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "options", [{}, {"layout": "interleaved"}, {"coords": "normalized"}, {"theta": 10.0, "layout": "interleaved"}]
)
def test_rope2d_alone_has_no_cross_term_in_any_head(options: dict, seed: int) -> None:
    enc = encoding("rope2d", 2, seed, **options)
    logits = scheme_logits(enc, GRID, q=content(seed, HEADS, HEAD_DIM), k=content(seed + 7, HEADS, HEAD_DIM))
    assert (cross_term(logits, GRID) < FP).all()
    s = offset_map(logits, GRID)  # [heads, 2H-1, 2W-1]: S(dy, dx)
    assert (separability_error(s) < FP).all()
    assert mixed_difference(s).abs().max() < FP * s.abs().max()  # S(dx,dy) - S(dx,0) - S(0,dy) + S(0,0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("options", [{}, {"coords": "normalized", "layout": "interleaved"}])
def test_rope2d_patched_vit_has_no_cross_term_in_any_layer_or_head(options: dict, seed: int) -> None:
    model = vit("rope2d", seed, **options)
    with torch.no_grad():
        for layer, norm in itertools.product(range(2), (False, True)):
            logits = layer_logits(model, GRID, layer=layer, content=content(seed, EMBED), norm=norm)
            assert (cross_term(logits, GRID) < FP).all()
            assert (translation_error(logits, GRID) < FP).all()


# --- decomposed2d: a y-only plus an x-only term -----------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_decomposed2d_has_no_cross_term_alone_or_in_a_patched_vit(seed: int) -> None:
    enc = encoding("decomposed2d", 2, seed)
    logits = scheme_logits(enc, GRID, q=content(seed, HEADS, HEAD_DIM), k=content(seed + 7, HEADS, HEAD_DIM))
    assert (cross_term(logits, GRID) < FP).all()
    assert (separability_error(offset_map(logits, GRID)) < FP).all()
    model = vit("decomposed2d", seed)
    with torch.no_grad():
        for layer in range(2):
            logits = layer_logits(model, GRID, layer=layer, content=content(seed, EMBED), norm=True)
            assert (cross_term(logits, GRID) < FP).all() and (translation_error(logits, GRID) < FP).all()


# --- absolute tables: cross terms after the projections ----------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("pos", "options"), [("sincos2d", {}), ("learned2d", {}), ("learned2d", {"factorized": True})])
def test_absolute_tables_leak_cross_terms_after_the_models_projections(pos: str, options: dict, seed: int) -> None:
    model = vit(pos, seed, **options)
    contents = (None, content(seed, EMBED))  # None: the position-only part PE_p W_q . PE_q W_k
    with torch.no_grad():
        for layer, norm, c in itertools.product(range(2), (False, True), contents):
            logits = layer_logits(model, GRID, layer=layer, content=c, norm=norm)
            assert cross_term(logits, GRID).min() > CLEAR
            assert translation_error(logits, GRID).min() > CLEAR


@pytest.mark.parametrize("seed", SEEDS)
def test_sincos2d_cross_terms_come_from_the_projection(seed: int) -> None:
    """PE(x, y) = [a(x) || b(y)]: with W_q = W_k = I the logit is a(px).a(qx) + b(py).b(qy), relative and
    separable; block-diagonal projections (x channels to x channels) keep it separable but not relative;
    projections that mix x and y channels create the cross terms a(px) M b(qy) + b(py) M' a(qx)."""
    enc = encoding("sincos2d", 2, seed)
    eye = torch.eye(EMBED)[None]  # [1, C, C]: one head, identity projection
    logits = scheme_logits(enc, GRID, wq=eye, wk=eye)
    assert cross_term(logits, GRID) < FP and translation_error(logits, GRID) < FP

    half = EMBED // 2
    blocks = torch.zeros(2, HEADS, EMBED, HEAD_DIM)
    blocks[:, :, :half, : HEAD_DIM // 2] = content(seed, 2, HEADS, half, HEAD_DIM // 2)  # x channels -> x
    blocks[:, :, half:, HEAD_DIM // 2 :] = content(seed + 1, 2, HEADS, half, HEAD_DIM // 2)  # y channels -> y
    logits = scheme_logits(enc, GRID, wq=blocks[0], wk=blocks[1])
    assert (cross_term(logits, GRID) < FP).all() and translation_error(logits, GRID).min() > CLEAR

    mixing = content(seed + 2, 2, HEADS, EMBED, HEAD_DIM)
    logits = scheme_logits(enc, GRID, wq=mixing[0], wk=mixing[1])
    assert cross_term(logits, GRID).min() > CLEAR and translation_error(logits, GRID).min() > CLEAR


# --- RoPE-Mixed: relative, separable only when axis-aligned ------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_rope2d_mixed_random_frequencies_relative_but_not_separable(seed: int) -> None:
    enc = encoding("rope2d_mixed", 2, seed)
    logits = scheme_logits(enc, GRID, q=content(seed, HEADS, HEAD_DIM), k=content(seed + 7, HEADS, HEAD_DIM))
    assert translation_error(logits, GRID).max() < FP
    assert cross_term(logits, GRID).min() > CLEAR
    model = vit("rope2d_mixed", seed)  # its default init: rotated frequencies, one module per layer
    with torch.no_grad():
        for layer in range(2):
            logits = layer_logits(model, GRID, layer=layer, content=content(seed, EMBED))
            assert translation_error(logits, GRID).max() < FP
            assert cross_term(logits, GRID).min() > CLEAR


@pytest.mark.parametrize("seed", SEEDS)
def test_rope2d_mixed_axis_aligned_is_separable_and_equals_rope2d(seed: int) -> None:
    q, k = content(seed, HEADS, HEAD_DIM), content(seed + 7, HEADS, HEAD_DIM)
    torch.manual_seed(seed)
    mixed = vispos.create_encoding("rope2d_mixed", ndim=2, dim=HEAD_DIM, num_heads=HEADS, theta=100.0, rotate=False)
    axial = vispos.create_encoding("rope2d", ndim=2, dim=HEAD_DIM, theta=100.0)
    lm, la = scheme_logits(mixed, GRID, q=q, k=k), scheme_logits(axial, GRID, q=q, k=k)
    torch.testing.assert_close(lm, la, rtol=1e-5, atol=1e-5)
    assert (cross_term(lm, GRID) < FP).all()

    # any axis-aligned frequencies: the first quarter of the pairs turn with x only, the rest with y only
    randomize_(mixed, seed)
    quarter = HEAD_DIM // 4
    with torch.no_grad():
        mixed.freqs[0, :, quarter:] = 0.0  # fx of the y pairs
        mixed.freqs[1, :, :quarter] = 0.0  # fy of the x pairs
    logits = scheme_logits(mixed, GRID, q=q, k=k)
    assert (cross_term(logits, GRID) < FP).all() and translation_error(logits, GRID).max() < FP
    with torch.no_grad():
        mixed.freqs[1, 0, 0] = 0.5  # one pair of head 0 turns with x and y: only head 0 gets a cross term
    ct = cross_term(scheme_logits(mixed, GRID, q=q, k=k), GRID)
    assert ct[0] > CLEAR and (ct[1:] < FP).all()


# --- a scheme alone and the patched layer agree ------------------------------------------------------


@pytest.mark.parametrize("pos", ("rope2d", "rope2d_mixed", "relbias2d", "sincos2d", "learned2d"))
def test_scheme_logits_equal_the_patched_layer(pos: str) -> None:
    model, layer = vit(pos, 0), 1
    attn = model.blocks[layer].attn
    wq, wk = qk_weights(model, layer)
    with torch.no_grad():
        if vispos.get_info(pos, 2).kind == "additive":
            attn.qkv.bias.zero_()  # scheme_logits takes the projection matrices only
            expected = scheme_logits(model.vispos.additive, GRID, wq=wq, wk=wk, scale=attn.scale)
            got = layer_logits(model, GRID, layer=layer)
        else:
            c = content(0, EMBED)
            bq, bk, _ = attn.qkv.bias.reshape(3, HEADS, HEAD_DIM)
            q, k = torch.einsum("c,hcd->hd", c, wq) + bq, torch.einsum("c,hcd->hd", c, wk) + bk
            enc = model.vispos.attention
            enc = enc[layer] if isinstance(enc, nn.ModuleList) else enc
            expected = scheme_logits(enc, GRID, q=q, k=k, scale=attn.scale)
            got = layer_logits(model, GRID, layer=layer, content=c)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
