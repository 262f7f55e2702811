"""Counted work per forward (``benchmarks/patch_work.py``) on a tiny ViT: deterministic, equal on fake and real
tensors, the added calls and bytes of rope2d, rope2d_mixed and relbias2d pinned (a regression that adds a pass
fails), and the floors checked against arithmetic written out by hand. No timings."""

from __future__ import annotations

import pytest
import torch

import vispos
from benchmarks.patch_work import MODEL, above_floor, configurations, measure, table
from benchmarks.work_count import count_work, fake_model
from benchmarks.work_floor import geometry
from benchmarks.work_targets import check_targets

TINY = {"depth": 2, "embed_dim": 64, "num_heads": 2}  # 2 layers, 2 heads of 32 channels
SIZE = 64  # a 4 x 4 grid: 16 patches + the class token
SCHEMES = ["rope2d", "rope2d_mixed", "relbias2d"]


@pytest.fixture(scope="module")
def records() -> list[dict[str, object]]:
    return measure(configurations(SCHEMES, with_timm=False, model_kwargs=TINY), [SIZE], 1)


def added(records: list[dict[str, object]], scheme: str, mode: str, dtype: str) -> dict[str, int]:
    row = next(r for r in records if r["config"] == f"vispos {scheme}" and (r["mode"], r["dtype"]) == (mode, dtype))
    return row["added"]  # type: ignore[return-value]


def test_two_runs_count_the_same(records: list[dict[str, object]]) -> None:
    again = measure(configurations(SCHEMES, with_timm=False, model_kwargs=TINY), [SIZE], 1)
    assert again == records
    assert [table(again, "inference", "fp32")] == [table(records, "inference", "fp32")]


@pytest.mark.parametrize("pos", ["rope2d", "relbias2d", "learned2d"])
@pytest.mark.parametrize("train", [False, True])
def test_fake_tensors_count_what_real_ones_do(pos: str, train: bool) -> None:
    """The benchmark's fake model (built on meta, materialised as fake tensors) dispatches exactly the ops of the
    real model, with the same sizes: the counts are those of a real forward. learned2d hands its prefix rows out of
    its module: as a view, not the parameter itself, whose missing autograd node under ``inference_mode`` torch's
    ModuleTracker (inside the FLOP counter) cannot hook."""
    build = lambda: vispos.create_model(MODEL, pos=pos, img_size=SIZE, **TINY)  # noqa: E731
    torch.manual_seed(0)
    real = count_work(build(), 1, SIZE, train=train, bf16=True)
    fake = count_work(fake_model(build), 1, SIZE, train=train, bf16=True)
    assert (fake.calls, fake.kernels, fake.bytes, fake.flops) == (real.calls, real.kernels, real.bytes, real.flops)
    assert fake.ops == real.ops and fake.op_bytes == real.op_bytes


# (calls, kernels, bytes) each scheme adds to the tiny ViT, batch 1, 64 px; bf16 is autocast
PINNED = {
    ("rope2d", "inference", "fp32"): (68, 38, 116736),
    ("rope2d", "inference", "bf16"): (70, 38, 90624),
    ("rope2d", "training", "fp32"): (129, 55, 221184),
    ("rope2d", "training", "bf16"): (137, 55, 168960),
    ("rope2d_mixed", "inference", "fp32"): (60, 25, 195712),
    ("rope2d_mixed", "inference", "bf16"): (62, 25, 169600),
    ("rope2d_mixed", "training", "fp32"): (220, 90, 768320),
    ("rope2d_mixed", "training", "bf16"): (228, 90, 681280),
    ("relbias2d", "inference", "fp32"): (53, 25, 19964),
    ("relbias2d", "inference", "bf16"): (57, 29, 15340),
    ("relbias2d", "training", "fp32"): (150, 56, 168964),
    ("relbias2d", "training", "bf16"): (198, 104, 430492),
}


@pytest.mark.parametrize("key", list(PINNED), ids=lambda k: "-".join(k))
def test_added_work_is_pinned(records: list[dict[str, object]], key: tuple[str, str, str]) -> None:
    a = added(records, *key)
    assert (a["calls"], a["kernels"], a["bytes"]) == PINNED[key]


def test_bias_masks_are_written_once_per_layer(records: list[dict[str, object]]) -> None:
    """relbias2d (a table per layer) writes one mask per layer at inference, also in bf16: the mask is gathered
    from values cast to q's dtype, not built in fp32 and cast again."""
    rows = [r for r in records if r["config"] == "vispos relbias2d" and r["mode"] == "inference"]
    assert [r["mask_writes"] for r in rows] == [TINY["depth"]] * 2
    verdict = next(v for v in check_targets(records) if v["target"].startswith("relbias2d"))
    assert verdict["holds"]


def test_floors_match_the_arithmetic(records: list[dict[str, object]]) -> None:
    """Floors by hand: 2 layers, 2 heads of 32 channels, 17 tokens (16 patches), batch 1, fp32 (4 bytes)."""
    qk = 2 * 4 * (1 * 2 * 17 * 32) * 4  # per layer: q and k read once and written once
    rope2d_table = 2 * 16 * 32 * 4  # cos and sin [HW, head_dim], shared by the layers and heads
    mixed_table = 2 * 2 * 2 * 16 * 32 * 4  # cos and sin [layers, heads, HW, head_dim]
    mask = 2 * 17 * 17 * 4  # [heads, N, N]
    expected = {
        ("rope2d", "inference", "fp32"): qk + rope2d_table,
        ("rope2d", "inference", "bf16"): qk // 2 + rope2d_table,  # q in bf16, the table in fp32
        ("rope2d", "training", "fp32"): 2 * (qk + rope2d_table),
        ("rope2d_mixed", "inference", "fp32"): qk + mixed_table,
        ("relbias2d", "inference", "fp32"): mask * (2 + 2),  # written once per layer, read once per layer
        ("relbias2d", "inference", "bf16"): mask // 2 * (2 + 2),
        ("relbias2d", "training", "fp32"): 2 * mask * (2 + 2),
    }
    offsets = 2 * 7 * 7 * 4  # a per-offset table [heads, (2H - 1)(2W - 1)]
    fused = {  # the table alone
        ("rope2d", "inference", "fp32"): rope2d_table,
        ("rope2d", "inference", "bf16"): rope2d_table,
        ("rope2d", "training", "fp32"): 2 * rope2d_table,
        ("rope2d_mixed", "inference", "fp32"): mixed_table,
        ("relbias2d", "inference", "fp32"): offsets * (2 + 2),
        ("relbias2d", "inference", "bf16"): offsets // 2 * (2 + 2),
        ("relbias2d", "training", "fp32"): 2 * offsets * (2 + 2),
    }
    for (scheme, mode, dtype), floor in expected.items():
        row = next(r for r in records if r["config"] == f"vispos {scheme}" and (r["mode"], r["dtype"]) == (mode, dtype))
        assert row["floor_bytes"] == floor, (scheme, mode, dtype)
        assert row["x_floor"] == round(row["added"]["bytes"] / floor, 2)
        assert row["fused_bytes"] == fused[(scheme, mode, dtype)], (scheme, mode, dtype)


def test_rows_that_follow_the_cpu_attention_kernel_are_marked(records: list[dict[str, object]]) -> None:
    """relbias2d's training step sends CPU attention to its math path (a mask with a gradient): marked, with what
    CUDA would choose; its inference rows and the rotary rows keep the fused kernel and are not marked."""
    marked = {(r["config"], r["mode"]) for r in records if r.get("cpu_kernel")}
    assert marked == {("vispos relbias2d", "training")}
    row = next(r for r in records if r["config"] == "vispos relbias2d" and r["mode"] == "training")
    assert "CUDA" in row["cpu_kernel"]
    assert "(CPU)" in next(line for line in table(records, "training", "fp32").splitlines() if "relbias2d" in line)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rotation_without_an_fp32_copy_is_bit_identical(dtype: torch.dtype, layout: str) -> None:
    """``apply_rope`` shuffles q in its own dtype and lets the products with fp32 cos/sin promote: the same bits
    as rotating ``x.float()`` (what it did before, one pass over q and k more). The ``half`` layout's eager three
    passes (``RotateHalf`` with gradients, tests/test_rope_backward.py; ``rotate_half_in_place`` without,
    tests/test_rope_eager_passes.py) add their multiply-adds' own fp32 rounding: within 1e-6 in fp32, the same bits
    once rounded to bf16 or fp16 here."""
    from vispos.encodings.rope import apply_rope, rotate_half, rotate_interleaved

    torch.manual_seed(0)
    qkv = torch.randn(2, 17, 3, 3, 32).to(dtype).requires_grad_()  # [B, N, (q k v), heads, d]
    x = qkv.permute(2, 0, 3, 1, 4)[0]  # q [B, heads, N, d], a strided view as in the attention
    angles = torch.randn(17, 32) * 10
    cos, sin = angles.cos(), angles.sin()
    rot = rotate_half if layout == "half" else rotate_interleaved
    xf = x.detach().float()
    rotated, expected = apply_rope(x, cos, sin, layout).detach(), (xf * cos + rot(xf) * sin).to(dtype)
    if layout == "half" and dtype == torch.float32:
        torch.testing.assert_close(rotated, expected, atol=1e-6, rtol=0)
    else:
        assert torch.equal(rotated, expected)


@pytest.mark.parametrize("pos", ["relbias2d", "alibi2d"])
def test_masks_made_in_q_dtype_equal_the_cast_fp32_masks(pos: str) -> None:
    """A mask asked for in q's dtype (``PositionContext.layer(index, dtype)``) holds the values of the fp32 mask
    cast to it, bit for bit; without a dtype the mask stays fp32."""
    model = vispos.create_model(MODEL, pos=pos, img_size=SIZE, **TINY).eval()
    with torch.no_grad():
        ctx = model.vispos.context(tuple(model.patch_embed.grid_size), torch.device("cpu"))
        for index in range(TINY["depth"]):
            fp32 = ctx.layer(index)[1]
            bf16 = ctx.layer(index, torch.bfloat16)[1]
            assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
            assert torch.equal(bf16, fp32.to(torch.bfloat16))


def test_the_tower_rows_compare_the_towers_own_rope_with_the_inherited_one() -> None:
    """``--towers``: each tower's rows share one baseline (no positions), and the two RoPE rows compute the same
    outputs from the same weights (the inherited RoPE equals the tower's own), so their counts compare like with
    like; the floors read the tower's geometry."""
    pytest.importorskip("transformers")
    from benchmarks.work_towers import HEADS, LAYERS, TOWERS, tower_rows

    rows = {label: (build, base, kind) for label, build, base, kind in tower_rows()}
    images = torch.randn(2, 3, 32, 32)
    for name in TOWERS:
        own_build, base, kind = rows[f"transformers {name} (ViT-S size)"]
        ours_build, ours_base, ours_kind = rows[f"vispos rope2d (inherited) on {name}"]
        assert base == ours_base == f"transformers {name} (ViT-S size) without positions" and base in rows
        assert kind == ours_kind == "rotary"
        own, ours = own_build(32).eval(), ours_build(32).eval()
        ours.tower.load_state_dict(own.tower.state_dict())  # a plain checkpoint into the patched tower
        with torch.no_grad():
            torch.testing.assert_close(ours(images), own(images), rtol=1e-4, atol=1e-4)
        geo = geometry(ours)
        assert (geo.layers, geo.heads, geo.head_dim, geo.grid, geo.tokens) == (LAYERS, HEADS, 64, (2, 2), 4)


def test_rotary_rows_above_a_multiple_of_their_floor_name_their_ops(records: list[dict[str, object]]) -> None:
    """The lines under the tables name, for every vispos rotary row and setting above the multiple, the ops that
    add the most bytes (at the largest size), and no row at or below it."""
    for limit in (1.0, 3.0):
        rows = [r for r in records if r.get("x_floor") and r["kind"] == "rotary"]
        over = {(r["config"], r["mode"], r["dtype"]) for r in rows if r["x_floor"] > limit}
        lines = above_floor(records, limit, count=2)
        assert len(lines) == len(over)
        for config, mode, dtype in over:
            line = next(line for line in lines if line.startswith(f"{config}, {mode} {dtype} ("))
            row = next(r for r in rows if (r["config"], r["mode"], r["dtype"]) == (config, mode, dtype))
            top = max(row["added_ops"], key=lambda op: abs(row["added_ops"][op][1]))
            assert f"{row['x_floor']:.2f}x at {row['size']}px" in line and top in line
    assert above_floor(records, 1.0)  # the tiny ViT's rotations add more than one pass
