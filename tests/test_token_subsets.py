"""Positions follow tokens when only some of them are kept: timm's patch dropout and MAE-style masking.

The reference a kept-token forward is held against is independent of the gather that implements it: the
full grid, run with an attention mask that hides the dropped tokens as keys, gives every kept token the
same output (attention is per token; additive tables are added before tokens are dropped)."""

from __future__ import annotations

import pytest
import timm
import torch

import vispos

SCHEMES_2D = [*vispos.list_encodings(2), ["learned2d", "relbias2d"]]
MODELS = {"vit": "vit_tiny_patch16_224", "eva_rope": "vit_small_patch16_rope_224"}
GRID = 16  # 64 px / 16 px patches: a 4 x 4 grid


def ids(scheme: str | list[str]) -> str:
    return scheme if isinstance(scheme, str) else "+".join(scheme)


def layer_scales_to_one(model: torch.nn.Module) -> None:
    """timm's 1e-5 layer-scale init hides differences in attention; compare with it at 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("ls1.gamma", "ls2.gamma", "gamma_1", "gamma_2")):
                p.fill_(1.0)


def make(model: str, pos: str | list[str], drop: float = 0.5, **options: object) -> torch.nn.Module:
    torch.manual_seed(0)
    net = timm.create_model(MODELS[model], img_size=64, depth=2, num_classes=3, patch_drop_rate=drop)
    net = vispos.patch(net, pos, inherit=False, **options)
    layer_scales_to_one(net)
    return net


def images() -> torch.Tensor:
    return torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))


def timm_keep(seed: int, batch: int = 2, tokens: int = GRID, prob: float = 0.5) -> torch.Tensor:
    """The kept patch indices timm's patch dropout draws after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return torch.argsort(torch.randn(batch, tokens), dim=-1)[:, : max(1, int(tokens * (1 - prob)))]


class DroppedAsZeros(torch.nn.Module):
    """A conditional scheme (peg2d) on the full grid with the dropped patches zeroed: what a row holding only
    the kept patches gives them (laid at their places on a zero grid)."""

    def __init__(self, inner: torch.nn.Module, kept: torch.Tensor) -> None:
        super().__init__()
        self.inner, self.kept = inner, kept  # kept: [B, P + HW] bool

    def forward(self, x: torch.Tensor, grid: tuple[int, int], num_prefix_tokens: int, tokens: None) -> torch.Tensor:
        assert tokens is None  # the full grid
        return self.inner(x * self.kept[:, :, None], grid, num_prefix_tokens)


def masked_full_grid(model: torch.nn.Module, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Features of the kept tokens (prefix first) from a full-grid forward whose keys exclude dropped tokens."""
    p, b = model.num_prefix_tokens, x.shape[0]
    kept = torch.zeros(b, p + GRID, dtype=torch.bool)
    kept[:, :p] = True
    kept.scatter_(1, keep + p, True)
    prob, model.patch_drop.prob = model.patch_drop.prob, 0.0
    conditional = model.vispos.conditional
    if conditional is not None:
        model.vispos.conditional = DroppedAsZeros(conditional, kept)
    try:
        full = model.forward_features(x, attn_mask=kept[:, None, None, :])
    finally:
        model.patch_drop.prob = prob
        model.vispos.conditional = conditional
    rows = torch.cat((torch.arange(p).expand(b, p), keep + p), dim=1)
    return full.gather(1, rows[:, :, None].expand(-1, -1, full.shape[-1]))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("scheme", SCHEMES_2D, ids=ids)
def test_patch_dropout_gives_each_kept_token_its_place_in_the_grid(model: str, scheme: str | list[str]) -> None:
    net = make(model, scheme).train()
    x = images()
    torch.manual_seed(5)
    out = net.forward_features(x)  # training mode: timm's patch dropout keeps 8 of 16 patches per image
    assert out.shape[1] == net.num_prefix_tokens + GRID // 2
    with torch.no_grad():
        torch.testing.assert_close(out, masked_full_grid(net, x, timm_keep(5)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["rope2d", "relbias2d", "alibi2d", "peg2d"])
def test_the_patch_dropout_check_fails_when_positions_ignore_the_kept_indices(scheme: str) -> None:
    """Negative control: give the kept tokens the positions of the first K grid cells (positions from the
    row's order, as a model that ignores the indices would) and the reference no longer matches."""
    net = make("vit", scheme).train()
    with torch.no_grad():
        for param in net.vispos.parameters():  # a trained-size bias table, not the 0.02 initialisation
            param.normal_()
    x = images()
    keep = timm_keep(5)
    wrong = torch.arange(keep.shape[1]).expand_as(keep)
    original = net.vispos.context

    def row_order(grid, device, user_mask=None, keep=None):  # noqa: ANN001, ANN202
        return original(grid, device, user_mask, None if keep is None else wrong)

    net.vispos.context = row_order
    torch.manual_seed(5)
    with torch.no_grad():
        out = net.forward_features(x)
        assert (out - masked_full_grid(net, x, keep)).abs().max() > 1e-2


@pytest.mark.parametrize("scheme", ["rope2d", "relbias2d"])
def test_patch_dropout_does_nothing_in_eval_mode(scheme: str) -> None:
    dropping = make("vit", scheme, drop=0.5).eval()
    plain = make("vit", scheme, drop=0.0).eval()
    plain.load_state_dict(dropping.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(dropping(images()), plain(images()), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["vit_small_patch16_rope_224", "vit_small_patch16_rope_mixed_224"])
def test_inherited_rope_with_patch_dropout_equals_timm_eva(name: str) -> None:
    """timm's Eva gathers its rotation table at the kept indices (``apply_keep_indices_nlc``); a patched
    model that inherits the RoPE draws the same indices and gives the same features."""
    torch.manual_seed(0)
    reference = timm.create_model(name, img_size=64, depth=2, num_classes=3, patch_drop_rate=0.5)
    layer_scales_to_one(reference)
    patched = timm.create_model(name, img_size=64, depth=2, num_classes=3, patch_drop_rate=0.5)
    patched.load_state_dict(reference.state_dict())
    vispos.patch(patched, "rope2d_mixed" if "mixed" in name else "rope2d")
    reference.train(), patched.train()
    x = images()
    with torch.no_grad():
        torch.manual_seed(7)
        expected = reference.forward_features(x)
        torch.manual_seed(7)
        torch.testing.assert_close(patched.forward_features(x), expected, rtol=1e-5, atol=1e-5)


def test_forward_intermediates_refuses_patch_dropout_in_training_mode() -> None:
    net = make("vit", "rope2d").train()
    with pytest.raises(ValueError, match="patch dropout in training mode"):
        net.forward_intermediates(images())
    net.eval()
    assert len(net.forward_intermediates(images(), intermediates_only=True)) == 2


@pytest.mark.parametrize(
    ("keep", "message"),
    [
        (torch.tensor([[0, 16]]), r"outside the 4x4 grid \(0 to 15\)"),
        (torch.tensor([[-1, 2]]), "outside the 4x4 grid"),
        (torch.tensor([0.0, 1.0]), r"integer tensor \[B, K\]"),
        ([[0, 1]], r"integer tensor \[B, K\]"),
    ],
)
def test_a_bad_keep_index_is_refused(keep: object, message: str) -> None:
    net = make("vit", "rope2d")
    with pytest.raises(ValueError, match=message):
        net.vispos.context((4, 4), torch.device("cpu"), keep=keep)


# --- a model that is not timm's: an MAE-style encoder keeps a random quarter of its tokens -----------------
class TinyEncoder(torch.nn.Module):
    """One attention layer on patch tokens with rope2d rotations and a relbias2d bias, both taken at the
    kept tokens' places in the grid: the few lines a user's MAE encoder needs."""

    def __init__(self, dim: int = 32, heads: int = 4, grid: tuple[int, int] = (8, 8)) -> None:
        super().__init__()
        self.heads, self.grid = heads, grid
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.rope = vispos.create_encoding("rope2d", dim=dim // heads)
        self.bias = vispos.create_encoding("relbias2d", num_heads=heads, train_grid=grid)

    def forward(self, tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """tokens [B, K, dim] at grid cells ``keep`` [B, K] (row-major) -> [B, K, dim]."""
        b, n, dim = tokens.shape
        q, k, v = self.qkv(tokens).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # [B, heads, K, d]
        q, k = self.rope(self.grid).take(keep).rotate(q, k)  # each kept token turned by its own (y, x)
        bias = self.bias(self.grid)[:, keep[:, :, None], keep[:, None, :]].transpose(0, 1)  # [B, heads, K, K]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.proj(out.transpose(1, 2).reshape(b, n, dim))


def test_an_mae_style_encoder_keeping_a_quarter_of_the_tokens_sees_their_true_positions() -> None:
    torch.manual_seed(0)
    encoder = TinyEncoder()
    with torch.no_grad():
        encoder.bias.table.normal_()
    tokens = torch.randn(3, 64, 32)
    keep = torch.argsort(torch.rand(3, 64), dim=-1)[:, :16]  # a random 25 %, in random order
    kept = tokens.gather(1, keep[:, :, None].expand(-1, -1, 32))
    everything = torch.arange(64).expand(3, 64)
    hidden = torch.full((3, 1, 64, 64), float("-inf"))  # the full grid, with dropped tokens hidden as keys
    hidden.scatter_(3, keep[:, None, None, :].expand(-1, -1, 64, -1), 0.0)
    with torch.no_grad():
        b, heads = 3, encoder.heads
        q, k, v = encoder.qkv(tokens).view(b, 64, 3, heads, -1).permute(2, 0, 3, 1, 4)
        q, k = encoder.rope(encoder.grid).take(everything).rotate(q, k)
        mask = encoder.bias(encoder.grid)[None] + hidden
        full = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        full = encoder.proj(full.transpose(1, 2).reshape(b, 64, 32))
        expected = full.gather(1, keep[:, :, None].expand(-1, -1, 32))
        torch.testing.assert_close(encoder(kept, keep), expected, rtol=1e-5, atol=1e-5)
        wrong = encoder(kept, torch.arange(16).expand(3, 16))  # positions from the row order
        assert (wrong - expected).abs().max() > 1e-2
