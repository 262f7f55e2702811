"""``irpe2d`` and ``irpe2d_bias`` against iRPE's released code (``tests/irpe_ref/``, microsoft/Cream at 4a13c40).

- the bucket ids of the four methods equal the released ``get_bucket_ids_2d`` (prefix bucket included) at a
  training grid (14 x 14) and a larger, non-square one (18 x 23), at the released ratios and others, and the
  piecewise index equals the released one at float offsets too;
- bias mode and contextual mode on the keys equal the released ``iRPE`` / ``iRPE_Cross`` modules loaded with the
  same parameters (fp32, 1e-5), per head and shared, with and without prefix tokens, the released DeiT defaults
  included; a token subset reads the released rows;
- a patched timm ViT (class token, dynamic size) computes the logits and outputs of the released ``RPEAttention``
  with the same weights, at two grids;
- the options: released defaults, refusals that name the option (q and v sides), far offsets sharing a bucket.
"""

from __future__ import annotations

import irpe_ref as ref
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import vispos
from vispos.encodings.irpe_buckets import grid_bucket_ids, num_buckets, piecewise_index
from vispos.encodings.relbias import bias_mask, prefixed_offset_index

TRAIN, LARGER = (14, 14), (18, 23)
METHODS = ("euclidean", "quant", "cross", "product")
RELEASED_RATIO = {"euclidean": 20.0, "quant": 33.0, "cross": 20.0, "product": 1.9}  # rpe_models.py
NAMES = {"euclidean": "euc", "quant": "quant", "cross": "cross", "product": "product"}  # get_rpe_config's aliases
HEAD_DIM, HEADS = 16, 3


def released_method(method: str) -> int:
    return {"euclidean": ref.METHOD.EUCLIDEAN, "quant": ref.METHOD.QUANT, "product": ref.METHOD.PRODUCT}[method]


def released_rpe(method: str, mode: str, ratio: float, shared_head: bool, skip: int) -> torch.nn.Module:
    """The released module on the keys (``get_rpe_config`` + ``build_rpe``), its tables drawn at random."""
    config = ref.get_rpe_config(ratio=ratio, method=NAMES[method], mode=mode, shared_head=shared_head, skip=skip,
                                rpe_on="k")  # fmt: skip
    module = ref.build_rpe(config, head_dim=HEAD_DIM, num_heads=HEADS)[1]
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return module


def ours(name: str, method: str, ratio: float, shared_head: bool, skip: int) -> torch.nn.Module:
    context = {"num_heads": HEADS, "num_prefix_tokens": skip} | ({"dim": HEAD_DIM} if name == "irpe2d" else {})
    return vispos.create_encoding(name, method=method, ratio=ratio, shared_head=shared_head, **context)


# --- bucket ids -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("grid", [TRAIN, LARGER], ids=["train", "larger"])
@pytest.mark.parametrize("ratio", [1.9, 0.8, "released"])
@pytest.mark.parametrize("method", METHODS)
def test_bucket_ids_equal_the_released_get_bucket_ids_2d(method: str, ratio: float | str, grid) -> None:
    ratio = RELEASED_RATIO[method] if ratio == "released" else ratio
    alpha, beta, gamma = 1 * ratio, 2 * ratio, 8 * ratio
    h, w = grid
    ids = grid_bucket_ids(grid, method, ratio, None)  # [K, HW, HW]
    parts = [ref.METHOD.CROSS_ROWS, ref.METHOD.CROSS_COLS] if method == "cross" else [released_method(method)]
    assert ids.shape == (len(parts), h * w, h * w) and ids.dtype == torch.long
    for part, got in zip(parts, ids, strict=True):
        expected, count = ref.get_bucket_ids_2d(part, h, w, 0, alpha, beta, gamma)
        assert count == num_buckets(method, ratio)
        assert torch.equal(got, expected)
    # with prefix tokens (the released skip): every pair with one reads the extra bucket, the last
    module = ours("irpe2d", method, ratio, True, skip=2)
    got = module(grid).with_prefix(2).token_ids()
    for part, mine in zip(parts, got, strict=True):
        expected, count = ref.get_bucket_ids_2d(part, h, w, 2, alpha, beta, gamma)
        assert count == module.tables()[0].shape[-1] and torch.equal(mine, expected)


@pytest.mark.parametrize("ratio", [1.9, 0.8, 3.3, 20.0])
def test_piecewise_index_equals_the_released_one_at_integer_and_float_offsets(ratio: float) -> None:
    alpha, beta, gamma = 1 * ratio, 2 * ratio, 8 * ratio
    g = torch.Generator().manual_seed(0)
    ints = torch.arange(-300, 301)
    floats = torch.cat((torch.randn(2000, generator=g) * 4 * gamma, ints.float() + 0.5, torch.tensor([alpha, -alpha])))
    for x in (ints, floats, floats.double()):
        expected = ref.piecewise_index(x, alpha, beta, gamma, torch.long)
        assert torch.equal(piecewise_index(x, alpha, beta, gamma), expected)
        assert expected.abs().max() == int(beta)  # the clip is reached


@pytest.mark.parametrize("method", METHODS)
def test_pair_bias_at_fractional_offsets_is_the_released_index_at_float_offsets(method: str) -> None:
    """Fractional points: the released ``_rp_2d_*`` functions at float offsets (a [L, L, 2] diff), looked up."""
    module = vispos.create_encoding("irpe2d_bias", num_heads=HEADS, method=method, shared_head=False, init_std=1.0)
    offsets = torch.randn(20, 20, 2, generator=torch.Generator().manual_seed(4)) * 6
    alpha, beta, gamma = 1.9, 3.8, 15.2
    parts = [ref.METHOD.CROSS_ROWS, ref.METHOD.CROSS_COLS] if method == "cross" else [released_method(method)]
    expected = 0
    for part, table in zip(parts, module.tables(), strict=True):
        ids = ref._METHOD_FUNC[part](offsets, alpha=alpha, beta=beta, gamma=gamma, dtype=torch.long)
        ids = ids if method == "product" else ids + int(beta)
        expected = expected + table[:, ids]
    torch.testing.assert_close(module.pair_bias(offsets), expected, rtol=0, atol=0)
    whole = offsets.round().clamp(-11, 11)  # at whole numbers: the per-offset table of a 12 x 12 grid
    table = module.offset_bias((12, 12))
    from_table = table[:, whole[..., 0].long() + 11, whole[..., 1].long() + 11]
    torch.testing.assert_close(module.pair_bias(whole), from_table, rtol=0, atol=0)


# --- the modules ------------------------------------------------------------------------------------------
MODULE_CASES = [
    ("product", 1.9, True, 1),  # the released DeiT default (ctx_product_50_shared_k)
    ("product", 1.9, False, 0),
    ("product", 2.7, False, 2),
    ("euclidean", 20.0, True, 1),
    ("euclidean", 1.9, False, 1),
    ("quant", 33.0, True, 1),
    ("quant", 1.9, False, 0),
    ("cross", 20.0, True, 1),
    ("cross", 1.9, False, 2),
]


@pytest.mark.parametrize("grid", [TRAIN, LARGER], ids=["train", "larger"])
@pytest.mark.parametrize(("method", "ratio", "shared_head", "skip"), MODULE_CASES, ids=str)
def test_bias_mode_equals_the_released_module(method: str, ratio: float, shared_head: bool, skip: int, grid) -> None:
    released = released_rpe(method, "bias", ratio, shared_head, skip)
    module = ours("irpe2d_bias", method, ratio, shared_head, skip)
    module.load_state_dict(released.state_dict())  # the released names and shapes
    h, w = grid
    x = torch.randn(2, HEADS, skip + h * w, HEAD_DIM)  # read for its shape only (bias mode)
    expected = released(x, height=h, width=w).expand(1, HEADS, -1, -1)[0]  # [heads, P + HW, P + HW]
    # as the host builds the mask: the value per offset and the prefix entries, gathered in one step
    got = bias_mask(module.offset_bias(grid), module.prefix_bias, prefixed_offset_index(grid, skip))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(module(grid), expected[:, skip:, skip:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grid", [TRAIN, LARGER], ids=["train", "larger"])
@pytest.mark.parametrize(("method", "ratio", "shared_head", "skip"), MODULE_CASES, ids=str)
def test_contextual_mode_on_keys_equals_the_released_module(method, ratio, shared_head, skip, grid) -> None:
    released = released_rpe(method, "ctx", ratio, shared_head, skip)
    module = ours("irpe2d", method, ratio, shared_head, skip)
    module.load_state_dict(released.state_dict())
    h, w = grid
    q = torch.randn(2, HEADS, skip + h * w, HEAD_DIM)
    expected = released(q * HEAD_DIM**-0.5, height=h, width=w)  # the released attention hands it the scaled q
    got = module(grid).with_prefix(skip).logits(q)  # hosts hand the unscaled q
    assert got.shape == (2, HEADS, skip + h * w, skip + h * w)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    keep = torch.stack([torch.randperm(h * w, generator=torch.Generator().manual_seed(s))[:40] for s in (1, 2)])
    tokens = torch.cat((torch.arange(skip).expand(2, skip), keep + skip), dim=1)  # [B, P + 40]
    subset = module(grid).with_prefix(skip).take(tokens).logits(q.gather(2, tokens[:, None, :, None].expand(
        -1, HEADS, -1, HEAD_DIM)))  # fmt: skip
    rows = torch.stack([expected[b][:, tokens[b][:, None], tokens[b][None, :]] for b in range(2)])
    torch.testing.assert_close(subset, rows, rtol=1e-5, atol=1e-5)


def test_defaults_are_the_released_deit_configuration() -> None:
    """deit_*_ctx_product_50_shared_k: product, ratio 1.9, contextual, shared by the heads, skip 1, on the keys:
    50 buckets, the released table's shape."""
    released = ref.build_rpe(ref.get_rpe_config(ratio=1.9, method="product", mode="ctx", shared_head=True, skip=1,
                                                rpe_on="k"), head_dim=64, num_heads=3)  # fmt: skip
    assert released[0] is None and released[2] is None
    module = vispos.create_encoding("irpe2d", dim=64, num_heads=3, num_prefix_tokens=1)
    assert (module.method, module.ratio, module.shared_head, module.on) == ("product", 1.9, True, "k")
    assert dict(module.state_dict()).keys() == released[1].state_dict().keys()
    assert module.lookup_table_weight.shape == released[1].lookup_table_weight.shape == (1, 64, 50)
    assert module.lookup_table_weight.abs().sum() == 0  # zero at the start, as released
    bias = ref.build_rpe(ref.get_rpe_config(mode="bias", skip=1), head_dim=64, num_heads=3)[1]
    assert vispos.create_encoding("irpe2d_bias", num_heads=3, num_prefix_tokens=1).lookup_table_bias.shape == (
        bias.lookup_table_bias.shape)  # fmt: skip
    info = vispos.get_info("irpe2d")
    assert info.kind == "query_bias" and info.relative and info.per_layer and info.trainable
    assert vispos.get_info("irpe2d_bias").kind == "bias"


# --- a patched ViT ----------------------------------------------------------------------------------------
EMBED, PATCH = 48, 4


def vit(pos: str, **options: object) -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=PATCH, embed_dim=EMBED, depth=2, num_heads=HEADS,
                              num_classes=0, dynamic_img_size=True)  # fmt: skip
    vispos.patch(model, pos, **options)
    with torch.no_grad():
        for p in model.vispos.parameters():
            p.normal_(std=0.5)
    return model.eval()


def released_blocks(model: VisionTransformer, mode: str, method: str, ratio: float) -> list[ref.RPEAttention]:
    """The released attention of each block: the block's qkv and proj, the vispos layer's iRPE table."""
    config = ref.get_rpe_config(ratio=ratio, method=NAMES[method], mode=mode, shared_head=True, skip=1, rpe_on="k")
    out = []
    for blk, rpe in zip(model.blocks, model.vispos.attention, strict=True):
        attn = ref.RPEAttention(EMBED, num_heads=HEADS, qkv_bias=True, rpe_config=config).eval()
        attn.qkv.load_state_dict(blk.attn.qkv.state_dict())
        attn.proj.load_state_dict(blk.attn.proj.state_dict())
        attn.rpe_k.load_state_dict(rpe.state_dict())
        out.append(attn)
    return out


def released_logits(attn: ref.RPEAttention, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """``RPEAttention.forward``'s ``attn`` before the softmax."""
    b, n, c = x.shape
    q, k, _ = attn.qkv(x).reshape(b, n, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
    q = q * attn.scale
    return q @ k.transpose(-2, -1) + attn.rpe_k(q, height=h, width=w)


VIT_CASES = [
    ("irpe2d", "ctx", "product", 1.9),
    ("irpe2d", "ctx", "cross", 2.5),
    ("irpe2d_bias", "bias", "product", 1.9),
    ("irpe2d_bias", "bias", "euclidean", 1.9),
]


@pytest.mark.parametrize(("pos", "mode", "method", "ratio"), VIT_CASES, ids=str)
def test_patched_vit_computes_what_the_released_attention_computes(pos, mode, method, ratio) -> None:
    model = vit(pos, method=method, ratio=ratio)
    assert model.num_prefix_tokens == 1
    attns = released_blocks(model, mode, method, ratio)
    seen: dict[str, torch.Tensor] = {}
    for size in ((32, 32), (24, 36)):  # grids 8 x 8 and 6 x 9
        h, w = size[0] // PATCH, size[1] // PATCH
        seen.clear()
        first = model.blocks[0].register_forward_pre_hook(lambda m, args: seen.setdefault("in", args[0]))
        last = model.blocks[-1].register_forward_hook(lambda m, args, out: seen.setdefault("out", out))
        images = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(h))
        with torch.no_grad():
            model.forward_features(images)
            first.remove()
            last.remove()
            x = seen["in"]
            assert x.shape == (2, 1 + h * w, EMBED)
            ctx = model.vispos_context(images)
            for i, (blk, attn) in enumerate(zip(model.blocks, attns, strict=True)):
                q, k, _, scale, mask = blk.attn.positioned(blk.norm1(x), ctx)
                ours_logits = q @ k.transpose(-2, -1) * scale + mask
                torch.testing.assert_close(ours_logits, released_logits(attn, blk.norm1(x), h, w), rtol=1e-5,
                                           atol=1e-5, msg=f"layer {i} at {h}x{w}")  # fmt: skip
                x = x + blk.ls1(attn(blk.norm1(x), height=h, width=w))
                x = x + blk.ls2(blk.mlp(blk.norm2(x)))
        torch.testing.assert_close(seen["out"], x, rtol=1e-5, atol=1e-5)


# --- options ----------------------------------------------------------------------------------------------
def test_queries_and_values_are_refused_naming_the_option_and_the_reason() -> None:
    for side in ("q", "v", "qk", "qkv"):
        with pytest.raises(ValueError, match=r"on='[qkv]+'.*needs the keys.*attention weights.*accepted: 'k'"):
            vispos.create_encoding("irpe2d", dim=8, num_heads=2, on=side)
    with pytest.raises(ValueError, match="unknown on 'x'; accepted: k"):
        vispos.create_encoding("irpe2d", dim=8, num_heads=2, on="x")
    with pytest.raises(ValueError, match="unknown method 'euc'; accepted: euclidean, quant, cross, product"):
        vispos.create_encoding("irpe2d_bias", num_heads=2, method="euc")
    with pytest.raises(ValueError, match="ratio must be > 0"):
        vispos.create_encoding("irpe2d_bias", num_heads=2, ratio=0.0)
    with pytest.raises(TypeError, match="shared_head must be a bool"):
        vispos.create_encoding("irpe2d", dim=8, num_heads=2, shared_head=1)


def test_far_offsets_share_the_last_bucket_and_ragged_batches_refuse_the_contextual_form() -> None:
    """Product at ratio 1.9: per axis g = 0, +-1, +-2 (|x| = 2, 3), +-3 (|x| >= 4, on any grid)."""
    ids = grid_bucket_ids((1, 40), "product", 1.9, None)[0, 0]  # query at x = 0, keys at x = 0..39: dx = -x
    assert ids.tolist() == [24 + g for g in [0, -1, -2, -2] + [-3] * 36]  # (0 + 3) * 7 + g + 3
    model = vit("irpe2d")
    with pytest.raises(ValueError, match="irpe2d.*ragged and packed batches are not supported") as refused:
        model.vispos.ragged_context(torch.zeros(1, 4, 2, dtype=torch.long), torch.tensor([[2, 2]]))
    assert "decomposed2d" not in str(refused.value)  # the scheme used, no other
