"""Tiny diffusers transformers (built from configs: no weights, nothing downloaded) and one forward's inputs each,
for the diffusers host's tests. ``build(name)`` -> (model, inputs(h, w, t)) with (h, w) the latent token grid."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

diffusers = __import__("pytest").importorskip("diffusers")

Inputs = Callable[..., dict[str, Any]]


def _flux_ids(h: int, w: int, axes: int) -> torch.Tensor:
    ids = torch.zeros(h, w, axes)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(-1, axes)


def flux() -> tuple[torch.nn.Module, Inputs]:
    model = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=8, pooled_projection_dim=8,
        axes_dims_rope=(4, 6, 6))  # fmt: skip

    def inputs(h: int, w: int, t: float = 0.7) -> dict[str, Any]:
        g = torch.Generator().manual_seed(h * 100 + w)
        return {"hidden_states": torch.randn(1, h * w, 4, generator=g), "timestep": torch.tensor([t]),
                "encoder_hidden_states": torch.randn(1, 3, 8, generator=g), "pooled_projections": torch.randn(1, 8,
                generator=g), "img_ids": _flux_ids(h, w, 3), "txt_ids": torch.zeros(3, 3)}  # fmt: skip

    return model, inputs


def flux2() -> tuple[torch.nn.Module, Inputs]:
    model = diffusers.Flux2Transformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=8, timestep_guidance_channels=16,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)  # fmt: skip

    def inputs(h: int, w: int, t: float = 0.7) -> dict[str, Any]:
        g = torch.Generator().manual_seed(h * 100 + w)
        txt_ids = torch.zeros(3, 4)
        txt_ids[:, 3] = torch.arange(3)
        return {"hidden_states": torch.randn(1, h * w, 4, generator=g), "timestep": torch.tensor([t]),
                "encoder_hidden_states": torch.randn(1, 3, 8, generator=g), "img_ids": _flux_ids(h, w, 4),
                "txt_ids": txt_ids}  # fmt: skip

    return model, inputs


def qwen() -> tuple[torch.nn.Module, Inputs]:
    model = diffusers.QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=8, axes_dims_rope=(4, 6, 6))  # fmt: skip

    def inputs(h: int, w: int, t: float = 0.7) -> dict[str, Any]:
        g = torch.Generator().manual_seed(h * 100 + w)
        return {"hidden_states": torch.randn(1, h * w, 16, generator=g), "timestep": torch.tensor([t]),
                "encoder_hidden_states": torch.randn(1, 3, 8, generator=g),
                "encoder_hidden_states_mask": torch.ones(1, 3), "img_shapes": [[(1, h, w)]]}  # fmt: skip

    return model, inputs


def lumina() -> tuple[torch.nn.Module, Inputs]:
    model = diffusers.Lumina2Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, hidden_size=32,
        num_layers=1, num_refiner_layers=1, num_attention_heads=2, num_kv_heads=1, multiple_of=16, cap_feat_dim=8,
        axes_dim_rope=(4, 6, 6), axes_lens=(32, 32, 32))  # fmt: skip

    def inputs(h: int, w: int, t: float = 0.3) -> dict[str, Any]:
        g = torch.Generator().manual_seed(h * 100 + w)
        mask = torch.ones(2, 4, dtype=torch.bool)
        mask[1, 3:] = False  # captions of 4 and 3 tokens: each keeps its own positions
        return {
            "hidden_states": torch.randn(2, 4, 2 * h, 2 * w, generator=g),
            "timestep": torch.tensor([t, t]),
            "encoder_hidden_states": torch.randn(2, 4, 8, generator=g),
            "encoder_attention_mask": mask,
        }

    return model, inputs


def sd3() -> tuple[torch.nn.Module, Inputs]:
    model = diffusers.SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=8, caption_projection_dim=16,
        pooled_projection_dim=8, out_channels=4, pos_embed_max_size=12)  # fmt: skip

    def inputs(h: int, w: int, t: float = 700.0) -> dict[str, Any]:
        g = torch.Generator().manual_seed(h * 100 + w)
        return {
            "hidden_states": torch.randn(1, 4, 2 * h, 2 * w, generator=g),
            "timestep": torch.tensor([t]),
            "encoder_hidden_states": torch.randn(1, 3, 8, generator=g),
            "pooled_projections": torch.randn(1, 8, generator=g),
        }

    return model, inputs


def pixart() -> tuple[torch.nn.Module, Inputs]:
    model = diffusers.PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=8, num_layers=1, cross_attention_dim=16, sample_size=8, patch_size=2, caption_channels=8,
        interpolation_scale=1)  # fmt: skip

    def inputs(h: int, w: int, t: float = 700.0) -> dict[str, Any]:
        g = torch.Generator().manual_seed(h * 100 + w)
        return {
            "hidden_states": torch.randn(1, 4, 2 * h, 2 * w, generator=g),
            "timestep": torch.tensor([t]),
            "encoder_hidden_states": torch.randn(1, 3, 8, generator=g),
            "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
        }

    return model, inputs


def dit() -> tuple[torch.nn.Module, Inputs]:
    model = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=8, num_layers=1, sample_size=8, patch_size=2, num_embeds_ada_norm=10)  # fmt: skip

    def inputs(h: int, w: int, t: float = 700.0) -> dict[str, Any]:
        g = torch.Generator().manual_seed(h * 100 + w)
        return {
            "hidden_states": torch.randn(1, 4, 2 * h, 2 * w, generator=g),
            "timestep": torch.tensor([int(t)]),
            "class_labels": torch.tensor([1]),
        }

    return model, inputs


BUILDERS: dict[str, Callable[[], tuple[torch.nn.Module, Inputs]]] = {
    "flux": flux, "flux2": flux2, "qwen": qwen, "lumina": lumina, "sd3": sd3, "pixart": pixart, "dit": dit,
}  # fmt: skip
ROPE = ("flux", "flux2", "qwen", "lumina")
SINCOS = ("sd3", "pixart", "dit")


def build(name: str, seed: int = 0) -> tuple[torch.nn.Module, Inputs]:
    torch.manual_seed(seed)
    model, inputs = BUILDERS[name]()
    return model.eval(), inputs


def run(model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]
