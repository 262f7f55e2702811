"""``lookhere2d`` against LookHere's released code (``tests/lookhere_ref.py``, GreenCUBIC/lookhere at 641deab).

- the mask of every layer equals the released ``create_lh_bias_tensor`` for its field groups, distances and
  fills, at a training grid and at a larger, non-square one (fp32 to 1e-5 relative, the hidden keys exactly;
  the released code rounds its mask to bfloat16 at the end, which is left out of the comparison);
- a patched timm ViT computes what the released ``LookHere`` model computes: its attention with the released
  bias map, cls row and column zero, at the training grid and after ``set_pos_embed`` to a larger grid;
- the head layout beyond the released head counts, and the rule on a larger grid (rebuilt, not resized).
"""

from __future__ import annotations

import warnings

import pytest
import timm
import torch
import torch.nn.functional as F
from lookhere_ref import create_lh_bias_tensor

import vispos
from vispos.encodings.lookhere import MASKED, head_layout

TRAIN, LARGER = (14, 14), (18, 23)
LH90 = {"global_slope": 2, "layer_slopes": [1.5, 0.5], "head_directions": "corners-triangles-none"}
# (field groups, heads, released options): LH-90 (the default), the other released groupings and options
CONFIGS = [
    ("corners-triangles-none", 12, {}),
    ("halves-none", 12, {}),
    ("eighths1-eighths2-none", 12, {}),
    ("halves-corners-triangles-none", 16, {}),
    ("corners-none", 6, {}),
    ("triangles", 4, {}),
    ("diagonals", 8, {}),
    ("zerohalves-none1zero3-zerotriangles", 12, {}),
    ("corners-triangles-none", 12, {"distance": "sqrt"}),
    ("corners-triangles-none", 12, {"distance": "square", "fill_with": "max"}),
    ("halves-zerocorners", 16, {"fill_with": "zero"}),
    ("halves-zerocorners", 16, {"fill_with": "max"}),  # fill="max" on heads without a distance: their max is 0
]
DEPTH = 3


def released(fields: str, heads: int, grid: tuple[int, int], options: dict) -> torch.Tensor:
    config = {**LH90, "head_directions": fields, **options}
    return torch.as_tensor(create_lh_bias_tensor(config, grid, DEPTH, heads, bf16=False))  # [depth, heads, N, N]


def ours(fields: str, heads: int, layer: int, options: dict) -> torch.nn.Module:
    mapped = {"distance": options.get("distance", "linear"), "fill": options.get("fill_with", "inf")}
    return vispos.create_encoding("lookhere2d", num_heads=heads, layer=layer, depth=DEPTH, fields=fields, **mapped)


@pytest.mark.parametrize("grid", [TRAIN, LARGER], ids=["train", "larger"])
@pytest.mark.parametrize(("fields", "heads", "options"), CONFIGS, ids=lambda v: str(v))
def test_every_layers_mask_equals_the_released_builder(fields: str, heads: int, options: dict, grid) -> None:
    reference = released(fields, heads, grid, options)
    assert (reference == -MASKED).any() == (options.get("fill_with", "inf") == "inf" and fields != "none")
    for layer in range(DEPTH):
        mask = ours(fields, heads, layer, options)(grid)
        assert mask.dtype == torch.float32
        torch.testing.assert_close(mask.double(), reference[layer], rtol=1e-5, atol=1e-5)
        assert torch.equal(mask == -MASKED, reference[layer] == -MASKED)  # the hidden keys, exactly


def _released_model_forward(model: torch.nn.Module, images: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """The released ``LookHere`` forward (cls token, no position embedding, ``AttentionWithBiases`` with the
    bias map of ``set_pos_embed``: cls row and column zero), run with the weights of ``model``."""
    heads = model.blocks[0].attn.num_heads
    maps = released(LH90["head_directions"], heads, grid, {}).float()  # [depth, heads, N, N]
    maps = F.pad(maps, (1, 0, 1, 0))  # the cls token's zero row and column
    x = model.patch_embed(images).flatten(1, 2)  # NHWC (dynamic_img_size) -> [B, N, C]
    x = torch.cat([model.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
    for layer, blk in enumerate(model.blocks):
        y = blk.norm1(x)
        b, n, c = y.shape
        q, k, v = blk.attn.qkv(y).reshape(b, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=maps[layer])
        x = x + blk.attn.proj(y.transpose(1, 2).reshape(b, n, c))
        x = x + blk.mlp(blk.norm2(x))
    return model.head(model.norm(x)[:, 0])


@torch.no_grad()
def test_patched_vit_computes_what_the_released_lookhere_model_computes() -> None:
    torch.manual_seed(0)
    model = timm.create_model("vit_base_patch16_224", img_size=TRAIN[0] * 4, patch_size=4, embed_dim=48, depth=DEPTH,
                              num_heads=12, num_classes=7, global_pool="token", dynamic_img_size=True)  # fmt: skip
    vispos.patch(model, "lookhere2d").eval()
    for grid in (TRAIN, LARGER):
        images = torch.randn(2, 3, grid[0] * 4, grid[1] * 4)
        torch.testing.assert_close(model(images), _released_model_forward(model, images, grid), rtol=1e-5, atol=1e-5)


def test_default_is_lh90_and_the_layer_slopes_span_the_depth() -> None:
    model = vispos.patch(timm.create_model("vit_small_patch16_224", depth=4, num_classes=0), "lookhere2d")
    layers = model.vispos.attention
    assert [m.layer_slope for m in layers] == pytest.approx([1.5, 1.5 - 1 / 3, 0.5 + 1 / 3, 0.5])
    # ViT-S's 6 heads: the released rule gives 4 corner heads and 2 triangle heads (up, down), slopes 0.5
    assert layers[0].views == [("up", "left"), ("up", "right"), ("down", "left"), ("down", "right"),
                               ("tri_up",), ("tri_down",)]  # fmt: skip
    assert layers[0].slopes == pytest.approx([2 * 1.5 * 0.5] * 6)


@pytest.mark.parametrize(
    ("fields", "heads", "groups", "slopes"),
    [
        # the released head counts (6, 12, 16) are covered by the parity test; these are vispos's extension
        ("corners-triangles-none", 3, ["none"] * 3, [0.25, 0.0625, 0.015625]),
        ("halves-none", 8, ["halves"] * 4 + ["none"] * 4, [0.5] * 4 + [0.25, 0.0625, 0.015625, 0.00390625]),
        ("halves-none", 10, ["halves"] * 4 + ["none"] * 6, [0.5] * 4 + [0.25, 0.25, 0.0625, 0.015625, 0.015625,
                                                                         0.00390625]),  # fmt: skip
        ("halves-corners", 10, ["halves"] * 6 + ["corners"] * 4, [0.5] * 4 + [0.25] * 2 + [0.5] * 4),
        ("none-corners", 5, ["none"] + ["corners"] * 4, [0.25] + [0.5] * 4),  # the global group dealt last
        ("none-corners", 4, ["corners"] * 4, [0.5] * 4),  # one block: the directional group's
        ("none", 8, ["none"] * 8, [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.00390625, 0.00390625]),
        ("triangles-none", 5, ["triangles"] * 4 + ["none"], [0.5] * 4 + [0.25]),
    ],
)
def test_heads_are_dealt_in_blocks_of_four_for_any_head_count(fields, heads, groups, slopes) -> None:
    views, got = head_layout(fields, heads)
    blocks = {g: vispos.encodings.lookhere._BLOCKS[g] for g in set(groups)}
    position = {g: 0 for g in blocks}
    expected_views = []
    for g in groups:
        expected_views.append(blocks[g][position[g] % 4])
        position[g] += 1
    assert views == expected_views
    assert got == pytest.approx(slopes)


def _seen(enc: torch.nn.Module, heads: list[int]) -> torch.Tensor:
    """Where any of ``heads`` sees the key, per offset of a 5 x 5 grid [9, 9]."""
    return (enc.offset_bias((5, 5))[heads] > -MASKED).any(dim=0)


@pytest.mark.parametrize("fields", ["corners-triangles-none", "halves-none", "triangles-zero", "corners-triangles",
                                    "none-corners"])
@pytest.mark.parametrize("heads", range(1, 17))
def test_any_head_count_sees_every_way_and_keeps_a_global_head_where_it_fits(fields: str, heads: int) -> None:
    """Directional groups hold whole blocks of four (together they see every offset), the heads left over go to a
    listed global group (5, 7, 9... heads), under 4 heads every head is global or ``fields`` is refused; a group left
    out is warned about, naming every head's field."""
    groups = fields.split("-")
    undirected = [g for g in groups if g in ("none", "zero")]
    if heads < 4 and not undirected:
        with pytest.raises(ValueError, match=rf"fields='{fields}' on {heads} head\(s\): .* block of four heads"):
            vispos.create_encoding("lookhere2d", num_heads=heads, fields=fields)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enc = vispos.create_encoding("lookhere2d", num_heads=heads, fields=fields)
    directional = [h for h, view in enumerate(enc.views) if set(view) - {"zero"}]
    global_heads = [h for h, view in enumerate(enc.views) if not set(view) - {"zero"}]
    assert sorted(directional + global_heads) == list(range(heads))
    assert _seen(enc, list(range(heads))).all()  # every offset seen by some head
    if heads >= 4:
        assert _seen(enc, directional).all()  # ... by the directional heads alone: their blocks are whole
    blocks, left = divmod(heads, 4)
    released_six = heads == 6 and len(groups) == 3  # the released 4 + 2 split: the third group gets no head
    if undirected and not released_six:
        assert bool(global_heads) == (left > 0 or blocks >= len(groups))
    served = min(blocks, len(groups)) + (left > 0 and blocks < len(groups)) if heads >= 4 else 1  # groups with heads
    left_out = released_six or served < len(groups)
    said = [str(w.message) for w in caught if "lookhere2d" in str(w.message)]
    if said:
        assert all(f"head {h}: " in said[0] for h in range(heads)) and "get(s) no head" in said[0]
    assert bool(said) == left_out, said


def test_a_larger_grid_rebuilds_the_mask_with_the_same_slopes() -> None:
    """The catalogue row's rule: nothing is resized; every offset the training grid has keeps its value, and
    new offsets are penalised by the same slope over their longer distance."""
    enc = vispos.create_encoding("lookhere2d", num_heads=12, layer=1, depth=3)
    small, big = enc.offset_bias(TRAIN), enc.offset_bias(LARGER)  # [heads, 2H-1, 2W-1]
    dh, dw = LARGER[0] - TRAIN[0], LARGER[1] - TRAIN[1]
    assert torch.equal(big[:, dh : dh + 2 * TRAIN[0] - 1, dw : dw + 2 * TRAIN[1] - 1], small)
    none_head = big[-1]  # a 'none' head: -slope x distance everywhere
    far = torch.tensor([LARGER[0] - 1.0, LARGER[1] - 1.0]).norm()
    assert none_head[0, 0].item() == pytest.approx(-enc.slopes[-1] * far.item(), rel=1e-6)


def test_every_head_sees_its_own_token_and_no_row_is_fully_masked() -> None:
    for fields in ("halves", "corners", "triangles", "diagonals", "eighths1", "eighths2"):
        mask = vispos.create_encoding("lookhere2d", num_heads=4, fields=fields)((5, 6))
        assert (mask.diagonal(dim1=-2, dim2=-1) == 0).all(), fields
        assert ((mask > -MASKED).sum(-1) >= 1).all(), fields


def test_center_is_refused_as_absolute_and_unknown_groups_are_named() -> None:
    with pytest.raises(ValueError, match=r"fields: 'center' .* is absolute"):
        vispos.create_encoding("lookhere2d", num_heads=4, fields="center")
    with pytest.raises(ValueError, match=r"fields: unknown group\(s\) 'quarters'; accepted, joined with '-': none"):
        vispos.create_encoding("lookhere2d", num_heads=4, fields="corners-quarters")
    with pytest.raises(ValueError, match="layer must be < depth"):
        vispos.create_encoding("lookhere2d", num_heads=4, layer=3, depth=3)
