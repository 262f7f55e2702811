"""One training grid per patched model: RoPE scaling (each axis's original length, YaRN's ramp) and log-n scaling
(N_train) are relative to ``Positions.scaling_grid``: the model's own grid, kept when a checkpoint of another
grid loads, or the grid given to ``vispos.configure(train_grid=...)``, recorded and kept by later calls and
through saving and loading."""

from __future__ import annotations

import json

import timm
import torch

import vispos


def make(img: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model("vit_tiny_patch16_224", img_size=img, depth=1, num_classes=0)
    with torch.no_grad():
        model.blocks[0].attn.qkv.weight.mul_(4.0)  # sharper attention: positions show in the features
    return vispos.patch(model, "rope2d").eval()


def images(px: int) -> torch.Tensor:
    return torch.randn(1, 3, px, px, generator=torch.Generator().manual_seed(1))


def grids(model: torch.nn.Module) -> tuple[object, ...]:
    """(scaling_grid, the rope's training grid, its per-axis original lengths, log-n's N_train)."""
    rope = model.vispos.attention
    lengths = None if rope.scaling_y is None else (rope.scaling_y.original_length, rope.scaling_x.original_length)
    return model.vispos.scaling_grid, rope.train_grid, lengths, model.vispos.log_n_tokens


def test_a_checkpoint_of_another_grid_leaves_one_training_grid() -> None:
    """4 x 4 weights with YaRN and log-n load into a 10 x 10 model: scaling and log-n are relative to 10 x 10, the
    model's grid, and it computes what the same weights compute when configured after loading."""
    small = make(64)
    vispos.configure(small, scaling="yarn", log_n_attention=True)
    large = make(160, seed=1)
    large.load_state_dict(small.state_dict())
    assert large.vispos.train_grid == (10, 10)
    assert grids(large) == ((10, 10), (10, 10), (10, 10), 100)
    plain = make(64)
    plain.load_state_dict(small.state_dict())
    vispos.configure(plain, scaling=None, log_n_attention=False)
    reference = make(160, seed=2)
    reference.load_state_dict(plain.state_dict())
    vispos.configure(reference, scaling="yarn", log_n_attention=True)
    with torch.no_grad():
        out = large.forward_features(images(320))
        torch.testing.assert_close(out, reference.forward_features(images(320)), rtol=1e-5, atol=1e-5)
        assert (out - small.forward_features(images(320))).abs().max() > 1e-3  # 4 x 4's scalings differ


def test_a_grid_given_to_configure_is_recorded_and_kept_through_a_load_at_another_grid() -> None:
    small = make(64)
    vispos.configure(small, scaling="yarn", log_n_attention=True, train_grid=(8, 8))
    assert small.vispos_cfg["configured_train_grid"] == [8, 8]
    assert grids(small) == ((8, 8), (8, 8), (8, 8), 64)
    large = make(160, seed=1)
    large.load_state_dict(small.state_dict())
    assert large.vispos_cfg["configured_train_grid"] == [8, 8] and large.vispos.train_grid == (10, 10)
    assert grids(large) == ((8, 8), (8, 8), (8, 8), 64)
    with torch.no_grad():
        out = large.forward_features(images(320))
        torch.testing.assert_close(out, small.forward_features(images(320)), rtol=1e-5, atol=1e-5)


def test_a_later_configure_keeps_the_grid_it_was_given_for_both_scalings() -> None:
    model = make(64)
    vispos.configure(model, log_n_attention=True, train_grid=(8, 8))
    vispos.configure(model, scaling="yarn")  # train_grid left out: it keeps its value
    assert grids(model) == ((8, 8), (8, 8), (8, 8), 64)
    vispos.configure(model, log_n_attention=True, attention="sdpa")
    assert model.vispos.log_n_tokens == 64
    vispos.configure(model, train_grid=(6, 6))  # given again: both scalings follow it
    assert grids(model) == ((6, 6), (6, 6), (6, 6), 36) and model.vispos_cfg["configured_train_grid"] == [6, 6]


def test_a_record_with_the_scalings_grid_inside_it_loads_under_the_rule() -> None:
    """Records in which configure wrote the grid into the scaling entry (format 1): a grid other than the
    checkpoint's training grid was given to configure and is kept; the checkpoint's own is the model's."""
    for written, expected in (([8, 8], (8, 8)), ([4, 4], (10, 10))):
        small = make(64)
        vispos.configure(small, scaling="yarn", train_grid=tuple(written))
        state = small.state_dict()
        settings = {"pos": ["rope2d"], "options": {}, "train_grid": [4, 4],
                    "scaling": {"scaling": "yarn", "train_grid": written}}  # fmt: skip
        text = json.dumps({"format": 1, "settings": settings, "enabled": 1, "log_n_tokens": None})
        state["vispos._extra_state"] = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
        large = make(160, seed=1)
        large.load_state_dict(state)
        assert large.vispos_cfg["scaling"] == {"scaling": "yarn"}
        assert large.vispos_cfg.get("configured_train_grid") == (None if expected == (10, 10) else written)
        assert grids(large)[:3] == (expected, expected, expected)
