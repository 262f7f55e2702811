"""``liere2d`` and ``comrope2d`` with their defaults against the official code, transcribed here as formulas.

- LieRE (StanfordMIMI/LieRE, ``models/rope_vit.py``, ``LierePositionEncoder``; README's core): raw
  parameters ``torch.rand(A, layers, G, b, b) * 2 pi``, generators (U - 1/2) - (U - 1/2)^T with U their
  strict upper triangle, b = ``generator_dim`` 64 = the head dimension (``ModelArgs``; dense), one set
  for the network (``rotary_embedding_per_layer`` / ``_per_head`` False); positions
  ``cartesian_prod(linspace(0, n_a / e_a, n_a))`` per axis a (rows first), n_a patches now, e_a at
  training; rotation ``matrix_exp(sum_a p_a A_a)`` on the first b channels of q and k, cls unrotated.
- ComRoPE (Longin-Yu/ComRoPE, ``model.py``): positions ``(i + 0.5) / n`` (``axis_scale``), rows first;
  ``freqs`` drawn N(0, init_std = 1) per head [heads, 1, M, b, b], skew F - F^T; AP: block m turns with
  axis m mod 2; LD: times ``multiplier`` N(0, 1) [1, axes, M, 1, 1]; R = ``matrix_exp`` per block.
  Block size 8.

vispos indexes generators (x, y); the sources' axis 0 is the row (y): the transcriptions map the axes.
"""

from __future__ import annotations

import math

import pytest
import timm
import torch

import vispos

HEADS, HEAD_DIM = 2, 16
TRAIN = (4, 6)  # training grid (rows, columns)


def content(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def rotate(enc: torch.nn.Module, grid: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
    out, _ = enc(grid).rotate(x, x)
    return out.double()


# --- LieRE --------------------------------------------------------------------------------------------------


def liere_positions(grid: tuple[int, int], train: tuple[int, int]) -> torch.Tensor:
    """[N, 2] (row, column): LieRE's ``PositionEncoderBase`` for an image of ``grid`` patches."""
    axes = [torch.linspace(0, n / e, n, dtype=torch.float64) for n, e in zip(grid, train, strict=True)]
    return torch.cartesian_prod(*axes)


def liere_rotate(raw_yx: torch.Tensor, grid: tuple[int, int], train: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
    """LieRE's rotation of x [B, heads, N, d]; raw_yx [2 (row, column), b, b] as LieRE orders its axes."""
    upper = torch.triu(raw_yx.double(), diagonal=1) - 0.5
    bases = upper - upper.transpose(-1, -2)  # [2, b, b]
    pos = liere_positions(grid, train)  # [N, 2]
    rotation = torch.matrix_exp((pos[:, :, None, None] * bases).sum(1))  # [N, b, b]
    b = bases.shape[-1]
    turned = (rotation @ x[..., :b].double().unsqueeze(-1)).squeeze(-1)
    return torch.cat((turned, x[..., b:].double()), dim=-1)


def liere(seed: int, **options: object) -> torch.nn.Module:
    torch.manual_seed(seed)
    return vispos.create_encoding("liere2d", dim=HEAD_DIM, num_heads=HEADS, train_grid=TRAIN, **options)


@pytest.mark.parametrize("grid", [TRAIN, (8, 12), (5, 3), (1, 6)])
def test_liere_defaults_are_liere_dense_shared_rotation_on_its_coordinates(grid: tuple[int, int]) -> None:
    enc = liere(0)
    assert enc.raw.shape == (2, 1, HEAD_DIM, HEAD_DIM)  # one dense generator per axis, no head axis
    raw_yx = enc.raw.detach()[[1, 0], 0]  # vispos (x, y) -> LieRE's (row, column)
    x = content(1, 2, HEADS, grid[0] * grid[1], HEAD_DIM)
    torch.testing.assert_close(rotate(enc, grid, x), liere_rotate(raw_yx, grid, TRAIN, x), rtol=0, atol=1e-4)


def test_liere_init_range_is_liere_uniform_zero_to_two_pi() -> None:
    """The raw parameters are LieRE's draw, torch.rand(...) * 2 pi, value for value under one seed."""
    enc = liere(3)
    torch.manual_seed(3)
    want = torch.rand(2, 1, 1, HEAD_DIM, HEAD_DIM) * 2 * math.pi  # [A, layers, G, b, b]
    torch.testing.assert_close(enc.raw.detach(), want.reshape(enc.raw.shape), rtol=0, atol=0)


def test_liere_coordinates_keep_the_patch_spacing_beyond_the_training_grid() -> None:
    """At twice the training grid LieRE's coordinates reach about 2 (extrapolation), not 1."""
    from vispos.encodings.liere import xy_coords

    at_train = xy_coords(TRAIN, "liere", None, train_grid=TRAIN)
    at_twice = xy_coords((8, 12), "liere", None, train_grid=TRAIN)
    assert at_train.amax(0).tolist() == pytest.approx([1.0, 1.0])
    assert at_twice.amax(0).tolist() == pytest.approx([2.0, 2.0])


def test_liere_block_form_per_head_stays_reachable() -> None:
    enc = liere(0, block_size=4, per_head=True)
    assert enc.raw.shape == (HEADS, 2, HEAD_DIM // 4, 4, 4)
    assert enc(TRAIN).blocks.shape == (HEADS, 24, HEAD_DIM // 4, 4, 4)


def tiny_vit(pos: str, **options: object) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", img_size=(16, 24), patch_size=4, embed_dim=HEADS * HEAD_DIM, depth=3,
        num_heads=HEADS, num_classes=3,
    )  # fmt: skip
    return vispos.patch(model, pos, **options)


def test_liere_is_shared_by_the_layers_unless_per_layer() -> None:
    shared = tiny_vit("liere2d")
    assert isinstance(shared.vispos.attention, vispos.encodings.Liere2d)  # one module for the network
    assert shared.vispos.attention.train_grid == TRAIN
    layered = tiny_vit("liere2d", per_layer=True)
    assert isinstance(layered.vispos.attention, torch.nn.ModuleList) and len(layered.vispos.attention) == 3
    with torch.no_grad():
        assert shared(torch.randn(1, 3, 16, 24)).isfinite().all()


# --- ComRoPE --------------------------------------------------------------------------------------------------


def comrope_positions(grid: tuple[int, int]) -> torch.Tensor:
    """[N, 2] (row, column): meshgrid of arange per axis, (p + 0.5) / n."""
    rows, cols = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    pos = torch.stack((rows, cols), dim=-1).view(-1, 2).double()
    return (pos + 0.5) / torch.tensor(grid, dtype=torch.float64)


def comrope_rotate(enc: torch.nn.Module, grid: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
    """The official rotation of x [B, heads, N, d] from vispos's parameters, axes mapped to rows first."""
    freqs = enc.base.detach().double()[:, None]  # [heads, 1, M, b, b]
    skew = freqs - freqs.transpose(-1, -2)
    m = skew.shape[2]
    if enc.variant == "ld":
        multiplier = enc.scale.detach().double()[[1, 0]].view(1, 2, m, 1, 1)  # (x, y) -> (row, column)
        exponent = skew * multiplier  # [heads, 2, M, b, b]
    else:
        mask = torch.zeros(2, m, dtype=torch.float64)
        for axis in range(2):
            mask[axis, axis::2] = 1.0
        mask = mask[[1, 0]]  # vispos's block m turns with x when m is even: the official axis 1
        exponent = skew.expand(-1, 2, -1, -1, -1) * mask.view(1, 2, m, 1, 1)
    pos = comrope_positions(grid)  # [N, 2]
    ln_r = (pos[:, None, :, None, None, None] * exponent[None]).sum(2)  # [N, heads, M, b, b]
    rotation = torch.matrix_exp(ln_r).transpose(0, 1)  # [heads, N, M, b, b]
    b = skew.shape[-1]
    blocks = x.double().unflatten(-1, (m, b)).unsqueeze(-1)  # [B, heads, N, M, b, 1]
    return (rotation @ blocks).squeeze(-1).flatten(-2)


@pytest.mark.parametrize("variant", ["ap", "ld"])
@pytest.mark.parametrize("grid", [(6, 6), (4, 7)])
def test_comrope_defaults_are_the_official_rotation(variant: str, grid: tuple[int, int]) -> None:
    torch.manual_seed(4)
    enc = vispos.create_encoding("comrope2d", dim=HEAD_DIM, num_heads=HEADS, variant=variant)
    assert enc.block_size == 8 and enc.coords == "unit"
    x = content(5, 2, HEADS, grid[0] * grid[1], HEAD_DIM)
    torch.testing.assert_close(rotate(enc, grid, x), comrope_rotate(enc, grid, x), rtol=0, atol=1e-4)


def test_comrope_init_is_the_official_draw() -> None:
    """freqs N(0, 1) [heads, 1, M, b, b], then (LD) the multiplier N(0, 1) [1, 2, M, 1, 1], in that order."""
    torch.manual_seed(6)
    enc = vispos.create_encoding("comrope2d", dim=HEAD_DIM, num_heads=HEADS, variant="ld")
    torch.manual_seed(6)
    freqs = torch.randn(HEADS, 1, HEAD_DIM // 8, 8, 8) * 1.0
    multiplier = torch.randn(1, 2, HEAD_DIM // 8, 1, 1)
    torch.testing.assert_close(enc.base.detach(), freqs[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(enc.scale.detach(), multiplier.view(2, HEAD_DIM // 8), rtol=0, atol=0)


@pytest.mark.parametrize("scheme", ["comrope2d", "liere2d"])
def test_rotations_exponentiated_in_token_slices_equal_one_call(scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large grid's exponent goes to ``matrix_exp`` in slices of tokens (bounded scratch memory): bit for bit
    the rotations of one call."""
    from vispos.encodings import liere

    torch.manual_seed(0)
    context = {"dim": HEAD_DIM, "num_heads": HEADS, "train_grid": TRAIN}
    enc = vispos.create_encoding(scheme, **{k: context[k] for k in vispos.get_info(scheme, 2).context})
    with torch.no_grad():
        for p in enc.parameters():
            p.normal_(std=0.5)
        whole = enc((9, 7)).blocks.clone()
        monkeypatch.setattr(liere, "EXP_CHUNK", 1)  # two tokens per call (the least), three in the last
        enc.cache.size = 0
        sliced = enc((9, 7)).blocks
    assert torch.equal(sliced, whole)
    weights = torch.randn(whole.shape, generator=torch.Generator().manual_seed(1))
    grads = []
    for chunk in (liere.EXP_CHUNK, 2**40):  # training through the slices: the gradients of one call
        monkeypatch.setattr(liere, "EXP_CHUNK", chunk)
        enc.zero_grad()
        (enc((9, 7)).blocks * weights).sum().backward()
        grads.append([p.grad.clone() for p in enc.parameters()])
    for sliced_grad, whole_grad in zip(*grads, strict=True):
        torch.testing.assert_close(sliced_grad, whole_grad)
