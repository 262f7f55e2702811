"""The classes a patched transformers model's modules take: each original class with vispos's forward on top.

``patch`` sets ``module.__class__ = patched(type(module), Mixin)`` on the modules of the one model it is
given (transformers' classes are never modified; a CLIP text tower keeps its attention class):

- the vision host (``ViTModel``, ``CLIPVisionModel``...): ``PatchedHost`` builds the positional context once
  per forward from the image grid and hands it to every layer as the ``vispos_context`` keyword, which
  transformers' layers pass on to their attention with their other keywords;
- its ``embeddings``: ``PatchedEmbeddings`` makes patch tokens at any size divisible by the patch size, adds
  an additive scheme's table (``interpolate_pos_encoding`` is no longer needed, and ignored) and puts the
  family's prefix and register tokens first;
- each attention: ``PatchedAttention`` projects as the original, applies the layer's rotation and bias and
  calls transformers' own attention function for ``config._attn_implementation`` (eager, sdpa, flex, flash),
  so ``output_attentions`` and the kernels behave as in transformers;
- DINOv3's ``rope_embeddings``, Pixtral's ``patch_positional_embedding``: ``NoRope`` (their RoPE is vispos's
  ``rope2d`` now);
- a VLM's vision tower: ``PatchedTower`` (Pixtral) and ``PatchedMergedTower`` (Qwen2-VL) hand transformers' own
  forward the context of its packed sequence, ``PatchedPackedAttention`` is Qwen2-VL's attention over it
  (``towers.py``).

A patched class is made once per (class, mixin) and found again by pickle by its name in this module.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any

import torch
from torch import nn

from ..attention import as_float_mask, combine_masks, flex_bias_attention, query_mask, sdpa, widened
from ..host import PositionsHost
from ..positions import PositionContext, Positions
from .families import FAMILIES, naflex_layout, patch_conv, token_grid

FLASH_REFUSAL = (
    "a bias scheme adds a bias to every attention logit, which flash attention kernels do not take: use "
    "attn_implementation='sdpa' (or 'eager', 'flex_attention'), e.g. model.set_attn_implementation('sdpa')"
)


def require_context(ctx: object) -> PositionContext:
    if not isinstance(ctx, PositionContext):
        raise ValueError(
            "a vispos-patched transformers attention needs the positional context of the forward pass (the "
            "vispos_context keyword the patched model passes to its layers): call the model, not a layer alone"
        )
    return ctx


class PatchedHost(PositionsHost):
    """Mixin placed before the transformers vision model class: positions from ``self.vispos``."""

    def vispos_context(self, pixel_values: torch.Tensor) -> PositionContext:
        """The positions of one forward pass on ``pixel_values`` [B, C, H, W]."""
        grid = token_grid(patch_conv(self.embeddings), pixel_values)
        return self.vispos.context(grid, pixel_values.device)

    def vispos_ragged_context(self, pixel_values: torch.Tensor, spatial_shapes: torch.Tensor) -> PositionContext:
        """SigLIP 2: the positions of a batch of pre-cut patches [B, N, C * p * p], each row one image of size
        ``spatial_shapes`` [B, 2] (its patches row-major, then padding): each image its own grid's."""
        cells, valid = naflex_layout(spatial_shapes, pixel_values.shape[1])
        return self.vispos.ragged_context(cells, spatial_shapes.long(), valid=valid)

    def forward(self, pixel_values: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        if pixel_values is None:
            raise ValueError("a vispos-patched model needs pixel_values")
        kwargs.pop("interpolate_pos_encoding", None)  # any size works; the flag would reach transformers' checks
        if not FAMILIES[self.embeddings.vispos_family].naflex:
            return super().forward(pixel_values, *args, vispos_context=self.vispos_context(pixel_values), **kwargs)
        shapes = kwargs["spatial_shapes"] if "spatial_shapes" in kwargs else args[1] if len(args) > 1 else None
        if shapes is None:
            raise ValueError("a patched SigLIP 2 model needs spatial_shapes [B, 2], as its processor returns them")
        ctx = self.vispos_ragged_context(pixel_values, shapes)
        self.embeddings.__dict__["_vispos_context"] = ctx  # for the additive table, which needs the layout
        try:
            return super().forward(pixel_values, *args, vispos_context=ctx, **kwargs)
        finally:
            self.embeddings.__dict__.pop("_vispos_context", None)


class PatchedEmbeddings:
    """Mixin placed before a family's embeddings class: patch tokens at any size, vispos's additive table."""

    vispos_family: str

    @property
    def vispos_positions(self) -> Positions:
        return self.__dict__["_vispos_positions"]  # the host's, held without registering it a second time

    def forward(self, pixel_values: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Tokens of ``pixel_values`` with positions; ``bool_masked_pos`` (second argument or keyword) as the
        family takes it; ``interpolate_pos_encoding`` ignored (any size works); SigLIP 2's ``spatial_shapes``
        are read by the host, which hands this module the batch's layout."""
        family, positions = FAMILIES[self.vispos_family], self.vispos_positions
        bool_masked_pos = None if family.naflex else kwargs.get("bool_masked_pos", args[0] if args else None)
        if family.naflex:  # pre-cut patches [B, N, C * p * p]; the table at each image's own grid
            ctx = self.__dict__.get("_vispos_context")
            if ctx is None:
                raise ValueError("patched SigLIP 2 embeddings take their positions from the model's forward: call "
                                 "the model")  # fmt: skip
            x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
            return positions.add_to_ragged(x, ctx)
        conv = patch_conv(self)
        grid = token_grid(conv, pixel_values)
        x = conv(pixel_values.to(conv.weight.dtype)).flatten(2).transpose(1, 2)  # [B, H*W, C]
        if bool_masked_pos is not None:
            token = self.mask_token.reshape(1, 1, -1).to(x.dtype)
            x = torch.where(bool_masked_pos.bool()[..., None], token, x)
        x = positions.add_to_patches(x, grid)
        b, c = x.shape[0], x.shape[-1]
        parts = []
        if family.prefix:
            prefix = torch.cat([getattr(self, n).reshape(1, -1, c) for n in family.prefix], dim=1).to(x.dtype)
            parts.append(positions.add_to_prefix(prefix.expand(b, -1, -1)))
        if family.registers is not None:
            parts.append(getattr(self, family.registers).to(x.dtype).expand(b, -1, -1))
        x = torch.cat((*parts, x), dim=1)
        dropout = getattr(self, "dropout", None)
        return dropout(x) if isinstance(dropout, nn.Module) else x


class NoRope:
    """Mixin for DINOv3's ``rope_embeddings`` and Pixtral's ``patch_positional_embedding``: their rotation is
    vispos's now, so they compute nothing."""

    def forward(self, *args: Any, **kwargs: Any) -> None:
        return None


class TowerTable:
    """Mixin for Qwen3-VL's ``pos_embed`` (an ``nn.Embedding`` the tower interpolates to each image): it goes with the
    tower's RoPE. While the positions hold that RoPE (their settings record it as ``inherited``, through saving and
    loading) the table is looked up as before; otherwise every lookup is zero and the tower adds nothing (the
    weight stays in the state dict)."""

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        if "inherited" in self.__dict__["vispos_positions"].settings:  # a plain reference, not a submodule
            return super().forward(indices)  # type: ignore[misc]
        return self.weight.new_zeros(*indices.shape, self.weight.shape[-1])


def read_sizes(image_sizes: Any) -> list[tuple[int, int]]:
    """Pixtral's ``image_sizes`` as Python numbers: the packed row's layout, read on the host once per forward
    (transformers' forward reads them too)."""
    rows = image_sizes.tolist() if isinstance(image_sizes, torch.Tensor) else image_sizes
    return [(int(h), int(w)) for h, w in rows]


def packed_layout(image_sizes: Any, patch_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Pixtral's packed row: (cells [1, T, 2] (y, x) of each token in its image, sizes [1, S, 2] each image's grid,
    segments [1, T] its image), as its forward lays the tokens out."""
    grids = [(int(h) // patch_size, int(w) // patch_size) for h, w in image_sizes]
    cells, segments = [], []
    for index, (h, w) in enumerate(grids):
        yy, xx = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        cells.append(torch.stack((yy.flatten(), xx.flatten()), dim=-1))
        segments.append(torch.full((h * w,), index, device=device, dtype=torch.long))
    sizes = torch.tensor(grids, device=device, dtype=torch.long)
    return torch.cat(cells)[None], sizes[None], torch.cat(segments)[None]


class PatchedTower(PositionsHost):
    """Mixin placed before Pixtral's tower class: transformers' forward with the positions of ``self.vispos``."""

    def vispos_context(self, pixel_values: torch.Tensor, image_sizes: Any = None) -> PositionContext:
        """The positions of the packed row the forward makes of ``pixel_values`` [B, C, H, W] and ``image_sizes``
        [B, 2] (pixels; default: every image the full size)."""
        if not isinstance(pixel_values, torch.Tensor) or pixel_values.dim() != 4:
            got = tuple(pixel_values.shape) if isinstance(pixel_values, torch.Tensor) else type(pixel_values).__name__
            raise ValueError(f"pixel_values must be an image batch [B, C, H, W], got {got}")
        if image_sizes is None:
            image_sizes = [tuple(pixel_values.shape[-2:])] * pixel_values.shape[0]
        image_sizes = read_sizes(image_sizes)
        p = self.patch_size
        too_small = [tuple(int(v) for v in s) for s in image_sizes if int(s[0]) < p or int(s[1]) < p]
        if too_small:
            raise ValueError(f"image sizes {too_small} hold no {p}x{p} patch")
        cells, sizes, segments = packed_layout(image_sizes, p, pixel_values.device)
        # Pixtral's forward hides the other images with its own block mask: none is built here
        return self.vispos.ragged_context(cells, sizes, segments=segments, separate=True)

    def forward(self, pixel_values: torch.Tensor | None = None, image_sizes: Any = None, **kwargs: Any) -> Any:
        if pixel_values is None:
            raise ValueError("a vispos-patched model needs pixel_values")
        ctx = self.vispos_context(pixel_values, image_sizes)
        return super().forward(pixel_values, image_sizes, vispos_context=ctx, **kwargs)



def segment_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    """The lengths of the segments (frames or windows) a Qwen-VL layer attends within, read on the host, as the
    tower's own sdpa and eager attention read them, to split the sequence."""
    return (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()


def merged_layout(grid_thw: torch.Tensor, merge: int) -> tuple[torch.Tensor, ...]:
    """Qwen2-VL's sequence: (cells [1, T, 2] (y, x) of each token in its frame, sizes [1, S, 2] each frame's grid,
    segments [1, T] its frame), frames in turn, each frame's patches in merge x merge blocks as its forward has
    them (the blocks row-major, each block row-major)."""
    if not isinstance(grid_thw, torch.Tensor) or grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"grid_thw must be a tensor [N, 3] of (frames, rows, columns), got {grid_thw!r}")
    device = grid_thw.device
    cells, sizes, segments = [], [], []
    for t, h, w in grid_thw.tolist():
        if h % merge or w % merge:
            raise ValueError(f"a grid of {h} x {w} patches does not tile into {merge} x {merge} merge blocks")
        yy, xx = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        blocks = (h // merge, merge, w // merge, merge)
        frame = torch.stack([a.reshape(blocks).transpose(1, 2).flatten() for a in (yy, xx)], dim=-1)  # [h w, 2]
        for _ in range(t):
            segments.append(torch.full((h * w,), len(sizes), device=device, dtype=torch.long))
            cells.append(frame)
            sizes.append((h, w))
    return torch.cat(cells)[None], torch.tensor(sizes, device=device)[None], torch.cat(segments)[None]


class PatchedMergedTower(PositionsHost):
    """Mixin placed before Qwen2-VL's and Qwen3-VL's vision tower classes: transformers' forward with the positions
    of ``self.vispos`` (``towers.py``)."""

    def vispos_context(self, grid_thw: torch.Tensor) -> PositionContext:  # type: ignore[override]
        """The positions of the sequence the tower takes for ``grid_thw`` [N, 3] (frames, rows, columns each)."""
        cells, sizes, segments = merged_layout(grid_thw, self.spatial_merge_size)
        return self.vispos.ragged_context(cells, sizes, segments=segments, separate=True)  # frame by frame

    def forward(self, hidden_states: torch.Tensor, grid_thw: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if grid_thw is None:
            raise ValueError("a vispos-patched Qwen-VL vision tower needs grid_thw [N, 3], as its processor gives it")
        extra = self.vispos_keywords(grid_thw, kwargs)  # (may take precomputed keywords out of kwargs)
        return super().forward(hidden_states, grid_thw, **extra, **kwargs)

    def vispos_keywords(self, grid_thw: torch.Tensor, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The keywords the tower's own forward is handed besides the caller's: the positions' context."""
        return {"vispos_context": self.vispos_context(grid_thw)}


class PatchedWindowedTower(PatchedMergedTower):
    """Mixin placed before Qwen2.5-VL's vision tower class: Qwen2-VL's sequence with its merge blocks reordered
    window by window, as its forward reorders them before the first block (``window_index``); its layers attend
    within each window or, at ``fullatt_block_indexes``, within each frame, by the ``cu_seqlens`` they are handed."""

    def vispos_context(self, grid_thw: torch.Tensor, window_index: torch.Tensor | None = None) -> PositionContext:  # type: ignore[override]
        """The positions of the window-ordered sequence for ``grid_thw`` [N, 3]; ``window_index``: the order of the
        merge blocks (by default the tower's, ``transformers.vision_utils.get_vision_window_index``)."""
        if window_index is None:
            window_index, _ = self._window_order(grid_thw, {})
        cells, sizes, segments = merged_layout(grid_thw, self.spatial_merge_size)
        unit, order = self.spatial_merge_unit, window_index.to(cells.device)
        cells = cells.reshape(-1, unit, 2)[order].reshape(1, -1, 2)
        segments = segments.reshape(-1, unit)[order].reshape(1, -1)
        return self.vispos.ragged_context(cells, sizes, segments=segments, separate=True)

    def vispos_keywords(self, grid_thw: torch.Tensor, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The window order computed once (or the caller's precomputed pair, taken out of ``kwargs``) and handed
        to the tower's forward with the context that follows it."""
        index, cu_window_seqlens = self._window_order(grid_thw, kwargs)
        return {"vispos_context": self.vispos_context(grid_thw, index), "window_index": index,
                "cu_window_seqlens": cu_window_seqlens}  # fmt: skip

    def _window_order(self, grid_thw: torch.Tensor, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        from transformers.vision_utils import get_vision_window_index  # the function the tower's forward calls

        return get_vision_window_index(grid_thw, self.spatial_merge_size, self.window_size, self.patch_size,
                                       kwargs=kwargs)  # fmt: skip


class PatchedPackedAttention:
    """Mixin placed before Qwen2-VL's ``VisionAttention`` and Qwen2.5-VL's: its fused ``qkv`` over the sequence
    [T, C], vispos's positions, SDPA over each segment of the tower's ``cu_seqlens`` alone (its frames or windows; a
    bias scheme's mask cut to the segment's block), its ``proj``."""

    vispos_layer: int

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, *args: Any,
                vispos_context: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        ctx = require_context(vispos_context)
        x = hidden_states[None]  # [1, T, C]: the context's one packed row
        ctx.check_tokens(x)
        t = hidden_states.shape[0]
        q, k, v = (part[None] for part in self.qkv(hidden_states).reshape(t, 3, self.num_heads, -1)
                   .permute(1, 2, 0, 3).unbind(0))  # fmt: skip  # each [1, heads, T, d]
        rotary, mask = ctx.layer(self.vispos_layer, q.dtype, x)
        if rotary is not None:
            q, k = rotary.rotate(q, k)
        dropout = self.attention_dropout if self.training else 0.0
        mask, lengths = query_mask(mask, q), segment_lengths(cu_seqlens)
        outs, start = [], 0
        # each segment attends to itself alone, as in the tower's own attention; split (one cat in the backward),
        # not sliced (a zero-filled gradient of the whole sequence per segment)
        for qs, ks, vs, n in zip(*(t.split(lengths, dim=2) for t in (q, k, v)), lengths, strict=True):
            block = None if mask is None else mask[..., start : start + n, start : start + n]
            outs.append(sdpa(qs, ks, vs, mask=block, dropout_p=dropout, scale=self.scaling * ctx.logit_scale))
            start += n
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return self.proj(out[0].transpose(0, 1).reshape(t, -1))


class PatchedAttention:
    """Mixin placed before a family's attention class: its projections, vispos's positions, transformers'
    attention function."""

    vispos_layer: int

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: Any = None,  # DINOv3's own RoPE: not used (vispos's rope2d replaces it)
        vispos_context: PositionContext | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx = require_context(vispos_context)
        ctx.check_tokens(hidden_states)
        b, n, _ = hidden_states.shape
        q, k, v = (
            proj(hidden_states).view(b, n, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        impl = self.config._attn_implementation or "eager"
        dropout = self.attention_dropout if hasattr(self, "attention_dropout") else self.dropout
        dropout = dropout if self.training else 0.0
        scaling = self.scaling if hasattr(self, "scaling") else self.scale
        flex = ctx.flex(self.vispos_layer) if attention_mask is None else None
        if flex is not None and dropout == 0.0 and _flex_runs(q):  # vispos.configure(attention="flex")
            q = q * ctx.logit_scale if ctx.logit_scale != 1.0 else q
            out, weights = flex_bias_attention(q.contiguous(), k, v, flex, scale=scaling).transpose(1, 2), None
        else:
            rotary, mask = ctx.layer(self.vispos_layer, inputs=hidden_states)
            if rotary is not None:
                q, k = rotary.rotate(q, k)
            mask = query_mask(mask, q)
            if mask is not None and "flash" in impl:
                raise ValueError(f"{ctx.positions.settings['pos']} with attn_implementation={impl!r}: {FLASH_REFUSAL}")
            if mask is not None:
                given = attention_mask if isinstance(attention_mask, torch.Tensor) else None
                mask = combine_masks(mask, as_float_mask(given, torch.float32)).to(q.dtype)
            else:
                mask = attention_mask
            if impl == "flex_attention" and isinstance(mask, torch.Tensor):
                # transformers' flex function reads a dense float mask per element (and crashes on CPU in
                # torch 2.14); SDPA takes it fused. vispos.configure(attention="flex") gives the flex kernel.
                out, weights = sdpa(q, k, v, mask=mask, dropout_p=dropout, scale=scaling * ctx.logit_scale), None
                out = out.transpose(1, 2)
            else:
                attend = _attention_function(self, impl)
                out, weights = attend(self, q, k, widened(v, q), mask, dropout=dropout,
                                      scaling=scaling * ctx.logit_scale, **kwargs)  # fmt: skip
                out = out[..., : self.head_dim]  # [B, N, heads, head_dim]: a widened v's zero channels dropped
        out = out.reshape(b, n, -1).contiguous()
        proj = self.o_proj if hasattr(self, "o_proj") else self.out_proj
        return proj(out), weights


def _flex_runs(q: torch.Tensor) -> bool:
    """Where vispos's FlexAttention path runs in torch 2.14: GPUs; on CPU eager inference only."""
    return q.device.type != "cpu" or (not torch.is_grad_enabled() and not torch.compiler.is_compiling())


def _attention_function(module: nn.Module, impl: str) -> Any:
    """transformers' attention function for ``impl``; eager: the one of the module's own modeling file (their
    softmax dtypes differ: ViT's and CLIP's in fp32, DINOv2's in the input's)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = _eager_function(type(module))
    return eager if impl == "eager" else ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager)


@functools.cache
def _eager_function(cls: type) -> Any:
    """The ``eager_attention_forward`` of the modeling file of a (patched) attention class, found once per class."""
    base = next(c for c in cls.__mro__ if c.__module__.startswith("transformers."))
    return sys.modules[base.__module__].eager_attention_forward


MIXINS: dict[str, type] = {
    m.__name__: m
    for m in (PatchedHost, PatchedEmbeddings, PatchedAttention, NoRope, TowerTable, PatchedTower, PatchedMergedTower,
              PatchedWindowedTower, PatchedPackedAttention)
}
_CLASSES: dict[tuple[type, type], type] = {}
_PREFIX = "Patched["


def patched(base: type, mixin: type) -> type:
    """The subclass of transformers' ``base`` with ``mixin`` before it (one per pair, so pickle finds it)."""
    cls = _CLASSES.get((base, mixin))
    if cls is None:
        where = f"{base.__module__.replace('.', '/')}:{base.__qualname__.replace('.', '/')}"
        name = f"{_PREFIX}{mixin.__name__}:{where}]"
        cls = type(base.__name__, (mixin, base), {"__module__": __name__, "__qualname__": name})
        _CLASSES[(base, mixin)] = cls
    return cls


def __getattr__(name: str) -> type:  # module attribute lookup: how pickle finds a patched class
    if not (name.startswith(_PREFIX) and name.endswith("]")):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    mixin, module, qualname = name[len(_PREFIX) : -1].split(":")
    base: Any = importlib.import_module(module.replace("/", "."))
    for part in qualname.split("/"):
        base = getattr(base, part)
    return patched(base, MIXINS[mixin])
