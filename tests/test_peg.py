"""CPVT's PEG (``peg2d``): timm's ``PosConv`` maths on the same weights, prefix tokens untouched, placed by
``vispos.patch`` after a chosen block, in every forward path of a patched timm ViT."""

from __future__ import annotations

import copy
import pickle

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.models.twins import PosConv

import vispos
from vispos.encodings.peg import Peg2d

GRID = (5, 7)  # not square: a row/column mix-up cannot hide
DIM = 24
PATCH = 4


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


def test_a_token_subset_is_convolved_on_the_zero_grid_holding_it() -> None:
    """Kept patches (patch dropout, MAE) sit at their own grid places; the dropped ones read as zeros:
    timm's PosConv of the full grid with the dropped rows zeroed, read at the kept places."""
    timm_peg, peg = pair(4)
    n, p = GRID[0] * GRID[1], 2
    keep = torch.stack([torch.randperm(n, generator=torch.Generator().manual_seed(s))[:12] for s in (0, 1)])  # [2, 12]
    full = randn(5, 2, n, DIM)
    kept = full.gather(1, keep[:, :, None].expand(-1, -1, DIM))  # [2, 12, C]
    prefix = randn(6, 2, p, DIM)
    tokens = torch.cat((torch.arange(p).expand(2, p), keep + p), dim=1)  # as PositionContext.tokens holds them
    zeroed = torch.zeros_like(full).scatter(1, keep[:, :, None].expand(-1, -1, DIM), kept)
    with torch.no_grad():
        expected = timm_peg(zeroed, GRID).gather(1, keep[:, :, None].expand(-1, -1, DIM))
        out = peg(torch.cat((prefix, kept), dim=1), GRID, num_prefix_tokens=p, tokens=tokens)
        torch.testing.assert_close(out[:, :p], prefix, rtol=0, atol=0)
        torch.testing.assert_close(out[:, p:], expected, rtol=1e-6, atol=1e-6)
        first = torch.cat((torch.arange(p).expand(2, p), torch.arange(12).expand(2, 12) + p), dim=1)
        wrong = peg(torch.cat((prefix, kept), dim=1), GRID, num_prefix_tokens=p, tokens=first)
        assert (wrong[:, p:] - expected).abs().max() > 1e-2  # control: the kept places matter
    with pytest.raises(ValueError, match=r"do not fit 2 prefix tokens \+ a subset of 12 patches"):
        peg(torch.cat((prefix, kept[:, :5]), dim=1), GRID, num_prefix_tokens=p, tokens=tokens)


# --- in a patched timm ViT: vispos.patch(model, "peg2d", after=k) ---------------------------------------------
def timm_vit(kind: str, seed: int = 0) -> torch.nn.Module:
    """A random 3-block ViT at a 5 x 7 training grid with a cls token and registers (prefix tokens)."""
    torch.manual_seed(seed)
    size = dict(img_size=(GRID[0] * PATCH, GRID[1] * PATCH), patch_size=PATCH, embed_dim=DIM, depth=3, num_heads=2)
    if kind == "eva":
        return timm.create_model("vit_small_patch16_rope_224", **size, num_reg_tokens=1, num_classes=3)
    return timm.create_model("vit_tiny_patch16_224", **size, reg_tokens=2, num_classes=3)


def randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Layer scales at 1 and every PEG weight random, so that a PEG in the wrong place shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gamma_1", "gamma_2", "ls1.gamma", "ls2.gamma")):
                p.fill_(1.0)
        if getattr(model, "vispos", None) is not None and model.vispos.conditional is not None:
            model.vispos.conditional.proj.weight.copy_(randn(seed, DIM, 1, 3, 3) * 0.5)
            model.vispos.conditional.proj.bias.copy_(randn(seed + 1, DIM))
    return model


def timm_posconv(model: torch.nn.Module) -> PosConv:
    """timm's PosConv holding the patched model's PEG weights."""
    ref = PosConv(DIM, DIM)
    ref.proj[0].load_state_dict(model.vispos.conditional.proj.state_dict())
    return ref


def by_hand(plain: torch.nn.Module, posconv: PosConv, image: torch.Tensor, after: int) -> list[torch.Tensor]:
    """Each block's output [B, P + HW, C] of an unpatched timm model (no positions of its own: blocks called
    without rope, no pos_embed), its patch embedding written out as a strided conv, timm's PosConv after
    block ``after``: CPVT's forward."""
    h, w = image.shape[-2] // PATCH, image.shape[-1] // PATCH
    proj = plain.patch_embed.proj
    x = F.conv2d(image, proj.weight, proj.bias, stride=PATCH).flatten(2).transpose(1, 2)  # [B, HW, C]
    prefix = [t.expand(x.shape[0], -1, -1) for t in (plain.cls_token, plain.reg_token) if t is not None]
    x = plain.norm_pre(torch.cat((*prefix, x), dim=1))
    p, outs = plain.num_prefix_tokens, []
    for i, blk in enumerate(plain.blocks):
        x = blk(x)
        if i == after:
            x = torch.cat((x[:, :p], posconv(x[:, p:], (h, w))), dim=1)
        outs.append(x)
    return outs


def patched_and_plain(kind: str, after: int, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    plain = randomized(timm_vit(kind, seed), seed).eval()
    if kind == "eva":
        plain.rope = None  # the reference has no positions but the PEG's
    model = vispos.patch(copy.deepcopy(plain), "peg2d", after=after, inherit=False)
    return randomized(model, seed).eval(), plain


@pytest.mark.parametrize("kind", ["vit", "eva"])
@pytest.mark.parametrize("after", [0, 2])
def test_patched_peg2d_equals_timm_blocks_with_posconv_after_the_chosen_block(kind: str, after: int) -> None:
    model, plain = patched_and_plain(kind, after)
    posconv = timm_posconv(model)
    assert model.num_prefix_tokens == (2 if kind == "eva" else 3)  # cls + registers pass through the PEG
    for h, w in [GRID, (8, 6)]:  # the training grid and another, both not square
        x = randn(h * w, 2, 3, h * PATCH, w * PATCH)
        with torch.no_grad():
            expected = by_hand(plain, posconv, x, after)
            torch.testing.assert_close(model.forward_features(x), plain.norm(expected[-1]), rtol=1e-5, atol=1e-5)
            shifted = by_hand(plain, posconv, x, after + 1)[-1] if after < 2 else by_hand(plain, posconv, x, 0)[-1]
            assert (model.forward_features(x) - plain.norm(shifted)).abs().max() > 1e-3  # control: another block


@pytest.mark.parametrize("kind", ["vit", "eva"])
def test_forward_intermediates_sees_the_peg_after_its_block(kind: str) -> None:
    model, plain = patched_and_plain(kind, after=1)
    x = randn(9, 2, 3, 8 * PATCH, 6 * PATCH)
    p = model.num_prefix_tokens
    with torch.no_grad():
        expected = by_hand(plain, timm_posconv(model), x, after=1)
        final, inter = model.forward_intermediates(x, output_fmt="NLC")
        assert len(inter) == 3
        for got, want in zip(inter, expected, strict=True):
            torch.testing.assert_close(got, want[:, p:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final, plain.norm(expected[-1]), rtol=1e-5, atol=1e-5)


def test_gradient_checkpointing_applies_the_peg_and_trains_it() -> None:
    model, plain = patched_and_plain("vit", after=0)
    model.set_grad_checkpointing(True)
    model.train()  # no dropout in this model: training mode changes nothing but the path
    x = randn(4, 2, 3, GRID[0] * PATCH, GRID[1] * PATCH)
    out = model.forward_features(x)
    with torch.no_grad():
        torch.testing.assert_close(out, plain.norm(by_hand(plain, timm_posconv(model), x, 0)[-1]), rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    for name, p in model.vispos.conditional.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_peg2d_beside_an_additive_and_an_attention_scheme() -> None:
    """learned2d + rope2d + peg2d: the model's own blocks (positions from the context, the hook left out by
    calling ``forward``), timm's PosConv between blocks 1 and 2."""
    torch.manual_seed(0)
    model = vispos.patch(timm_vit("vit"), ["rope2d", "peg2d", "learned2d"], after=1, theta=50.0)
    model = randomized(model, 3).eval()
    assert model.vispos_cfg["pos"] == ["learned2d", "rope2d", "peg2d"]  # one order, whatever the order given
    assert model.vispos_cfg["options"] == {"after": 1, "theta": 50.0}
    x = randn(5, 2, 3, 8 * PATCH, 6 * PATCH)
    posconv, p = timm_posconv(model), model.num_prefix_tokens
    with torch.no_grad():
        ctx = model.vispos_context(x)
        tokens = model.norm_pre(model._pos_embed(model.patch_embed(x)))
        for i, blk in enumerate(model.blocks):
            tokens = blk.forward(tokens, attn_mask=ctx)  # forward, not __call__: without the hook
            if i == 1:
                tokens = torch.cat((tokens[:, :p], posconv(tokens[:, p:], (8, 6))), dim=1)
        torch.testing.assert_close(model.forward_features(x), model.norm(tokens), rtol=1e-5, atol=1e-5)


def test_peg_gives_nope_positions_and_copies_carry_their_own_peg() -> None:
    model, _ = patched_and_plain("vit", after=0)
    x = randn(2, 1, 3, GRID[0] * PATCH, GRID[1] * PATCH)
    shuffled = x.reshape(1, 3, 5, 4, 7, 4).flip(2).reshape(1, 3, 20, 28)  # patch rows in reverse order
    with torch.no_grad():
        out, out_shuffled = model(x), model(shuffled)
        assert (out - out_shuffled).abs().max() > 1e-4  # the PEG sees where the patches are
        off = copy.deepcopy(model)
        vispos.set_position_enabled(off, False)  # DroPE switches the PEG off too: nothing sees positions
        torch.testing.assert_close(off(shuffled), off(x), rtol=1e-4, atol=1e-5)
        twin = copy.deepcopy(model)
        twin.vispos.conditional.proj.bias.add_(randn(5, DIM))  # the copy's hook uses the copy's PEG
        assert (twin(x) - out).abs().max() > 1e-4
        torch.testing.assert_close(model(x), out, rtol=0, atol=0)
        pickled = pickle.loads(pickle.dumps(model))
        torch.testing.assert_close(pickled(x), out, rtol=0, atol=0)
        pickled.vispos.conditional.proj.bias.zero_()
        assert (pickled(x) - out).abs().max() > 1e-4  # the unpickled model's hook uses its own PEG


def test_peg_weights_are_not_decayed_and_sit_in_their_blocks_group() -> None:
    """As timm's Twins treats its PosConv (no weight decay on pos_block.*); for layer-wise lr decay the PEG
    joins the block it follows."""
    from timm.models._manipulate import group_parameters

    model = vispos.patch(timm_vit("vit"), "peg2d", after=2)
    assert {"vispos.conditional.proj.weight", "vispos.conditional.proj.bias"} <= model.no_weight_decay()
    groups = group_parameters(model, model.group_matcher())
    home = next(g for g, names in groups.items() if "blocks.2.mlp.fc2.weight" in names)
    assert {"vispos.conditional.proj.weight", "vispos.conditional.proj.bias"} <= set(groups[home])


def test_peg2d_settings_and_refusals() -> None:
    model = vispos.patch(timm_vit("vit"), "peg2d", after=1, kernel_size=5)
    assert model.vispos_cfg["pos"] == ["peg2d"] and model.vispos.conditional.kernel_size == 5
    assert "vispos.conditional.proj.weight" in model.state_dict()
    other = vispos.patch(timm_vit("vit"), "peg2d", after=0, kernel_size=5)
    with pytest.raises(ValueError, match=r"peg2d\(after=1, kernel_size=5\).*this model's are peg2d\(after=0"):
        other.load_state_dict(model.state_dict())  # a PEG elsewhere is another model
    with pytest.raises(ValueError, match=r"after=3 is out of range; the model has 3 blocks \(after=0 to 2\)"):
        vispos.patch(timm_vit("vit"), "peg2d", after=3)
    with pytest.raises(ValueError, match=r"at most one additive .* one conditional scheme.*conditional: peg2d"):
        vispos.patch(timm_vit("vit"), ["peg2d", "peg2d"])
    with pytest.raises(TypeError, match=r"unknown option\(s\) after for rope2d"):
        vispos.patch(timm_vit("vit"), "rope2d", after=1)
    with pytest.raises(ValueError, match=r"needs the positional context"):
        model.blocks[1](torch.zeros(1, 3 + 35, DIM))  # a block alone, without the context


def test_peg2d_is_in_the_catalogue_as_a_conditional_scheme() -> None:
    info = vispos.get_info("peg2d")
    assert info.kind == "conditional" and info.trainable and not info.relative
    assert info.options == ["kernel_size", "after"] and info.context == ("dim",)
    assert "| `peg2d` | 2D | conditional | tokens after a block (conv on the grid) | yes | no |" in vispos.describe(2)
    assert vispos.list_encodings(2, kind="conditional") == ["peg2d"]


def test_layer_logits_past_the_peg_see_its_positions() -> None:
    """``layer_logits`` of a layer after the PEG: q . k of the layer's own projections on the PEG's tokens
    (content at every patch, timm's PosConv), by hand; the layer before it sees content alone (constant)."""
    from vispos.diagnostics import layer_logits, translation_error

    model, _ = patched_and_plain("vit", after=0)
    c, p, (h, w) = randn(7, DIM), model.num_prefix_tokens, (6, 8)
    with torch.no_grad():
        tokens = model._pos_embed(c.expand(1, h, w, DIM))  # [1, P + HW, C]: prefix tokens, then the content
        tokens = torch.cat((tokens[:, :p], timm_posconv(model)(tokens[:, p:], (h, w))), dim=1)
        attn = model.blocks[1].attn
        q, k, _ = attn.qkv(tokens).reshape(1, -1, 3, 2, DIM // 2).permute(2, 0, 3, 1, 4)  # [1, heads, N, d] each
        expected = (q @ k.transpose(-2, -1) * attn.scale)[0, :, p:, p:]
        torch.testing.assert_close(layer_logits(model, (h, w), layer=1, content=c), expected, rtol=1e-5, atol=1e-5)
        assert translation_error(expected, (h, w)).min() > 1e-2  # the borders: not relative
        first = layer_logits(model, (h, w), layer=0, content=c)
        torch.testing.assert_close(first, first[:, :1, :1].expand_as(first), rtol=1e-5, atol=1e-5)
