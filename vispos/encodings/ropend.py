"""N-D axial RoPE for video (t, h, w) and volumes: the head's channels split into one section per axis.

Axis a gets ``split[a]`` channels (even), laid out contiguously in axis order ([t | h | w], as V-JEPA 2,
Wan and HunyuanVideo do); pair j of its section turns by its coordinate times theta ** (-2j / split[a])
(each axis spans the full frequency range). ``layout`` pairs the channels inside each section:
``half`` (channel i with i + split[a]/2 of the same section) or ``interleaved`` (2i with 2i + 1).
Channels beyond sum(split) are not rotated. Named channel splits of a head of d channels (``preset``):

| preset | split (t, h, w) | theta | layout | source |
| --- | --- | --- | --- | --- |
| ``vjepa2`` | 2 floor(floor(d/3) / 2) each, rest unrotated | 10000 | interleaved | V-JEPA 2 (Assran et al. 2025) |
| ``wan`` | d - 4 floor(d/6), 2 floor(d/6), 2 floor(d/6) | 10000 | interleaved | Wan 2.1 (Wan team 2025) |
| ``hunyuanvideo`` | d/8, 7d/16, 7d/16 ((16, 56, 56) of 128) | 256 | interleaved | HunyuanVideo (Kong et al. 2024) |

Each preset is the rotation of that model's code (``tests/test_ropend_presets.py`` checks it against
a transcription of each). V-JEPA 2's released code pairs channels 2i, 2i + 1 but lays the frequencies
out as [f_0 .. f_(s/2-1), f_0 .. f_(s/2-1)] in a section of s channels, so the two channels of a pair
turn at different frequencies (its code keeps this for its pretrained weights and names the fix, which
is the ``vjepa2`` preset); ``layout="vjepa2_released"`` reproduces the released rotation, for
V-JEPA 2's weights. It is not a rotation: logits then depend on more than the offsets.
Per-axis RoPE scaling (``scaling`` + ``train_size``) stretches each axis by its own factor,
current / training length, as ``rope2d`` does per image axis. For two axes (y, x) with
``split=(d/2, d/2)`` it is ``rope2d`` (``axes="yx"``): bit-equal with ``interleaved`` pairs; with
``half`` the same rotation with the channels of each axis together (rope2d pairs i with i + d/2 across axes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from .._validate import check_bool, check_choice, check_dim, check_float, check_int, check_ints, check_positions
from ..registry import register
from .riflex import riflex_inv_freq
from .rope import LAYOUTS, Rotary, expand_angles, rope_angles
from .rope_scaling import RopeScaling, as_scaling, check_scaling_dim, scaled_inv_freq


def _vjepa2(d: int) -> tuple[int, ...]:
    part = 2 * ((d // 3) // 2)
    return (part, part, part)


def _wan(d: int) -> tuple[int, ...]:
    return (d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6))


def _hunyuan(d: int) -> tuple[int, ...]:
    if d % 16:
        raise ValueError(f"the hunyuanvideo split (d/8, 7d/16, 7d/16) needs a head dimension divisible by 16, got {d}")
    return (d // 8, 7 * d // 16, 7 * d // 16)


# name -> (channels per axis from the head dim, theta, layout)
PRESETS: dict[str, tuple[object, float, str]] = {
    "vjepa2": (_vjepa2, 10000.0, "interleaved"),
    "wan": (_wan, 10000.0, "interleaved"),
    "hunyuanvideo": (_hunyuan, 256.0, "interleaved"),
}
# the pairings inside a section; vjepa2_released: V-JEPA 2's released code (interleaved pairs, frequencies
# laid out as in half), kept for its weights
SECTION_LAYOUTS: tuple[str, ...] = (*LAYOUTS, "vjepa2_released")


def check_split(split: object, dim: int) -> tuple[int, ...]:
    """Channels per axis: even non-negative ints summing to at most ``dim``."""
    if not isinstance(split, Sequence) or isinstance(split, str) or len(split) < 1:
        raise TypeError(f"split must be a sequence of channel counts, one per axis, got {split!r}")
    parts = tuple(check_int(f"split[{i}]", v, minimum=0) for i, v in enumerate(split))
    if any(p % 2 for p in parts):
        raise ValueError(f"split entries are channel counts of rotary pairs, so even; got {parts}")
    if sum(parts) > dim:
        raise ValueError(f"split {parts} uses {sum(parts)} channels; the head has {dim}")
    return parts


def ropend_angles(coords: torch.Tensor, inv_freqs: Sequence[torch.Tensor], pairs: int) -> torch.Tensor:
    """Per-pair angles [..., N, pairs]: coords [..., N, A] x one inverse-frequency vector [split[a] / 2]
    per axis, sections in axis order, zero angle (no rotation) for the pairs beyond them."""
    angles = [rope_angles(coords[..., a], f) for a, f in enumerate(inv_freqs)]  # [..., N, split[a]/2] each
    used = sum(f.shape[0] for f in inv_freqs)
    if used < pairs:
        angles.append(coords.new_zeros(*coords.shape[:-1], pairs - used, dtype=torch.float32))
    return torch.cat(angles, dim=-1)


def expand_sections(angles: torch.Tensor, split: Sequence[int], layout: str) -> torch.Tensor:
    """Per-pair angles [..., d/2] (sections in axis order) -> per-channel angles [..., d] in ``layout``
    inside each section: ``interleaved`` [a0 a0 a1 a1 ..]; ``half`` and ``vjepa2_released``
    [a0 .. a(s/2-1) a0 .. a(s/2-1)] per section of s channels."""
    if layout == "interleaved":  # a pair (2i, 2i + 1) never crosses a section
        return expand_angles(angles, "interleaved")
    pairs = [s // 2 for s in split]
    rest = angles.shape[-1] - sum(pairs)
    parts = angles.split([*pairs, rest] if rest else pairs, dim=-1)  # [..., s/2] per section
    return torch.cat([expand_angles(p, "half") for p in parts], dim=-1)


@register("ropend", ndim=1, kind="rotary", trainable=False, relative=True, context=("dim",), position_axes=3,
    summary="N-D axial RoPE (video t, h, w; volumes): a contiguous channel section per axis, presets vjepa2, wan, "
    "hunyuanvideo as their code (layout vjepa2_released: V-JEPA 2's released pairing, for its weights)",
    extrapolation="unseen angles beyond training lengths; RoPE scaling per axis (scale_axes); RIFLEx in time",
    reference="V-JEPA 2 (Assran et al. 2025); Wan 2.1 (2025); HunyuanVideo (Kong et al. 2024)")
class RopeNd(nn.Module):
    """Axial RoPE on A axes: ``forward`` takes positions [A, N] / [A, B, N] (integer ids, or any real
    coordinates through ``rotary(coords)``).

    ``split`` (channels per axis) or ``preset`` (``vjepa2``, ``wan``, ``hunyuanvideo``; default ``wan``'s
    split when neither is given); ``theta`` and ``layout`` default to the preset's (``half`` for a
    ``split``). ``layout``: ``half``, ``interleaved`` (inside each section) or ``vjepa2_released``
    (V-JEPA 2's released code, for its weights; not exactly relative). ``scaling`` with
    ``train_size`` (training length per axis) applies RoPE scaling to each axis with its own factor;
    ``scale_axes`` limits it to some axes (e.g. ``(0,)``: time only, for longer clips). ``riflex=(k, N_k)``:
    RIFLEx on the first (time) axis (``riflex.py``): its intrinsic component k turns at 0.9 x 2 pi / T over T frames
    where T exceeds its period N_k (always with ``riflex_finetuned``); ``riflex.intrinsic_frequency`` finds k.
    """

    def __init__(
        self,
        *,
        dim: int,
        split: Sequence[int] | None = None,
        preset: str | None = None,
        theta: float | None = None,
        layout: str | None = None,
        scaling: RopeScaling | dict | str | None = None,
        train_size: Sequence[int] | None = None,
        scale_axes: Sequence[int] | None = None,
        riflex: Sequence[int] | None = None,
        riflex_finetuned: bool = False,
    ) -> None:
        super().__init__()
        self.dim = check_dim(dim, 2, "ropend")
        if split is not None and preset is not None:
            raise ValueError("give split (channels per axis) or preset, not both")
        self.preset = None if preset is None else check_choice("preset", preset, PRESETS)
        rule, preset_theta, preset_layout = PRESETS[self.preset or "wan"]
        self.split = check_split(rule(self.dim) if split is None else split, self.dim)  # type: ignore[operator]
        self.theta = check_float("theta", preset_theta if theta is None else theta, positive=True)
        self.layout = check_choice("layout", (preset_layout if split is None else "half") if layout is None else layout,
                                   SECTION_LAYOUTS)  # fmt: skip
        axes = len(self.split)
        self.scale_axes = tuple(range(axes)) if scale_axes is None else check_ints("scale_axes", scale_axes, minimum=0)
        if any(a >= axes for a in self.scale_axes):
            raise ValueError(f"scale_axes {self.scale_axes} name axes beyond the {axes} of split {self.split}")
        self.train_size: tuple[int, ...] | None = None
        self.scalings: tuple[RopeScaling | None, ...] = (None,) * axes
        self.set_scaling(scaling, train_size=train_size)
        self.riflex = None if riflex is None else check_ints("riflex", riflex, minimum=1)
        if self.riflex is not None and (len(self.riflex) != 2 or self.riflex[0] > self.split[0] // 2):
            raise ValueError(f"riflex is (k, N_k): the time axis's intrinsic component (1 to {self.split[0] // 2}) "
                             f"and its period in frames; got {riflex}")  # fmt: skip
        self.riflex_finetuned = check_bool("riflex_finetuned", riflex_finetuned)

    @property
    def num_axes(self) -> int:
        return len(self.split)

    def set_scaling(
        self, scaling: RopeScaling | dict | str | None, *, train_size: Sequence[int] | None = None, **options: object
    ) -> None:
        """Per-axis scaling (``original_length`` = that axis's training length) or off (``None``)."""
        if train_size is not None:
            train_size = check_ints("train_size", train_size, minimum=1)
            if len(train_size) != self.num_axes:
                raise ValueError(f"train_size needs one length per axis ({self.num_axes}), got {train_size}")
        train_size = self.train_size if train_size is None else train_size
        if scaling is not None and train_size is None:
            raise ValueError("ropend scaling needs train_size, the training length of every axis")
        scaling = as_scaling(scaling, original_length=None if train_size is None else max(train_size), **options)
        scalings = []
        for a, channels in enumerate(self.split):
            if scaling is None or a not in self.scale_axes or channels == 0:
                scalings.append(None)
                continue
            check_scaling_dim(scaling, channels)
            scalings.append(replace(scaling, original_length=train_size[a]))
        self.train_size, self.scalings = train_size, tuple(scalings)

    def inv_freqs(self, lengths: Sequence[int]) -> tuple[list[torch.Tensor], float]:
        """One inverse-frequency vector [split[a] / 2] per axis at these lengths, and the attention factor
        (geometric mean of the axes')."""
        freqs, factors = [], []
        for axis, (channels, scaling, length) in enumerate(zip(self.split, self.scalings, lengths, strict=True)):
            inv, att = scaled_inv_freq(channels, self.theta, scaling, length)
            if axis == 0 and self.riflex is not None:  # RIFLEx: the time axis only, its frequency before positions
                inv = riflex_inv_freq(inv, *self.riflex, length, finetuned=self.riflex_finetuned)
            freqs.append(inv)
            factors.append(att)
        return freqs, math.prod(factors) ** (1 / len(factors))

    def rotary(self, coords: torch.Tensor, lengths: Sequence[int] | None = None) -> Rotary:
        """coords [..., N, A] (any real coordinates) -> Rotary with cos/sin [..., N, dim]; ``lengths``: the
        extent of each axis, for the scaling factors (default: max coordinate + 1)."""
        if coords.shape[-1] != self.num_axes:
            raise ValueError(f"coords must end in {self.num_axes} axes (split {self.split}), got {tuple(coords.shape)}")
        if lengths is None:
            lengths = [1] * self.num_axes if coords.numel() == 0 else (coords.flatten(0, -2).amax(0) + 1).int().tolist()
        inv, temperature = self.inv_freqs(lengths)
        angles = expand_sections(ropend_angles(coords, inv, self.dim // 2), self.split, self.layout)  # [..., N, dim]
        cos, sin = angles.cos() * temperature, angles.sin() * temperature
        if self.layout == "half":
            return Rotary(cos, sin, "half", temperature=temperature, sections=self.split)
        return Rotary(cos, sin, "interleaved", temperature=temperature)  # vjepa2_released: interleaved pairs too

    def forward(self, positions: torch.Tensor | int) -> Rotary:
        """positions: ids [A, N] / [A, B, N], or a length / [N] for the same id on every axis -> Rotary with
        cos/sin [N, dim] ([B, 1, N, dim] for batched ids)."""
        positions = check_positions(positions, axes=self.num_axes)
        if positions.dim() == 1:
            positions = positions.expand(self.num_axes, -1)  # [A, N]
        out = self.rotary(torch.movedim(positions, 0, -1))  # coords [(B,) N, A]
        if positions.dim() == 3:
            out.cos, out.sin = out.cos[:, None], out.sin[:, None]  # [B, 1, N, d]: broadcast over heads
        return out

    def extra_repr(self) -> str:
        used = [s.type for s in self.scalings if s is not None]
        scaled = f", scaling={used[0]!r}, scale_axes={self.scale_axes}" if used else ""
        riflex = "" if self.riflex is None else f", riflex={self.riflex}" + (" (fine-tuned)" * self.riflex_finetuned)
        return f"dim={self.dim}, split={self.split}, theta={self.theta}, layout={self.layout!r}" + scaled + riflex
