"""What a VLM tower is handed, checked where it arrives, so that a mistake is named by the argument it is in
(``image_sizes``, ``grid_thw``) rather than by the positional context it would break later."""

from __future__ import annotations

from typing import Any

import torch


def check_image_sizes(pixel_values: torch.Tensor, image_sizes: Any) -> None:
    """Pixtral: every image of ``image_sizes`` [B, 2] (pixels) is cut from its padded ``pixel_values`` [B, C, H, W],
    so none may exceed H x W."""
    h, w = pixel_values.shape[-2:]
    sizes = [tuple(int(v) for v in s) for s in image_sizes]
    larger = [s for s in sizes if s[0] > h or s[1] > w]
    if larger:
        raise ValueError(
            f"image_sizes {larger} exceed pixel_values of shape {tuple(pixel_values.shape)} ({h} x {w} pixels): each "
            "image is cut from its padded row of pixel_values, at most its height and width"
        )


def check_rows(hidden_states: Any, grid_thw: Any) -> None:
    """Qwen-VL: the sequence [T, C * t * p * p] holds every patch of every image and frame ``grid_thw`` [N, 3]
    names, T = the sum of frames x rows x columns."""
    if not isinstance(grid_thw, torch.Tensor) or grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        return  # named by the layout (``merged_layout``)
    rows = int(grid_thw.long().prod(dim=-1).sum())
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 1 or hidden_states.shape[0] != rows:
        got = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
        raise ValueError(
            f"grid_thw {grid_thw.tolist()} names {rows} patches (frames x rows x columns, summed), the patches given "
            f"(hidden_states) have shape {got}: one row [C * t * p * p] per patch, as the processor cuts them"
        )
