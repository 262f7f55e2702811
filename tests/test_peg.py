"""CPVT's PEG: timm's ``PosConv`` maths on the same weights, prefix tokens untouched, placed after a block."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from timm.models.twins import PosConv

import vispos
from vispos.encodings.peg import Peg2d, add_peg

GRID = (5, 7)  # not square: a row/column mix-up cannot hide
DIM = 24


def randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def pair(seed: int) -> tuple[PosConv, Peg2d]:
    """timm's PosConv and a Peg2d holding the same random weights."""
    timm_peg = PosConv(DIM, DIM)
    with torch.no_grad():
        timm_peg.proj[0].weight.copy_(randn(seed, DIM, 1, 3, 3))
        timm_peg.proj[0].bias.copy_(randn(seed + 1, DIM))
    peg = Peg2d(dim=DIM)
    peg.proj.load_state_dict(timm_peg.proj[0].state_dict())  # the same Conv2d layout: weights move as they are
    return timm_peg, peg


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("grid", [GRID, (7, 5), (1, 4)])
def test_peg_equals_timm_posconv_on_the_same_weights(grid: tuple[int, int], seed: int) -> None:
    timm_peg, peg = pair(seed)
    x = randn(seed + 2, 2, grid[0] * grid[1], DIM)
    with torch.no_grad():
        expected = timm_peg(x, grid)
        torch.testing.assert_close(peg(x, grid), expected, rtol=1e-6, atol=1e-6)
        if grid[0] != grid[1]:  # the negative control: the tokens read on the transposed grid
            assert (peg(x, grid[::-1]) - expected).abs().max() > 1e-2


def test_peg_leaves_prefix_tokens_and_convolves_the_patches() -> None:
    timm_peg, peg = pair(0)
    x = randn(3, 2, 2 + GRID[0] * GRID[1], DIM)
    with torch.no_grad():
        out = peg(x, GRID, num_prefix_tokens=2)
        torch.testing.assert_close(out[:, :2], x[:, :2], rtol=0, atol=0)
        torch.testing.assert_close(out[:, 2:], timm_peg(x[:, 2:], GRID), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"do not fit 1 prefix tokens \+ a 5x7 grid"):
        peg(x, GRID, num_prefix_tokens=1)
    with pytest.raises(ValueError, match=r"kernel_size must be odd"):
        Peg2d(dim=DIM, kernel_size=2)


def vit(after: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model(
        "vit_tiny_patch16_224", img_size=(20, 28), patch_size=4, embed_dim=DIM, depth=3, num_heads=2,
        reg_tokens=1, num_classes=3,
    )  # fmt: skip
    vispos.patch(model, "nope")
    add_peg(model, after=after)
    with torch.no_grad():
        model.peg.proj.weight.copy_(randn(seed, DIM, 1, 3, 3))
    return model.eval()


@pytest.mark.parametrize("after", [0, 2])
def test_peg_follows_the_chosen_block_in_a_patched_vit(after: int) -> None:
    model = vit(after)
    x = randn(1, 2, 3, 24, 32)  # another grid than training: 6 x 8
    with torch.no_grad():
        got = model.forward_features(x)
        ctx = model.vispos_context(x)
        tokens = model.norm_pre(model._pos_embed(model.patch_embed(x)))
        plain = copy.deepcopy(model)  # the same blocks without the hook, run by hand
        for blk in plain.blocks:
            blk._forward_hooks.clear()
        for i, blk in enumerate(plain.blocks):
            tokens = blk(tokens, attn_mask=ctx)
            if i == after:
                tokens = model.peg(tokens, (6, 8), num_prefix_tokens=2)  # cls + register pass through
        torch.testing.assert_close(got, plain.norm(tokens), rtol=1e-5, atol=1e-5)
    assert "peg.proj.weight" in model.state_dict()


def test_peg_gives_nope_positions_and_copies_carry_their_own_peg() -> None:
    model = vit(0)
    x = randn(2, 1, 3, 20, 28)
    shuffled = x.reshape(1, 3, 5, 4, 7, 4).flip(2).reshape(1, 3, 20, 28)  # patch rows in reverse order
    with torch.no_grad():
        out, out_shuffled = model(x), model(shuffled)
        assert (out - out_shuffled).abs().max() > 1e-4  # the PEG sees where the patches are
        nope = copy.deepcopy(model)
        nope.blocks[0]._forward_hooks.clear()
        torch.testing.assert_close(nope(shuffled), nope(x), rtol=1e-4, atol=1e-5)  # nope alone does not
        twin = copy.deepcopy(model)
        twin.peg.proj.bias.add_(randn(5, DIM))  # the copy's hook uses the copy's PEG, not the original's
        assert (twin(x) - out).abs().max() > 1e-4
        torch.testing.assert_close(model(x), out, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"already has a PEG"):
        add_peg(model)
    with pytest.raises(ValueError, match=r"after=3 is out of range; the model has 3 blocks"):
        add_peg(vispos.patch(timm.create_model("vit_tiny_patch16_224", img_size=32, depth=3), "nope"), after=3)
    with pytest.raises(ValueError, match=r"patched by vispos"):
        add_peg(timm.create_model("vit_tiny_patch16_224", img_size=32, depth=1))
