"""The diffusers transformers vispos patches, as data: where each keeps its positions, what they are, the training
grid its scalings are relative to by default, and how its forward's ``timestep`` reads as a noise level.

| class | positions (module) | training grid | noise level |
| --- | --- | --- | --- |
| ``FluxTransformer2DModel`` | RoPE over ids (t, h, w) (``pos_embed``) | 64 x 64 (1024 px) | timestep |
| ``Flux2Transformer2DModel`` | RoPE over ids (t, h, w, l) (``pos_embed``) | 64 x 64 (1024 px) | timestep |
| ``QwenImageTransformer2DModel`` | RoPE over centred ids (``pos_embed``, complex) | 83 x 83 (1328 px) | timestep |
| ``Lumina2Transformer2DModel`` | RoPE over (caption, h, w) ids (``rope_embedder``) | 64 x 64 (1024 px) | 1 - timestep |
| ``SD3Transformer2DModel`` | sin-cos table, centre crop of ``pos_embed_max_size`` | the config's | timestep / 1000 |
| ``PixArtTransformer2DModel`` | sin-cos table over ``base_size`` (``pos_embed``) | the config's | timestep / 1000 |
| ``DiTTransformer2DModel`` | sin-cos table over ``base_size`` (``pos_embed``) | the config's | timestep / 1000 |

Every family keeps its own positions (``inherit=True``, the default). DiT and PixArt, whose blocks attend over the
image tokens alone, also take any catalogue scheme in place of them (``inherit=False``: ``schemes.py``); the
joint-attention families refuse that by name (``Family.joint``: text and image tokens share one attention whose
processor and positions are the family's own).

The RoPE families' training grids are the latent token grids of their released checkpoints' training resolution
(the DyPE authors' code uses 64 for FLUX and 83 for Qwen-Image); the sin-cos families' are their config's
``sample_size // patch_size``. ``vispos.configure(train_grid=...)`` gives another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..encodings.dype import angle_dtype


@dataclass(frozen=True)
class Family:
    """One transformer class: ``kind`` "rope" or "sincos"; ``module``: the attribute holding its positions;
    ``spatial``: the id axes that are (y, x) (RoPE); ``train_grid``: the default training grid (None: the
    config's ``sample_size // patch_size``); ``noise``: how its timestep reads as a noise level (``noise_level``)."""

    name: str
    kind: str
    module: str
    spatial: tuple[int, int] = (1, 2)
    train_grid: tuple[int, int] | None = None
    noise: str = "thousandths"
    joint: str | None = None


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("FluxTransformer2DModel", "rope", "pos_embed", train_grid=(64, 64), noise="sigma",
           joint="text and image tokens in one sequence, rotated by one RoPE over (t, h, w) ids"),
    Family("Flux2Transformer2DModel", "rope", "pos_embed", train_grid=(64, 64), noise="sigma",
           joint="text, reference and image tokens in one sequence, rotated by one RoPE over (t, h, w, l) ids"),
    Family("QwenImageTransformer2DModel", "rope", "pos_embed", train_grid=(83, 83), noise="sigma",
           joint="text and image streams attending jointly, each rotated by the one complex RoPE"),
    Family("Lumina2Transformer2DModel", "rope", "rope_embedder", train_grid=(64, 64), noise="one_minus",
           joint="caption and image tokens in one sequence, rotated by one RoPE over (caption, h, w) ids"),
    Family("SD3Transformer2DModel", "sincos", "pos_embed",
           joint="text and image tokens concatenated in each block's joint attention"),
    Family("PixArtTransformer2DModel", "sincos", "pos_embed"),
    Family("DiTTransformer2DModel", "sincos", "pos_embed"),
)}  # fmt: skip
# the positional modules vispos reproduces, by the transformer that holds them
ROPE_MODULES: dict[str, str] = {
    "FluxTransformer2DModel": "FluxPosEmbed", "Flux2Transformer2DModel": "Flux2PosEmbed",
    "QwenImageTransformer2DModel": "QwenEmbedRope", "Lumina2Transformer2DModel": "Lumina2RotaryPosEmbed",
}  # fmt: skip


def supported() -> str:
    return ", ".join(FAMILIES)


def find_transformer(model: object) -> tuple[nn.Module, Family]:
    """The transformer to patch: ``model`` itself or a pipeline's ``transformer``; anything else is refused by name."""
    target = model
    if not isinstance(model, nn.Module) and isinstance(getattr(model, "transformer", None), nn.Module):
        target = model.transformer  # a DiffusionPipeline
    name = type(target).__name__
    family = FAMILIES.get(name) or next((FAMILIES[c.__name__] for c in type(target).__mro__ if c.__name__ in FAMILIES),
                                        None)  # fmt: skip
    if family is None:
        raise TypeError(f"vispos cannot patch diffusers {name}; supported transformers: {supported()} (alone or as a "
                        "pipeline's transformer)")  # fmt: skip
    module = getattr(target, family.module, None)
    expected = ROPE_MODULES.get(family.name, "PatchEmbed")
    if module is None or not any(c.__name__ == expected for c in type(module).__mro__):
        found = type(module).__name__ if module is not None else "none"
        raise TypeError(f"vispos patches {family.name} whose {family.module} is diffusers' {expected}; this one has "
                        f"{found} (another layout of positions, e.g. Qwen-Image's use_layer3d_rope)")  # fmt: skip
    return target, family


NOISE_READING = {"sigma": "sigma itself, in [0, 1]", "one_minus": "1 - sigma, in [0, 1]",
                 "thousandths": "1000 sigma, in [0, 1000]"}  # fmt: skip
MIXED_TIMESTEPS = (
    "DyPE's schedule takes one noise level per forward and this batch mixes timesteps (per-sample strength, "
    "training on random timesteps): call the transformer once per timestep, or switch the schedule off "
    "(vispos.configure(transformer, scaling=..., schedule=None))"
)


def noise_level(family: Family, timestep: object, *, single: bool = False) -> object:
    """The noise level in [0, 1] (1: pure noise) of the ``timestep`` the transformer's forward receives: FLUX and
    Qwen-Image take sigma itself, Lumina 2 takes 1 - sigma, the others a timestep in [0, 1000]. One value per
    forward: the batch's first (classifier-free guidance batches share it); ``single`` (DyPE's schedule on): a batch
    of other timesteps is refused (``torch._assert_async``: raised on the CPU, a device-side assert on a GPU, no
    synchronisation)."""
    flat = timestep.reshape(-1)  # type: ignore[attr-defined]
    if flat.numel() == 0:
        return None  # an empty batch: nothing to schedule
    if single and flat.numel() > 1:
        torch._assert_async((flat == flat[0]).all(), MIXED_TIMESTEPS)
    t = flat[0].to(angle_dtype(flat.device))  # float64, float32 on MPS and NPU
    if family.noise == "sigma":
        sigma = t
    elif family.noise == "one_minus":
        sigma = 1.0 - t
    else:
        sigma = t / 1000.0
    if single:  # a timestep on another scale (FLUX given 500 for sigma 0.5) would be clamped silently: refused
        within = (sigma >= -1e-6) & (sigma <= 1.0 + 1e-6)
        torch._assert_async(within, f"{family.name} reads its timestep as {NOISE_READING[family.noise]}; this one "
                                    "falls outside [0, 1] as a noise level (DyPE's schedule on)")  # fmt: skip
    return sigma
