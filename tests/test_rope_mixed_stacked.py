"""RoPE-Mixed evaluates all layers' rotations in one product per forward (``Rope2dMixed.stacked``): each layer's
slice equals that layer's own rotation bit for bit, the model's outputs and gradients are those of the layer-by-layer
path, and the stacked form steps aside where it must (coordinate augmentation in training, very large grids)."""

from __future__ import annotations

import pytest
import timm
import torch
from torch.profiler import ProfilerActivity, profile

import vispos
from vispos.encodings import rope2d

DEPTH = 4


def mixed_vit(**options: object) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", img_size=64, embed_dim=64, depth=DEPTH, num_heads=4,
                              num_classes=3, reg_tokens=2)  # fmt: skip
    return vispos.patch(model, "rope2d_mixed", **options).eval()


def layer_by_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rope2d, "STACK_LIMIT", 0)  # every grid is too large to stack: one layer at a time


@pytest.mark.parametrize("options", [{}, {"coords": "normalized"}, {"layout": "interleaved", "offset": 0.5}])
def test_each_stacked_layer_equals_that_layer_alone(options: dict) -> None:
    positions = mixed_vit(**options).vispos
    ctx = positions.context((5, 3), torch.device("cpu"))
    assert ctx.stacked is not None and ctx.stacked.cos.shape == (DEPTH, 4, 3 + 15, 16)  # 1 cls + 2 registers
    for i, module in enumerate(positions.attention):
        alone = module((5, 3), torch.device("cpu")).with_prefix(positions.num_prefix_tokens)
        rotation, _ = ctx.layer(i)
        torch.testing.assert_close(rotation.cos, alone.cos, rtol=0, atol=0)
        torch.testing.assert_close(rotation.sin, alone.sin, rtol=0, atol=0)


@pytest.mark.parametrize("size", [64, (48, 80)])
def test_outputs_and_gradients_equal_the_layer_by_layer_path(size: int | tuple, monkeypatch) -> None:
    model = mixed_vit().train()
    image = torch.randn(2, 3, *((size, size) if isinstance(size, int) else size))

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad()
        out = model(image)
        out.square().sum().backward()
        return out.detach(), torch.stack([m.freqs.grad for m in model.vispos.attention])

    stacked_out, stacked_grad = run()
    layer_by_layer(monkeypatch)
    assert model.vispos.context(model.vispos_grid(image), image.device).stacked is None
    alone_out, alone_grad = run()
    torch.testing.assert_close(stacked_out, alone_out, rtol=0, atol=0)
    torch.testing.assert_close(stacked_grad, alone_grad, rtol=1e-6, atol=1e-9)
    assert stacked_grad.abs().sum() > 0


def test_a_token_subset_takes_its_rows_from_each_layer() -> None:
    """Patch dropout / MAE masking: each row keeps the rotations of its kept tokens' places, layer by layer."""
    positions = mixed_vit().vispos
    keep = torch.tensor([[0, 5, 9, 11], [3, 2, 14, 7]])
    ctx = positions.context((4, 4), torch.device("cpu"), keep=keep)
    assert ctx.stacked is not None
    for i, module in enumerate(positions.attention):
        alone = module((4, 4), torch.device("cpu")).with_prefix(positions.num_prefix_tokens).take(ctx.tokens)
        rotation, _ = ctx.layer(i)
        assert rotation.cos.shape == (2, 4, 3 + 4, 16)
        torch.testing.assert_close(rotation.cos, alone.cos, rtol=0, atol=0)
        torch.testing.assert_close(rotation.sin, alone.sin, rtol=0, atol=0)


def test_coordinate_augmentation_in_training_is_drawn_per_layer_not_stacked() -> None:
    """DINOv3-style coordinate jitter draws a frame per layer in training: no stacked form then; in eval (no draw)
    and without augmentation the layers are stacked."""
    cpu = torch.device("cpu")
    augmented, plain = mixed_vit(shift_coords=1.0).vispos.train(), mixed_vit().vispos.train()
    assert augmented.context((4, 4), cpu).stacked is None
    assert plain.context((4, 4), cpu).stacked is not None
    assert augmented.eval().context((4, 4), cpu).stacked is not None


def _cos_calls(model: torch.nn.Module, image: torch.Tensor) -> int:
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        model(image)
    return sum(e.count for e in prof.key_averages() if e.key == "aten::cos")


def test_one_cos_per_forward_for_all_layers_and_one_per_layer_past_the_limit(monkeypatch) -> None:
    model, image = mixed_vit(), torch.randn(1, 3, 64, 64)
    assert _cos_calls(model, image) == 1
    layer_by_layer(monkeypatch)
    assert _cos_calls(model, image) == DEPTH
