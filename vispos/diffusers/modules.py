"""The patched classes of a diffusers transformer and of its positional module, made once per diffusers class (each
keeps its class's name, so that ``save_pretrained`` writes the same ``_class_name``) and found again by pickle.

- ``PatchedTransformer``: reads the noise level of the ``timestep`` its forward receives (and FLUX's image grid
  from ``img_ids``) for the positions of that forward, then runs the host's forward unchanged.
- ``FluxRope`` (FLUX, FLUX.2): ids [S, A] -> (cos, sin) [S, D], each pair's value on its two channels.
- ``QwenRope``: image shapes -> complex rotations of the image tokens (ids: frame, then rows and columns centred,
  row r of H at r - (H - H // 2); a scaling follows each image's own extent) and of the text tokens (id
  max(H // 2, W // 2) + j on every axis; the model's own frequencies and magnitude 1 under any scaling, as the DyPE
  authors' code keeps them).
- ``LuminaRope``: Lumina 2's ids [B, S, 3] (caption position, row, column) -> complex rotations (complex128).
- ``PatchedPatchEmbed``: the sin-cos table of SD3, PixArt and DiT from ``sincos.SinCosTable`` (SD3's stored table,
  a persistent buffer its checkpoint loads, cropped as diffusers crops it wherever no interpolation applies).
- ``SchemeTransformer``, ``SchemePatchEmbed`` (``inherit=False``, ``schemes.py``): a catalogue scheme in place of the
  model's positions; the forward builds the context its attention processors read, the embedding adds the scheme's
  additive table.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ..encodings.dype import angle_dtype
from ..host import PositionsHost, named_base
from ..positions import own_records
from .families import FAMILIES, noise_level

_PREFIX = "_vispos["
_CLASSES: dict[tuple[type, type], type] = {}


class BuiltByPatch:
    """A patched transformer class is never built (``type(patched)(**config)``, ``.from_config``, ``.from_pretrained``
    would give a model without its positions): refused, naming what builds one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        name = type(self).__name__
        raise TypeError(
            f"the class of a vispos-patched {name} builds no model: build diffusers' {name} and patch it "
            "(vispos.patch), or load a saved one with vispos.diffusers.from_pretrained(folder)"
        )


class PatchedTransformer(BuiltByPatch, PositionsHost):
    """A diffusers transformer with vispos positions (``vispos``, ``vispos_cfg``); its forward is the host's."""

    vispos_family: str
    vispos_parameters: tuple[str, ...]  # the host forward's parameters after self, in order (set by ``patch``)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        rope = getattr(self.vispos, "rotation", None)
        if rope is None:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        given = dict(zip(self.vispos_parameters, args, strict=False)) | kwargs
        cached = given.get("kv_cache") is not None or given.get("kv_cache_mode") is not None
        if cached and (rope.scaling is not None or rope.log_n_tokens is not None):
            raise ValueError(
                f"{self.vispos_family} with a KV cache (Flux2KleinKVPipeline) under a scaling or log-n attention: the "
                "keys cached at the first step were rotated for the reference-plus-target extent and that step's "
                "noise level, later queries for the target's and their own, so q . k would no longer depend on the "
                "offset alone. Switch the scaling off (vispos.configure(transformer, scaling=None, "
                "log_n_attention=False)) or sample without the cache"
            )
        timestep = given.get("timestep")
        scheduled = rope.schedule is not None and rope.scaling is not None
        rope.sigma = None if timestep is None else noise_level(FAMILIES[self.vispos_family], timestep,
                                                                single=scheduled)  # fmt: skip
        img_ids = given.get("img_ids")
        rope.extent = None if img_ids is None else rope.id_extent(img_ids)
        try:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        finally:
            rope.sigma = rope.extent = None


class SchemeTransformer(BuiltByPatch, PositionsHost):
    """A DiT or PixArt with a catalogue scheme in its self-attention (``schemes.patch_schemes``): each forward builds
    the positional context at the latent's token grid, which the blocks' ``SchemeAttnProcessor`` read, and gives a
    rope2d under DyPE's schedule the noise level of its ``timestep`` (one per forward: the batch's first)."""

    vispos_family: str
    vispos_parameters: tuple[str, ...]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        given = dict(zip(self.vispos_parameters, args, strict=False)) | kwargs
        latent = given.get("hidden_states")
        if not isinstance(latent, torch.Tensor) or latent.dim() != 4:
            got = tuple(latent.shape) if isinstance(latent, torch.Tensor) else type(latent).__name__
            raise ValueError(f"{self.vispos_family} takes hidden_states [B, C, H, W], got {got}")
        patch = self.pos_embed.patch_size
        grid = (latent.shape[-2] // patch, latent.shape[-1] // patch)
        timestep = given.get("timestep")
        scheduled = [m for m in self.vispos.modules() if getattr(m, "schedule", None) is not None
                     and hasattr(m, "timestep_aware")]  # fmt: skip
        sigma = None if timestep is None else noise_level(FAMILIES[self.vispos_family], torch.as_tensor(timestep),
                                                          single=bool(scheduled))  # fmt: skip
        for rope in scheduled:
            rope.sigma = sigma
        self.vispos.__dict__["current"] = self.vispos.context(grid, latent.device)
        try:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.vispos.__dict__["current"] = None
            for rope in scheduled:
                rope.sigma = None


class _RopeModule:
    @property
    def vispos_rope(self) -> Any:
        return self.__dict__["_vispos_rope"]  # the transformer's Positions holds it (one copy in the state dict)


class FluxRope(_RopeModule):
    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles, scale = self.vispos_rope.pairs(ids)
        cos = (angles.cos() * scale).repeat_interleave(2, dim=-1).float()
        sin = (angles.sin() * scale).repeat_interleave(2, dim=-1).float()
        return cos.to(ids.device), sin.to(ids.device)


class QwenRope(_RopeModule):
    def forward(self, video_fhw: Any, device: torch.device | None = None,
                max_txt_seq_len: int | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if max_txt_seq_len is None:
            raise ValueError("`max_txt_seq_len` must be provided.")
        if isinstance(video_fhw, list):  # one list of shapes per batch row: the first row's, as the host reads it
            video_fhw = video_fhw[0]
        if not isinstance(video_fhw, list):
            video_fhw = [video_fhw]
        device = device if device is not None else torch.device("cpu")
        ids, top = [], 0
        for idx, (frame, height, width) in enumerate(video_fhw):
            f, r, c = torch.meshgrid(*(torch.arange(n, device=device) for n in (frame, height, width)), indexing="ij")
            if self.scale_rope:  # centred rows and columns
                r, c = r - (height - height // 2), c - (width - width // 2)
                top = max(top, height // 2, width // 2)
            else:
                top = max(top, height, width)
            ids.append(torch.stack((f + idx, r, c), dim=-1).reshape(-1, 3))
        text = (top + torch.arange(int(max_txt_seq_len), device=device))[:, None].expand(-1, 3)
        rope = self.vispos_rope
        images = []
        for (_, h, w), image in zip(video_fhw, ids, strict=True):  # each image scaled by its own extent
            extent = torch.tensor([h, w], dtype=angle_dtype(device), device=device)
            angles, scale = rope.pairs(image, extent)
            images.append(torch.polar(scale.float().expand_as(angles), angles.float()))
        angles, scale = rope.pairs(text, scaled=False)  # text: the model's own frequencies, magnitude 1
        return torch.cat(images), torch.polar(scale.float().expand_as(angles), angles.float())


class LuminaRope(_RopeModule):
    def _get_freqs_cis(self, ids: torch.Tensor) -> torch.Tensor:
        angles, scale = self.vispos_rope.pairs(ids)
        return torch.polar(scale.expand_as(angles), angles)


def patch_tokens(embed: nn.Module, latent: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """diffusers' ``PatchEmbed.forward`` up to its table: the projected (flattened, normed) tokens and their grid."""
    grid = (latent.shape[-2] // embed.patch_size, latent.shape[-1] // embed.patch_size)
    latent = embed.proj(latent)
    if embed.flatten:
        latent = latent.flatten(2).transpose(1, 2)  # BCHW -> BNC
    if embed.layer_norm:
        latent = embed.norm(latent)
    return latent, grid


class PatchedPatchEmbed:
    """diffusers' ``PatchEmbed.forward`` with the table from ``sincos.SinCosTable``."""

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        latent, grid = patch_tokens(self, latent)
        if self.pos_embed is None:
            return latent.to(latent.dtype)
        positions = self.__dict__["_vispos_table"]
        if self.pos_embed_max_size is not None and not positions.interpolates(grid):  # SD3: its stored table, cropped
            table = self.cropped_pos_embed(grid[0] * self.patch_size, grid[1] * self.patch_size)[0]
        else:
            table = positions(grid, latent.device)
        return (latent + table[None]).to(latent.dtype)


class SchemePatchEmbed:
    """diffusers' ``PatchEmbed.forward`` without the model's table, with the scheme's additive table (if any)."""

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        latent, grid = patch_tokens(self, latent)
        return self.__dict__["_vispos_positions"].add_to_patches(latent, grid)


ROPE_CLASSES: dict[str, type] = {
    "FluxTransformer2DModel": FluxRope, "Flux2Transformer2DModel": FluxRope, "QwenImageTransformer2DModel": QwenRope,
    "Lumina2Transformer2DModel": LuminaRope,
}  # fmt: skip
MIXINS: dict[str, type] = {c.__name__: c for c in (PatchedTransformer, FluxRope, QwenRope, LuminaRope,
                                                   PatchedPatchEmbed, SchemeTransformer, SchemePatchEmbed)}  # fmt: skip


def patched(base: type, mixin: type) -> type:
    """The subclass of diffusers' ``base`` with ``mixin`` before it, named as ``base`` (one per pair)."""
    cls = _CLASSES.get((base, mixin))
    if cls is None:
        where = f"{base.__module__.replace('.', '/')}:{base.__qualname__.replace('.', '/')}"
        qualname = f"{_PREFIX}{mixin.__name__}:{where}]"
        cls = type(base.__name__, (mixin, base), {"__module__": __name__, "__qualname__": qualname})
        _CLASSES[(base, mixin)] = cls
    return cls


def __getattr__(name: str) -> type:  # module attribute lookup: how pickle finds a patched class
    found = named_base(name, _PREFIX)
    if found is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    mixin, base = found
    return patched(base, MIXINS[mixin])


def adopt_plain_checkpoint(model: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """``load_state_dict`` pre-hook: a plain diffusers checkpoint (released weights, no ``vispos.`` entries) takes the
    model's own settings records, so that it loads strictly into a patched transformer. The weights of a scheme that
    replaced the model's positions (``inherit=False``) are not in it and stay missing (strict loading names them)."""
    if any(k.startswith(f"{prefix}vispos.") for k in state_dict):
        return  # a vispos checkpoint: Positions checks its settings
    state_dict.update(own_records(model.vispos, f"{prefix}vispos."))


def adopt_positions(transformer: nn.Module, positions: nn.Module, family: str, mixin: type) -> None:
    """The last step of either patch: ``transformer`` takes ``positions`` (``vispos``, in its training mode), the
    pre-hook ``adopt_plain_checkpoint`` and the patched class of ``mixin``. The instance reports its diffusers class's
    module (``transformer.__module__``): a pipeline records ``(library, class)`` from it in ``model_index.json``, so
    that diffusers' own ``from_pretrained`` reloads a pipeline saved with a patched transformer (unpatched;
    ``vispos.diffusers.from_pretrained`` gives the patched one). Pickle reads the class's own ``__module__``, which
    stays this module's."""
    base = type(transformer)
    transformer.vispos = positions.train(transformer.training)
    transformer.vispos_family = family
    transformer.vispos_parameters = forward_parameters(base)
    transformer.__dict__["__module__"] = base.__module__
    transformer._register_load_state_dict_pre_hook(adopt_plain_checkpoint, with_module=True)
    transformer.__class__ = patched(base, mixin)


def set_rope(module: nn.Module, rope: nn.Module) -> None:
    module.__dict__["_vispos_rope"] = rope


def forward_parameters(cls: type) -> tuple[str, ...]:
    """The names of ``cls.forward``'s parameters after self, in order (how positional arguments are read)."""
    return tuple(inspect.signature(cls.forward).parameters)[1:]
