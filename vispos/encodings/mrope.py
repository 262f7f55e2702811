"""Multimodal RoPE (Qwen2-VL's M-RoPE): text and image tokens in one sequence.

Each token carries three position ids (t, h, w). The rotary pairs of a head split into sections
``(t, h, w)`` counted in pairs and summing to dim / 2 (transformers' ``mrope_section``); pair j turns by
its axis's id times the plain RoPE frequency theta ** (-2j / dim):

- ``section_layout="contiguous"`` (Qwen2-VL, Qwen2.5-VL): pairs [0, t) turn with t, [t, t + h) with h,
  the rest with w.  pairs: [t t t .. h h h .. w w w ..]
- ``"interleaved"`` (Qwen3-VL): pair j turns with h when j % 3 = 1 and j < 3h, with w when j % 3 = 2 and
  j < 3w, else with t, so each axis spans the whole frequency range.  pairs: [t h w t h w .. t t]

Text tokens carry the same id on all three axes, so a text-only sequence is exactly 1D RoPE. An image's
patch tokens share one t and take their row as h and their column as w: with t fixed, the logit between
two patches is f(dy) + g(dx), an axial 2D RoPE. ``mrope_positions`` builds the ids of a sequence of text
spans and image / video grids as Qwen2-VL's ``get_rope_index`` does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .._validate import check_choice, check_dim, check_float, check_int, check_positions
from ..registry import register
from .rope import LAYOUTS, Rotary, expand_angles
from .rope_scaling import rope_inv_freq

SECTION_LAYOUTS: tuple[str, ...] = ("contiguous", "interleaved")
AXES: int = 3  # t, h, w
Span = int | tuple[int, int] | tuple[int, int, int]  # text tokens, an image (H, W), a video (T, H, W)


def default_sections(pairs: int, section_layout: str) -> tuple[int, int, int]:
    """The shipped proportions: Qwen2-VL's (16, 24, 24) of 64 pairs (contiguous), Qwen3-VL's (24, 20, 20)
    (interleaved); h = w rounded down, t takes the rest."""
    hw = 3 * pairs // 8 if section_layout == "contiguous" else 5 * pairs // 16
    return pairs - 2 * hw, hw, hw


def section_axes(sections: tuple[int, int, int], section_layout: str) -> torch.Tensor:
    """The axis (0: t, 1: h, 2: w) each rotary pair turns with, [sum(sections)] int64."""
    if section_layout == "contiguous":
        return torch.repeat_interleave(torch.arange(AXES), torch.tensor(sections))
    _, h, w = sections
    j = torch.arange(sum(sections))
    axes = torch.zeros_like(j)
    axes[(j % 3 == 1) & (j < 3 * h)] = 1
    axes[(j % 3 == 2) & (j < 3 * w)] = 2
    return axes


def check_sections(sections: object, pairs: int, section_layout: str) -> tuple[int, int, int]:
    """(t, h, w) pairs per axis: three non-negative ints summing to ``pairs`` (dim / 2); None: the default."""
    if sections is None:
        return default_sections(pairs, section_layout)
    if not isinstance(sections, Sequence) or len(sections) != AXES:
        raise TypeError(f"mrope sections must be three ints (t, h, w) counted in rotary pairs, got {sections!r}")
    t, h, w = (check_int(f"mrope sections[{i}]", v, minimum=0) for i, v in enumerate(sections))
    if t + h + w != pairs:
        raise ValueError(f"mrope sections (t, h, w) must sum to dim / 2 = {pairs} rotary pairs, got {(t, h, w)}")
    counts = torch.bincount(section_axes((t, h, w), section_layout), minlength=AXES).tolist()
    if counts != [t, h, w]:
        raise ValueError(
            f"interleaved mrope sections {(t, h, w)} do not fit {pairs} pairs: h and w take every third pair "
            f"(3h - 2 and 3w - 1 must stay below {pairs})"
        )
    return t, h, w


def mrope_angles(ids: torch.Tensor, inv_freq: torch.Tensor, axes: torch.Tensor) -> torch.Tensor:
    """Position ids [3, ..., N] -> per-pair angles [..., N, F] in fp32: pair j turns by ids[axes[j]] * inv_freq[j]."""
    per_pair = ids.index_select(0, axes.to(ids.device)).movedim(0, -1)  # [..., N, F]: each pair's own id
    return per_pair.float() * inv_freq.to(ids.device)


@register("mrope", ndim=1, kind="rotary", trainable=False, relative=True, context=("dim",), position_axes=AXES,
    summary="multimodal RoPE: rotary pairs in t / h / w sections, each turned by its own position id",
    extrapolation="as RoPE, per axis", reference="Wang et al. 2024 (Qwen2-VL); Qwen3-VL (interleaved sections)")
class MRope(nn.Module):
    """Multimodal RoPE over one sequence of text and image tokens (Qwen2-VL), called with ids [3, (B,) N].

    ``sections``: rotary pairs per axis (t, h, w), summing to dim / 2 (default: Qwen2-VL's 2 : 3 : 3 split,
    Qwen3-VL's 6 : 5 : 5 when interleaved); ``section_layout``: ``contiguous`` or ``interleaved`` (see the
    module docstring); ``layout``: the channel pairing, as for ``rope``.
    """

    def __init__(
        self,
        *,
        dim: int,
        theta: float = 10000.0,
        sections: tuple[int, int, int] | None = None,
        section_layout: str = "contiguous",
        layout: str = "half",
    ) -> None:
        super().__init__()
        self.dim = check_dim(dim, 2, "mrope")
        self.theta = check_float("theta", theta, positive=True)
        self.section_layout = check_choice("section_layout", section_layout, SECTION_LAYOUTS)
        self.layout = check_choice("layout", layout, LAYOUTS)
        self.sections = check_sections(sections, self.dim // 2, self.section_layout)

    def forward(self, positions: torch.Tensor | int) -> Rotary:
        """positions: ids [3, N] / [3, B, N], or a length / [N] for text (the same id on every axis) ->
        Rotary with cos/sin [N, dim] ([B, 1, N, dim] for batched ids)."""
        positions = check_positions(positions, axes=AXES)
        ids = positions.expand(AXES, *positions.shape) if positions.dim() == 1 else positions  # [3, (B,) N]
        axes = section_axes(self.sections, self.section_layout)  # [dim / 2]
        angles = mrope_angles(ids, rope_inv_freq(self.dim, self.theta), axes)  # [(B,) N, dim / 2]
        angles = expand_angles(angles, self.layout)  # [(B,) N, dim]
        if angles.dim() == 3:
            angles = angles[:, None]  # [B, 1, N, d]: broadcast over heads
        return Rotary(angles.cos(), angles.sin(), self.layout)

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, theta={self.theta}, sections={self.sections}, "
            f"section_layout={self.section_layout!r}, layout={self.layout!r}"
        )


def _grid(span: Sequence[int], index: int) -> tuple[int, int, int]:
    """An image (H, W) or video (T, H, W) span as (T, H, W) of positive sizes."""
    if len(span) not in (2, 3):
        raise ValueError(f"spans[{index}]: an image grid is (H, W) and a video (T, H, W), got {tuple(span)!r}")
    sizes = tuple(check_int(f"spans[{index}] size", v, minimum=1) for v in span)
    return (1, *sizes) if len(sizes) == 2 else sizes  # type: ignore[return-value]


def mrope_positions(spans: Sequence[Span], *, start: int = 0) -> torch.Tensor:
    """Position ids [3, N] (t, h, w) for text spans and image / video grids in one sequence (Qwen2-VL).

    An int n is n text tokens: ids s, s + 1, .. on all three axes. ``(H, W)`` is an image and
    ``(T, H, W)`` a video of T frames, its tokens row-major per frame (after any patch merging), with
    ids t = s + frame, h = s + row, w = s + column. Each span starts at s = 1 + the largest id before it
    (``start`` for the first): text after an image continues from the image's largest position + 1.
    Frames are numbered 0, 1, .. (Qwen2.5-VL scales them by time; transformers 5 starts the text after a
    video at s + max(H, W), which differs from this rule only for videos of more than max(H, W) frames).
    Stack several sequences (padded to one length) on dim 1 for ids [3, B, N].
    """
    check_int("start", start, minimum=0)
    if isinstance(spans, (str, bytes)) or not isinstance(spans, Sequence) or not spans:
        raise TypeError(f"spans must be a non-empty list of text lengths and (H, W) / (T, H, W) grids, got {spans!r}")
    parts, s = [], start
    for i, span in enumerate(spans):
        if isinstance(span, Sequence):
            t, h, w = _grid(span, i)
            grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            ids = torch.stack([g.flatten() for g in grid]) + s  # [3, T*H*W]
        else:
            n = check_int(f"spans[{i}] (text tokens)", span, minimum=1)
            ids = (torch.arange(n) + s).expand(AXES, n)
        parts.append(ids)
        s = int(ids.max()) + 1
    return torch.cat(parts, dim=1)
