"""The rotary family beyond axial RoPE, against the papers' definitions on random inputs.

- linear-map family (``rope2d_golden``, ``string2d``): angles <omega_j, p>; axial maps have no cross
  term, directional / learned maps do; STRING = P RoPE(p) P^T (Cayley P) = exp(sum_i p_i L_i) with
  commuting L_i, and folding P^T into the q/k projections leaves a model's outputs unchanged;
- ComRoPE (AP, LD) and LieRE: block rotations equal ``torch.linalg.matrix_exp`` of the published
  generator sums; ComRoPE's generators commute and its logits are relative, LieRE's do neither;
- ``ropend``: the presets' channel splits, per-axis scaling, and on two axes ``rope2d`` (the presets
  against each model's code: ``tests/test_ropend_presets.py``).
"""

from __future__ import annotations

import math

import pytest
import timm
import torch
from torch import nn

import vispos
from vispos.diagnostics import cross_term, layer_logits, scheme_logits, translation_error
from vispos.encodings.comrope import axis_partition_mask
from vispos.encodings.coords2d import grid_coords
from vispos.encodings.rotary_nd import GOLDEN_ANGLE, axial_freqs, golden_freqs
from vispos.encodings.string import fold_string, skew_part

GRID = (5, 7)
HEADS, HEAD_DIM, EMBED = 4, 16, 64
FP, CLEAR = 1e-4, 1e-2
SEEDS = (0, 1, 2)


def content(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def build(name: str, seed: int, **options: object) -> nn.Module:
    torch.manual_seed(seed)
    context = {"dim": HEAD_DIM, "num_heads": HEADS, "train_grid": GRID}
    info = vispos.get_info(name, 2)
    enc = vispos.create_encoding(name, **{k: context[k] for k in info.context} | options)
    with torch.no_grad():
        for p in enc.parameters():  # every parameter drawn afresh: no property may rest on an init
            p.copy_(content(100 + seed, *p.shape) * 0.5)
    return enc


def logits(enc: nn.Module, seed: int) -> torch.Tensor:
    return scheme_logits(enc, GRID, q=content(seed, HEADS, HEAD_DIM), k=content(seed + 7, HEADS, HEAD_DIM))


def dense_rope(angles: torch.Tensor) -> torch.Tensor:
    """Per-pair angles [..., d/2] -> the rotation matrix [..., d, d] of the ``half`` layout (pair j is
    channels j and j + d/2), written out entry by entry."""
    half = angles.shape[-1]
    r = torch.zeros(*angles.shape[:-1], 2 * half, 2 * half, dtype=torch.float64)
    c, s = angles.double().cos(), angles.double().sin()
    j = torch.arange(half)
    r[..., j, j], r[..., j + half, j + half] = c, c
    r[..., j, j + half], r[..., j + half, j] = -s, s
    return r


def dense_logits(rotations: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """rotations [heads, N, d, d], q/k [heads, d] -> (R_p q) . (R_p' k) / sqrt(d), [heads, N, N]."""
    rq = rotations @ q.double()[:, None, :, None]  # [heads, N, d, 1]
    rk = rotations @ k.double()[:, None, :, None]
    return (rq[..., 0] @ rk[..., 0].transpose(-1, -2)) / math.sqrt(q.shape[-1])


def block_diag(blocks: torch.Tensor) -> torch.Tensor:
    """[..., M, b, b] -> [..., M b, M b] block-diagonal."""
    *lead, m, b, _ = blocks.shape
    out = torch.zeros(*lead, m * b, m * b, dtype=blocks.dtype)
    for i in range(m):
        out[..., i * b : (i + 1) * b, i * b : (i + 1) * b] = blocks[..., i, :, :]
    return out


def xy(grid: tuple[int, int], coords: str) -> torch.Tensor:
    return grid_coords(grid, coords).flip(-1).double()  # (x, y) per patch, row-major


# --- the linear-map family ---------------------------------------------------------------------------


def test_golden_frequencies_follow_the_golden_angle() -> None:
    f = golden_freqs(HEAD_DIM, theta=100.0, spacing="golden_angle")[0]  # [2, d/2]: one head
    j = torch.arange(HEAD_DIM // 2, dtype=torch.float64)
    mag = 100.0 ** (-2 * j / HEAD_DIM)
    torch.testing.assert_close(f.double().norm(dim=0), mag, rtol=1e-6, atol=0)
    turn = torch.atan2(f[1].double(), f[0].double()) - j * GOLDEN_ANGLE  # direction minus j x golden angle
    wrapped = torch.remainder(turn + math.pi, 2 * math.pi) - math.pi
    torch.testing.assert_close(wrapped, torch.zeros_like(j), atol=1e-6, rtol=0)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_axial_linear_map_is_rope2d(layout: str) -> None:
    """string2d with freqs='axial' and P = I is rope2d: the linear map reproduces axial RoPE exactly."""
    axial = vispos.create_encoding("rope2d", dim=HEAD_DIM, theta=10.0, layout=layout)(GRID)
    string = vispos.create_encoding("string2d", dim=HEAD_DIM, num_heads=HEADS, freqs="axial", layout=layout)(GRID)
    torch.testing.assert_close(string.cos, axial.cos, rtol=0, atol=0)
    torch.testing.assert_close(string.sin, axial.sin, rtol=0, atol=0)
    torch.testing.assert_close(string.basis, torch.eye(HEAD_DIM).expand(HEADS, -1, -1), rtol=0, atol=0)
    ref = axial_freqs(HEAD_DIM, 10.0)
    assert (ref[0, HEAD_DIM // 4 :] == 0).all() and (ref[1, : HEAD_DIM // 4] == 0).all()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("name", "options", "separable"),
    [
        ("rope2d_golden", {}, False),
        ("string2d", {}, False),
        ("string2d", {"freqs": "golden"}, False),
        ("string2d", {"freqs": "axial"}, True),  # axial RoPE in any basis: x pairs and y pairs stay apart
        ("string2d", {"variant": "circulant"}, False),
        ("comrope2d", {"variant": "ap"}, True),  # each block turns with one axis
        ("comrope2d", {"variant": "ld"}, False),
        ("rope2d", {}, True),
        ("rope2d_mixed", {}, False),
    ],
)
def test_cross_term_separates_axial_from_directional_rotations(
    name: str, options: dict, separable: bool, seed: int
) -> None:
    out = logits(build(name, seed, **options), seed)
    assert translation_error(out, GRID).max() < FP
    if separable:
        assert cross_term(out, GRID).max() < FP
    else:
        assert cross_term(out, GRID).min() > CLEAR


# --- STRING --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("freqs", ["mixed", "golden"])
def test_string_matches_its_definition(freqs: str, seed: int) -> None:
    """R(p) = P RoPE(p) P^T with P = (I - S)(I + S)^-1 orthogonal, and R(p) = exp(x L_x + y L_y) with
    L_i = P Omega_i P^T commuting (STRING's theorem); the logits are (R(p) q) . (R(p') k)."""
    enc = build("string2d", seed, freqs=freqs)
    s = skew_part(enc.skew.detach()).double()
    eye = torch.eye(HEAD_DIM, dtype=torch.float64)
    p = (eye - s) @ torch.linalg.inv(eye + s)  # the Cayley transform as written
    torch.testing.assert_close(enc.basis().double(), p, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p.transpose(-1, -2) @ p, eye.expand_as(p), rtol=0, atol=1e-10)

    coords = xy(GRID, "pixel")  # [N, 2]
    freq = enc.freqs.detach().double()
    freq = freq if freq.dim() == 3 else freq.expand(HEADS, -1, -1)  # [heads, 2, d/2]
    rope = dense_rope(coords @ freq)  # [heads, N, d, d]
    rotations = p[:, None] @ rope @ p[:, None].transpose(-1, -2)  # P RoPE(p) P^T
    gens = []
    for i in range(2):  # L_i = P Omega_i P^T, Omega_i: the generator of the pairs' turns along axis i
        omega = torch.zeros(HEADS, HEAD_DIM, HEAD_DIM, dtype=torch.float64)
        j = torch.arange(HEAD_DIM // 2)
        omega[:, j + HEAD_DIM // 2, j], omega[:, j, j + HEAD_DIM // 2] = freq[:, i], -freq[:, i]
        gens.append(p @ omega @ p.transpose(-1, -2))
    torch.testing.assert_close(gens[0] @ gens[1], gens[1] @ gens[0], rtol=0, atol=1e-9)
    total = coords[None, :, 0, None, None] * gens[0][:, None] + coords[None, :, 1, None, None] * gens[1][:, None]
    torch.testing.assert_close(torch.linalg.matrix_exp(total), rotations, rtol=0, atol=1e-8)
    q, k = content(seed, HEADS, HEAD_DIM), content(seed + 7, HEADS, HEAD_DIM)
    expected = dense_logits(rotations, q, k).float()
    torch.testing.assert_close(scheme_logits(enc, GRID, q=q, k=k), expected, rtol=1e-4, atol=1e-4)


def string_vit(seed: int, **options: object) -> nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model(
        "vit_tiny_patch16_224", img_size=(20, 28), patch_size=4, embed_dim=EMBED, depth=2, num_heads=HEADS,
        reg_tokens=1, num_classes=3, **options,
    )  # fmt: skip
    vispos.patch(model, "string2d")
    with torch.no_grad():
        for i, module in enumerate(model.vispos.attention):
            module.skew.copy_(content(50 + seed + i, *module.skew.shape) * 0.3)  # a basis far from I
    return model.eval()


@pytest.mark.parametrize("seed", SEEDS)
def test_folding_string_into_the_projections_keeps_the_outputs(seed: int) -> None:
    model = string_vit(seed)
    x = content(seed, 2, 3, 20, 28)
    with torch.no_grad():
        before = model(x)
        logits_before = layer_logits(model, (5, 7), layer=1, content=content(seed, EMBED))
        qkv_before = model.blocks[0].attn.qkv.weight.clone()
        fold_string(model)
        after = model(x)
        logits_after = layer_logits(model, (5, 7), layer=1, content=content(seed, EMBED))
    assert all(m.folded for m in model.vispos.attention)
    assert all(m(GRID).basis is None for m in model.vispos.attention)  # RoPE alone at run time
    assert (model.blocks[0].attn.qkv.weight - qkv_before).abs().max() > CLEAR  # the weights did change
    torch.testing.assert_close(model.blocks[0].attn.qkv.weight[2 * EMBED :], qkv_before[2 * EMBED :], rtol=0, atol=0)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits_after, logits_before, rtol=1e-4, atol=1e-4)

    fresh = string_vit(seed + 10)  # a folded checkpoint restores the folded state with the folded weights
    fresh.load_state_dict(model.state_dict())
    assert all(m.folded for m in fresh.vispos.attention)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), before, rtol=1e-4, atol=1e-5)
    fold_string(model)  # a second fold is a no-op
    with torch.no_grad():
        torch.testing.assert_close(model(x), after, rtol=0, atol=0)


def test_fold_string_refuses_what_it_cannot_fold() -> None:
    with pytest.raises(ValueError, match=r"identity q/k norms"):
        fold_string(string_vit(0, qk_norm=True))
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=1)
    with pytest.raises(ValueError, match=r"patched with pos='string2d'"):
        fold_string(vispos.patch(model, "rope2d"))


# --- LieRE and ComRoPE ---------------------------------------------------------------------------------


def published_generators(name: str, enc: nn.Module) -> torch.Tensor:
    """The generators [heads, 2 (x, y), M, b, b] as the papers' code defines them, from the raw parameters."""
    if name == "liere2d":  # LieRE: U - U^T, U the strict upper triangle of the raw parameters
        upper = torch.triu(enc.raw.detach().double(), diagonal=1)
        return upper - upper.transpose(-1, -2)
    skew = enc.base.detach().double() - enc.base.detach().double().transpose(-1, -2)  # P_m - P_m^T
    if enc.variant == "ld":  # B_km = theta_km (P_m - P_m^T)
        return skew[:, None] * enc.scale.detach().double()[None, :, :, None, None]
    blocks = skew.shape[1]
    gens = torch.zeros(skew.shape[0], 2, *skew.shape[1:], dtype=torch.float64)
    for axis in range(2):
        for m in range(blocks):
            if m % 2 == axis:  # B_km = P_m - P_m^T when m = k (mod number of axes)
                gens[:, axis, m] = skew[:, m]
    return gens


# LieRE in its block form per head (its defaults, dense and shared: tests/test_liere_comrope_sources.py)
LIERE_BLOCKS = {"block_size": 4, "per_head": True}
VARIANTS = [("liere2d", LIERE_BLOCKS), ("comrope2d", {"variant": "ap"}), ("comrope2d", {"variant": "ld"})]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("name", "options"), VARIANTS)
@pytest.mark.parametrize("coords", ["normalized", "pixel"])
def test_block_rotations_are_the_matrix_exponential_of_the_published_generators(
    name: str, options: dict, coords: str, seed: int
) -> None:
    enc = build(name, seed, coords=coords, **options)
    gens = published_generators(name, enc)  # [heads, 2, M, b, b]
    torch.testing.assert_close(enc.generators().double(), gens, rtol=1e-6, atol=1e-6)
    c = xy(GRID, coords)  # [N, 2]
    dense_gen = block_diag(gens)  # [heads, 2, d, d]
    total = c[None, :, 0, None, None] * dense_gen[:, None, 0] + c[None, :, 1, None, None] * dense_gen[:, None, 1]
    rotations = torch.linalg.matrix_exp(total)  # [heads, N, d, d], dense, float64
    out = enc(GRID)
    torch.testing.assert_close(block_diag(out.blocks.double()), rotations, rtol=1e-4, atol=1e-4)
    q, k = content(seed, HEADS, HEAD_DIM), content(seed + 7, HEADS, HEAD_DIM)
    expected = dense_logits(rotations, q, k).float()
    torch.testing.assert_close(scheme_logits(enc, GRID, q=q, k=k), expected, rtol=1e-3, atol=1e-3)


def commutator(gens: torch.Tensor) -> torch.Tensor:
    """|A_x A_y - A_y A_x| relative to |A_x| |A_y| (Frobenius), per head: [heads]."""
    a, b = gens[:, 0], gens[:, 1]
    return (a @ b - b @ a).flatten(1).norm(dim=1) / (a.flatten(1).norm(dim=1) * b.flatten(1).norm(dim=1))


@pytest.mark.parametrize("seed", SEEDS)
def test_comrope_generators_commute_and_its_logits_are_relative_but_liere_neither(seed: int) -> None:
    for variant in ("ap", "ld"):
        enc = build("comrope2d", seed, variant=variant)
        assert commutator(enc.generators().detach()).max() < 1e-6, variant
        assert translation_error(logits(enc, seed), GRID).max() < FP, variant
    liere = build("liere2d", seed, **LIERE_BLOCKS)
    assert commutator(liere.generators().detach()).min() > CLEAR
    assert translation_error(logits(liere, seed), GRID).min() > CLEAR  # LieRE is not exactly relative


@pytest.mark.parametrize("seed", SEEDS)
def test_breaking_commutativity_breaks_the_relative_property(seed: int) -> None:
    """The negative control of the test above: ComRoPE-AP with every block turning with both axes
    (its axis mask removed) is LieRE-like, and its logits stop being functions of offsets alone."""
    enc = build("comrope2d", seed, variant="ap")
    enc.mask = torch.ones_like(enc.mask)
    with torch.no_grad():
        enc.base.copy_(content(seed, *enc.base.shape))
    gens = enc.generators().detach()
    gens[:, 1] = gens[:, 1].flip(-1)  # a different skew matrix per axis: no longer commuting
    assert commutator(gens).min() > CLEAR
    enc.generators = lambda: gens  # type: ignore[method-assign]
    assert translation_error(logits(enc, seed), GRID).min() > CLEAR


def test_liere_generators_that_commute_make_it_relative() -> None:
    """LieRE is relative exactly when its generators commute: y generators a multiple of the x ones."""
    enc = build("liere2d", 0, **LIERE_BLOCKS)
    with torch.no_grad():
        enc.raw[:, 1] = 0.5 * enc.raw[:, 0]
    assert commutator(enc.generators().detach()).max() < 1e-6
    assert translation_error(logits(enc, 0), GRID).max() < FP


def test_axis_partition_mask_gives_each_block_one_axis() -> None:
    mask = axis_partition_mask(2, 6)[..., 0, 0]  # [2, 6]
    assert mask.tolist() == [[1, 0, 1, 0, 1, 0], [0, 1, 0, 1, 0, 1]]


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("comrope2d", {"dim": 12, "block_size": 4}, r"divisible by 8"),  # AP: two axes x blocks of 4
        ("comrope2d", {"variant": "xy"}, r"accepted: ap, ld"),
        ("liere2d", {"dim": 18, "block_size": 4}, r"divisible by 4"),
        ("liere2d", {"block_size": 1}, r"block_size must be >= 2"),
        ("string2d", {"freqs": "learned"}, r"accepted: mixed, axial, golden"),
    ],
)
def test_bad_options_are_refused(name: str, options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        vispos.create_encoding(name, **{"dim": HEAD_DIM, "num_heads": HEADS} | options)


# --- N-D axial RoPE -------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("coords", ["pixel", "normalized"])
def test_ropend_on_two_axes_is_rope2d(layout: str, coords: str) -> None:
    """(y, x) coordinates, half the channels per axis, the same theta: bit-equal to rope2d(axes='yx') with
    interleaved pairs; with ``half`` (pairs inside each axis's section) the same after gathering rope2d's
    channels of each axis together ([y pairs | their partners | x pairs | their partners])."""
    theta = 100.0
    split = (HEAD_DIM // 2, HEAD_DIM // 2)
    nd = vispos.create_encoding("ropend", dim=HEAD_DIM, split=split, theta=theta, layout=layout)
    axial = vispos.create_encoding("rope2d", dim=HEAD_DIM, theta=theta, layout=layout, axes="yx", coords=coords)
    yx = grid_coords(GRID, coords) * (2 * math.pi if coords == "normalized" else 1.0)  # DINOv3's 2 pi x coordinate
    q = HEAD_DIM // 4
    order = torch.arange(HEAD_DIM) if layout == "interleaved" else torch.cat(
        [torch.arange(q), torch.arange(q) + 2 * q, torch.arange(q) + q, torch.arange(q) + 3 * q]
    )  # fmt: skip
    got, want = nd.rotary(yx), axial(GRID)
    assert torch.equal(got.cos, want.cos[..., order]) and torch.equal(got.sin, want.sin[..., order])
    x = content(0, 1, 1, GRID[0] * GRID[1], HEAD_DIM)
    torch.testing.assert_close(got.rotate(x, x)[0], want.rotate(x[..., order.argsort()], x)[0][..., order])
    ids = vispos.create_encoding("ropend", dim=HEAD_DIM, split=(8, 8), theta=theta, layout=layout)
    yy, xx = torch.meshgrid(torch.arange(GRID[0]), torch.arange(GRID[1]), indexing="ij")
    if coords == "pixel":  # integer ids [2, N] through forward, as a 1D host hands them over
        out = ids(torch.stack((yy.flatten(), xx.flatten())))
        assert torch.equal(out.cos, got.cos) and torch.equal(out.sin, got.sin)


def test_ropend_presets_split_the_head_as_published() -> None:
    wan = vispos.create_encoding("ropend", dim=128, preset="wan")
    assert wan.split == (44, 42, 42) and wan.theta == 10000.0  # d - 4 (d // 6), 2 (d // 6), 2 (d // 6)
    hunyuan = vispos.create_encoding("ropend", dim=128, preset="hunyuanvideo")
    assert hunyuan.split == (16, 56, 56) and hunyuan.theta == 256.0
    vjepa = vispos.create_encoding("ropend", dim=64, preset="vjepa2")
    assert vjepa.split == (20, 20, 20)  # 2 * ((64 // 3) // 2) each; 4 channels unrotated
    ids = torch.randint(1, 9, (3, 11))
    rot = vjepa(ids)
    x = content(0, 1, 1, 11, 64)
    rx, _ = rot.rotate(x, x)
    torch.testing.assert_close(rx[..., 60:], x[..., 60:], rtol=0, atol=0)  # the channels after the sections
    assert (rx[..., :60] - x[..., :60]).abs().amax(dim=(0, 1, 2)).min() > 0  # every sectioned channel turns


@pytest.mark.parametrize("seed", SEEDS)
def test_ropend_logits_depend_on_3d_offsets_alone(seed: int) -> None:
    enc = vispos.create_encoding("ropend", dim=HEAD_DIM * 2, split=(12, 10, 10))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 6, (3, 9), generator=g)
    shift = torch.randint(0, 5, (3, 1), generator=g)
    q, k = content(seed, 1, 1, 9, HEAD_DIM * 2), content(seed + 1, 1, 1, 9, HEAD_DIM * 2)

    def logit(p: torch.Tensor) -> torch.Tensor:
        rq, rk = enc(p).rotate(q, k)
        return rq @ rk.transpose(-1, -2)

    torch.testing.assert_close(logit(ids + shift), logit(ids), rtol=1e-4, atol=1e-4)
    swapped = ids[[1, 0, 2]]  # the t and h ids exchanged: different logits (the split is not symmetric)
    assert (logit(swapped) - logit(ids)).abs().max() > CLEAR


def test_ropend_scales_each_axis_by_its_own_factor() -> None:
    enc = vispos.create_encoding(
        "ropend", dim=32, split=(8, 12, 12), scaling="linear", train_size=(4, 6, 6), scale_axes=(0,)
    )
    plain = vispos.create_encoding("ropend", dim=32, split=(8, 12, 12))
    (t, h, w), _ = enc.inv_freqs((8, 12, 12))  # twice the training length on every axis; only t scaled
    (t0, h0, w0), _ = plain.inv_freqs((8, 12, 12))
    torch.testing.assert_close(t, t0 / 2, rtol=0, atol=0)
    assert torch.equal(h, h0) and torch.equal(w, w0)
    everywhere = vispos.create_encoding("ropend", dim=32, split=(8, 12, 12), scaling="linear", train_size=(4, 6, 3))
    (t, h, w), _ = everywhere.inv_freqs((8, 12, 12))
    torch.testing.assert_close(torch.cat((t, h, w)), torch.cat((t0 / 2, h0 / 2, w0 / 4)), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"needs train_size"):
        vispos.create_encoding("ropend", dim=32, scaling="linear")
