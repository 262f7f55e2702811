"""pape2d against the released PaPE (``DTU-PAS/parabolic-position-encoding`` at 21cb390).

The repository carries no licence, so nothing of it is copied: the reference below is rebuilt formula by formula
from what its files compute, cited by line:
- ``pape/nn/image_classifier.py`` 30-41: patch (row r, column c) at (c + 1, r + 1), the class token at (0, 0);
  ``normalize`` divides (x, y) by (rows, columns);
- ``pape/nn/positions/pape.py`` 21-22 (channels padded to a multiple of 8), 29-33 (``position``: Linear(2, heads P),
  ``ab``: Linear(hidden, 2 heads P), both without bias), 50-96 (u = position(points) viewed [heads, P]; (a_raw, b)
  = ab(x) viewed [2, heads, P]; a = softplus(a_raw); q and k extended by the channels of the module docstring);
- ``pape/nn/encoder.py`` 60-80, 95, 118, 138-145: pre-norm blocks, the attention's input is the normed tokens, the
  logit scale is head_size ** -0.5 on the extended q . k;
- ``pape/configs.py`` 177 (50 parabolas), 229 (``normalize`` off).
"""

from __future__ import annotations

import math

import pytest
import timm
import torch
import torch.nn.functional as F

import vispos
from vispos.encodings.pape import Pape2d, ParabolaChannels, grid_points

TRAIN, LARGER = (4, 4), (6, 5)
PATCH = 4


def released_points(grid: tuple[int, int], normalize: bool) -> torch.Tensor:
    """image_classifier.py 30-41: [1 + H W, 2], the class token first."""
    h, w = grid
    points = [(0.0, 0.0)] + [(c + 1.0, r + 1.0) for r in range(h) for c in range(w)]
    out = torch.tensor(points)
    return out / torch.tensor([h, w], dtype=out.dtype) if normalize else out  # (x, y) / (rows, columns)


def released_query_key(x, q, k, points, position_w, ab_w, heads, parabolas):  # noqa: ANN001, ANN201
    """pape.py 47-103 for one layer: x [B, T, C] the attention's input, q, k [B, heads, T, d]."""
    b, t, _ = x.shape
    u = (points @ position_w.T).view(1, t, heads, parabolas).permute(0, 2, 1, 3).expand(b, -1, -1, -1)
    ab = (x @ ab_w.T).view(b, t, 2, heads, parabolas).permute(2, 0, 3, 1, 4)
    a, slope = F.softplus(ab[0]), ab[1]
    ones = torch.ones(b, heads, t, 1)
    query = torch.cat([q, (a * -u.pow(2)).sum(-1, keepdim=True), a, a * 2 * u, (slope * u).sum(-1, keepdim=True),
                       slope], dim=-1)  # fmt: skip
    key = torch.cat([k, ones, -u.pow(2), u, ones, -u], dim=-1)
    total = q.shape[-1] + 3 * parabolas + 2
    pad = 8 * math.ceil(total / 8) - total
    return F.pad(query, (0, pad)), F.pad(key, (0, pad))


def released_forward(
    model: torch.nn.Module, images: torch.Tensor, grid: tuple[int, int], normalize: bool
) -> torch.Tensor:
    """The released encoder's attention in a timm ViT's blocks, with the weights of ``model`` (patched)."""
    points = released_points(grid, normalize)
    x = model.patch_embed(images).flatten(1, 2)  # NHWC (dynamic_img_size) -> [B, N, C]
    x = torch.cat([model.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
    for layer, blk in enumerate(model.blocks):
        pape = model.vispos.attention[layer]
        y = blk.norm1(x)
        b, n, c = y.shape
        heads = blk.attn.num_heads
        q, k, v = blk.attn.qkv(y).reshape(b, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = released_query_key(y, q, k, points, pape.position.weight, pape.ab.weight, heads, pape.parabolas)
        probs = ((q @ k.transpose(-2, -1)) * (c // heads) ** -0.5).softmax(-1)  # encoder.py 121: eager form
        x = x + blk.attn.proj((probs @ v).transpose(1, 2).reshape(b, n, c))
        x = x + blk.mlp(blk.norm2(x))
    return model.head(model.norm(x)[:, 0])


def vit(depth: int = 2, heads: int = 4, embed_dim: int = 64) -> torch.nn.Module:
    return timm.create_model("vit_base_patch16_224", img_size=TRAIN[0] * PATCH, patch_size=PATCH,
                             embed_dim=embed_dim, depth=depth, num_heads=heads, num_classes=5, global_pool="token",
                             dynamic_img_size=True)  # fmt: skip


@torch.no_grad()
@pytest.mark.parametrize("options", [{}, {"parabolas": 3}, {"parabolas": 7, "normalize": True}])
def test_patched_vit_computes_what_the_released_pape_model_computes(options: dict) -> None:
    torch.manual_seed(0)
    model = vispos.patch(vit(), "pape2d", **options).eval()
    grids = (TRAIN, (6, 6)) if options.get("normalize") else (TRAIN, LARGER)  # released normalize: square grids
    for grid in grids:
        images = torch.randn(2, 3, grid[0] * PATCH, grid[1] * PATCH)
        expected = released_forward(model, images, grid, options.get("normalize", False))
        torch.testing.assert_close(model(images), expected, rtol=1e-5, atol=1e-5)


def test_released_defaults_names_and_initialisation() -> None:
    """50 parabolas, points not normalised, channels to a multiple of 8; the released parameter names and shapes,
    initialised as ``nn.Linear`` is (uniform within 1 / sqrt(fan_in))."""
    model = vispos.patch(vit(depth=1, heads=2, embed_dim=64), "pape2d")
    pape = model.vispos.attention[0]
    assert (pape.parabolas, pape.normalize, pape.pad_to) == (50, False, 8)
    shapes = {name: tuple(p.shape) for name, p in pape.named_parameters()}
    assert shapes == {"position.weight": (100, 2), "ab.weight": (200, 64)}
    assert pape.position.weight.abs().max() <= 2**-0.5 and pape.ab.weight.abs().max() <= 64**-0.5
    assert pape.pad == 0  # 32 + 152 = 184 = 23 x 8
    for dim, parabolas, pad in ((64, 3, 5), (64, 50, 0), (48, 10, 0), (48, 9, 3), (32, 1, 3)):
        assert Pape2d(dim=dim, width=8, num_heads=1, parabolas=parabolas).pad == pad
        assert (dim + 3 * parabolas + 2 + pad) % 8 == 0


def test_points_are_the_released_ones_prefix_tokens_at_the_origin() -> None:
    for grid in (TRAIN, LARGER):
        points = grid_points(grid, None, normalize=False)
        torch.testing.assert_close(F.pad(points, (0, 0, 1, 0)), released_points(grid, False), rtol=0, atol=0)
    square = grid_points((6, 6), None, normalize=True)
    torch.testing.assert_close(F.pad(square, (0, 0, 1, 0)), released_points((6, 6), True), rtol=0, atol=0)
    wide = grid_points((2, 4), None, normalize=True)  # x by the columns, y by the rows (each axis its own)
    torch.testing.assert_close(wide[-1], torch.tensor([1.0, 1.0]))
    channels = Pape2d(dim=8, width=8, num_heads=1, parabolas=2)(TRAIN).with_prefix(3)
    assert channels.points.shape == (19, 2) and not channels.points[:3].any()


def test_the_channels_compute_the_parabolas_of_the_offset() -> None:
    """In float64: q-channels . k-channels = sum_p -a_ip (u_ip - u_jp)^2 + b_ip (u_ip - u_jp) (the paper's bias),
    and it depends on the points through their offsets only."""
    torch.manual_seed(1)
    pape = Pape2d(dim=8, width=12, num_heads=3, parabolas=5).double()
    points = torch.rand(2, 9, 2, dtype=torch.float64) * 6
    x = torch.randn(2, 9, 12, dtype=torch.float64)
    origin = torch.tensor([2.0, 1.0], dtype=torch.float64)
    channels = ParabolaChannels(points, origin, pape.position, pape.ab, 3, 5, pape.pad).bind(x)
    u = points @ pape.position.weight.T  # [B, T, heads P], from the points themselves (no origin)
    u = u.view(2, 9, 3, 5).transpose(1, 2)
    ab = pape.ab(x).view(2, 9, 2, 3, 5).permute(2, 0, 3, 1, 4)
    a, slope = F.softplus(ab[0]), ab[1]
    diff = u[:, :, :, None] - u[:, :, None]  # [B, heads, T, T, P]
    paper = (-a[:, :, :, None] * diff**2 + slope[:, :, :, None] * diff).sum(-1)
    q_side, k_side = channels.channels()
    got = q_side.double() @ k_side.double().transpose(-2, -1)
    torch.testing.assert_close(got, paper, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(channels.bias().double(), paper, rtol=1e-9, atol=1e-9)
    shifted = ParabolaChannels(points + torch.tensor([3.5, -2.0], dtype=torch.float64), origin * 0,
                               pape.position, pape.ab, 3, 5, pape.pad).bind(x)  # fmt: skip
    torch.testing.assert_close(shifted.bias().double(), paper, rtol=1e-9, atol=1e-9)


@torch.no_grad()
def test_values_keep_their_width_and_sdpa_stays_fused() -> None:
    """q and k grow by 3P + 2 + pad channels; v does not; the block output equals the eager reference."""
    torch.manual_seed(2)
    model = vispos.patch(vit(depth=1), "pape2d", parabolas=3).eval()
    attn = model.blocks[0].attn
    x = torch.randn(2, 1 + 16, 64)
    ctx = model.vispos_context(torch.randn(2, 3, 16, 16))
    q, k, v, scale, mask = attn.positioned(x, ctx)
    assert q.shape[-1] == k.shape[-1] == 16 + 11 + 5 and v.shape[-1] == 16 and mask is None
    assert scale == attn.scale == 16**-0.5  # the head width's, not the widened q's
    fused = attn(x, attn_mask=ctx)
    attn.fused_attn = False
    torch.testing.assert_close(fused, attn(x, attn_mask=ctx), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_log_n_scaling_scales_q_dot_k_not_the_parabolas() -> None:
    torch.manual_seed(3)
    model = vispos.patch(vit(depth=1), "pape2d", parabolas=3).eval()
    vispos.configure(model, log_n_attention=True)
    attn = model.blocks[0].attn
    images = torch.randn(1, 3, 8 * PATCH, 8 * PATCH)
    ctx = model.vispos_context(images)
    assert ctx.logit_scale > 1.0
    x = torch.randn(1, 1 + 64, 64)
    q, k, _, scale, _ = attn.positioned(x, ctx)
    plain_q, plain_k, _ = attn.project_normed(x)
    channels = model.vispos.attention[0](ctx.grid).with_prefix(1).bind(x)
    expected = ctx.logit_scale * attn.scale * plain_q @ plain_k.transpose(-2, -1) + attn.scale * channels.bias()
    torch.testing.assert_close(q @ k.transpose(-2, -1) * scale, expected, rtol=1e-4, atol=1e-4)


def test_a_host_that_does_not_pass_the_inputs_is_told_so() -> None:
    model = vispos.patch(vit(depth=1), "pape2d", parabolas=2)
    ctx = model.vispos_context(torch.randn(1, 3, 16, 16))
    channels, _ = ctx.layer(0)
    q = torch.randn(1, 4, 17, 16)
    with pytest.raises(ValueError, match="inputs=x"):
        channels.rotate(q, q)


def test_the_transformers_families_take_it() -> None:
    """A transformers ViT patched with pape2d runs (eager and SDPA agree) and keeps a value width of head_dim."""
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(4)
    config = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       image_size=16, patch_size=4, attn_implementation="sdpa")  # fmt: skip
    model = vispos.patch(ViTModel(config, add_pooling_layer=False), "pape2d", inherit=False, parabolas=3).eval()
    images = torch.randn(2, 3, 24, 20)
    with torch.no_grad():
        fused = model(pixel_values=images).last_hidden_state
        model.set_attn_implementation("eager")
        eager = model(pixel_values=images).last_hidden_state
    assert fused.shape == (2, 1 + 30, 32)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)


def test_a_token_subset_of_a_ragged_batch_keeps_each_tokens_point() -> None:
    """``take`` on per-token points [B, T, 2] (a ragged batch) gathers each row's own tokens: the subset's channels
    are those of the same tokens laid out directly."""
    enc = vispos.create_encoding("pape2d", dim=8, width=16, num_heads=2, parabolas=3)
    yx = torch.tensor([[[0, 0], [0, 0], [0, 1], [1, 0], [1, 1]],    # row 0: a prefix token, then a 2 x 2 image
                       [[0, 0], [0, 0], [0, 1], [0, 2], [0, 3]]])   # row 1: a prefix token, then a 1 x 4 image
    hw = torch.tensor([[2, 2], [1, 4]])[:, None].expand(-1, 5, -1)  # fmt: skip
    prefix = torch.tensor([[True, False, False, False, False]] * 2)
    tokens = torch.tensor([[0, 4, 2], [3, 0, 4]])
    got = enc.ragged(yx, hw, prefix).take(tokens)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return torch.stack([t[b, tokens[b]] for b in range(2)])

    want = enc.ragged(pick(yx), pick(hw), pick(prefix))
    torch.testing.assert_close(got.points, want.points, rtol=0, atol=0)
    torch.testing.assert_close(got.origin, want.origin, rtol=0, atol=0)
    inputs = torch.randn(2, 3, 16)
    for ours, theirs in zip(got.bind(inputs).channels(), want.bind(inputs).channels(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
