"""What a forward keeps for positions at a large grid, counted exactly (no timings, no resident-set readings).

ViT-S/16 at 640 px and 480 px (40 x 40 and 30 x 30 grids, 12 layers, 6 heads), inference. The positional
context a forward builds once and keeps until its end may hold one rotation that every layer shares, or one
mask that every layer shares, and the int32 index the bias masks are gathered through (1/heads of one mask);
it must not hold every layer's tables at once. A layer then adds its own rotation or its own mask while it
runs: at the peak, one layer's rotation, or one mask and the index. Inference caches (learned-basis
rotations) keep nothing for a grid whose rotation passes their byte budget. ``benchmarks/position_memory.py``
measures the same budget as resident memory (docs/performance.md).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import vispos
from vispos.encodings._cache import InferenceCache

PX = 480  # bias schemes; rotary ones at ROTARY_PX, where every cached rotation passes the caches' byte budget
ROTARY_PX = 640
ROTARY = vispos.list_encodings(ndim=2, kind="rotary")
BIAS = vispos.list_encodings(ndim=2, kind="bias")


def tensor_bytes(obj: object, *, storage: bool = True) -> int:
    """Bytes of the tensors ``obj`` holds (a tensor, or the tensor fields of a rotation or context, one level of
    nesting): of their distinct storages (what stays allocated), or with ``storage=False`` of the views
    themselves (a layer's slice of a stacked rotation counts as one layer)."""
    seen: dict[int, int] = {}

    def visit(value: object, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            kept = value.untyped_storage()
            seen[kept.data_ptr()] = kept.nbytes() if storage else value.numel() * value.element_size()
        elif depth < 2 and value is not None and hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module):
            for field in vars(value).values():
                visit(field, depth + 1)

    visit(obj, 0)
    return sum(seen.values())


def context(scheme: str, px: int = PX) -> tuple[object, torch.nn.Module]:
    torch.manual_seed(0)
    model = vispos.create_model("vit_small_patch16_224", pos=scheme, num_classes=0).eval()
    with torch.inference_mode():
        return model.vispos_context(torch.zeros(1, 3, px, px)), model


@pytest.mark.parametrize("scheme", ROTARY)
def test_a_rotary_scheme_keeps_at_most_one_layers_rotation_for_the_whole_forward(scheme: str) -> None:
    ctx, model = context(scheme, ROTARY_PX)
    with torch.inference_mode():
        rotation, mask = ctx.layer(0)
    one_layer = tensor_bytes(rotation, storage=False)
    assert mask is None and one_layer > 0
    kept = sum(tensor_bytes(getattr(ctx, f.name)) for f in dataclasses.fields(ctx) if f.name != "positions")
    assert kept <= one_layer, f"{scheme}: the context keeps {kept / 2**20:.1f} MiB, one layer's rotation is " \
                              f"{one_layer / 2**20:.1f} MiB ({len(model.blocks)} layers)"
    with torch.inference_mode():  # every layer takes its rotation, as a forward does
        for index in range(len(model.blocks)):
            ctx.layer(index)
    caches = [m.cache for m in model.vispos.modules() if isinstance(getattr(m, "cache", None), InferenceCache)]
    cached = sum(cache.nbytes for cache in caches)
    assert cached <= one_layer, f"{scheme}: inference caches keep {cached / 2**20:.1f} MiB after the forward"


@pytest.mark.parametrize("scheme", BIAS)
def test_a_bias_scheme_holds_one_mask_and_its_index_at_the_peak(scheme: str) -> None:
    ctx, model = context(scheme)
    heads, tokens = model.blocks[0].attn.num_heads, 1 + (PX // 16) ** 2
    one_mask = heads * tokens * tokens * 4
    kept = sum(tensor_bytes(getattr(ctx, f.name)) for f in dataclasses.fields(ctx) if f.name != "positions")
    with torch.inference_mode():
        _, mask = ctx.layer(0)
    assert mask.shape == (1, heads, tokens, tokens) and tensor_bytes(mask) == one_mask
    added = 0 if ctx.shared is not None else one_mask  # a shared mask is in ``kept`` already
    assert kept + added <= one_mask * (1 + 1 / heads) + 2**20, f"{scheme}: {(kept + added) / one_mask:.2f} masks"
