"""The mixins of a VLM's vision tower (``towers.py`` patches it): ``PatchedTower`` (Pixtral) and
``PatchedMergedTower`` / ``PatchedWindowedTower`` (Qwen2-VL, Qwen3-VL / Qwen2.5-VL) hand transformers' own tower
forward the context of its packed sequence; ``PatchedPackedAttention`` is Qwen2-VL's attention over it;
``TowerTable`` is Qwen3-VL's table beside its RoPE. ``require_context``: what every patched attention checks
first. Their classes are made and found by ``modules.patched``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention import query_mask, sdpa
from ..host import PositionsHost
from ..positions import PositionContext
from ..registry import reset_scheme
from .inputs import check_image_sizes, check_rows


def init_positions(host: nn.Module, module: nn.Module) -> bool:
    """transformers' init (``_init_weights``) of one ``module`` of a patched ``host``: a module of its positions is
    vispos's to initialise (each scheme module as it was built, ``reset_scheme``; the modules inside it with it), and
    True is returned; False for any other module, which the family initialises."""
    if not any(module is m for m in host.vispos.modules()):
        return False
    reset_scheme(module)
    return True


def require_context(ctx: object) -> PositionContext:
    if not isinstance(ctx, PositionContext):
        raise ValueError(
            "a vispos-patched transformers attention needs the positional context of the forward pass (the "
            "vispos_context keyword the patched model passes to its layers): call the model, not a layer alone"
        )
    return ctx


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

    def _init_weights(self, module: nn.Module) -> None:
        if not init_positions(self, module):
            super()._init_weights(module)  # type: ignore[misc]

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
        check_image_sizes(pixel_values, image_sizes)
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

    def _init_weights(self, module: nn.Module) -> None:
        if not init_positions(self, module):
            super()._init_weights(module)  # type: ignore[misc]

    def vispos_context(self, grid_thw: torch.Tensor) -> PositionContext:  # type: ignore[override]
        """The positions of the sequence the tower takes for ``grid_thw`` [N, 3] (frames, rows, columns each)."""
        cells, sizes, segments = merged_layout(grid_thw, self.spatial_merge_size)
        return self.vispos.ragged_context(cells, sizes, segments=segments, separate=True)  # frame by frame

    def forward(self, hidden_states: torch.Tensor, grid_thw: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if grid_thw is None:
            raise ValueError("a vispos-patched Qwen-VL vision tower needs grid_thw [N, 3], as its processor gives it")
        check_rows(hidden_states, grid_thw)
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
