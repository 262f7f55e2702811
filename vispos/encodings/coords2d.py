"""Where the patches of a 2D grid are, for the rotary schemes: (y, x) coordinates of a grid or of given cells
(pixel indices, EVA-02's reference-grid stretch, DINOv3's normalised centres) and DINOv3's training-time
augmentation of the coordinate frame (shift, jitter, rescale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._validate import check_float

COORDS: tuple[str, ...] = ("pixel", "normalized")
AXES: tuple[str, ...] = ("xy", "yx")
NORMALIZE: tuple[str, ...] = ("separate", "min", "max")


def grid_coords(
    grid: tuple[int, int],
    coords: str = "pixel",
    device: torch.device | None = None,
    *,
    offset: float = 0.0,
    normalize: str = "separate",
    ref_grid: tuple[int, int] | None = None,
    cells: torch.Tensor | None = None,
) -> torch.Tensor:
    """Patch coordinates [H*W, 2] as (y, x), row-major, fp32; with ``cells`` [M, 2] ((y, x) in patch units of
    an image whose grid is ``grid``, possibly fractional), the coordinates [M, 2] of those points instead.

    ``pixel``: integer indices + ``offset``; with ``ref_grid`` every grid is stretched onto the reference
    grid (index * ref / size per axis, EVA-02's rule). ``normalized`` (DINOv3): patch centres + ``offset``,
    divided per axis by its own size (``separate``) or by the smaller / larger side (``min`` / ``max``),
    mapped from [0, 1] to [-1, 1].
    """
    h, w = grid
    if cells is None:
        ys = torch.arange(h, device=device, dtype=torch.float32) + offset
        xs = torch.arange(w, device=device, dtype=torch.float32) + offset
    else:
        at = cells.to(device=device, dtype=torch.float32)
        ys, xs = at[:, 0] + offset, at[:, 1] + offset
    if coords == "pixel":
        if ref_grid is not None:
            ys, xs = ys / h * ref_grid[0], xs / w * ref_grid[1]
    else:
        den_h, den_w = normalized_denominators((h, w), normalize)
        ys, xs = (ys + 0.5) / den_h * 2 - 1, (xs + 0.5) / den_w * 2 - 1
    if cells is not None:
        return torch.stack((ys, xs), dim=-1)
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack((yy.flatten(), xx.flatten()), dim=-1)


def normalized_denominators(grid: tuple[int, int], normalize: str) -> tuple[int, int]:
    """What DINOv3 divides (y, x) patch centres by: each axis's size, or the smaller / larger side for both."""
    h, w = grid
    return {"separate": (h, w), "min": (min(h, w),) * 2, "max": (max(h, w),) * 2}[normalize]


@dataclass(frozen=True)
class CoordAugment:
    """Training-time jitter of the coordinate frame (DINOv3), one draw per call, shared by all tokens.

    ``shift``: per-axis offset, uniform in [-shift, shift] (coordinate units); ``jitter``: per-axis factor,
    log-uniform in [1/jitter, jitter]; ``rescale``: one factor for both axes, log-uniform in
    [1/rescale, rescale]. Applied in that order; None leaves a step out. Offsets between tokens are
    scaled, never mixed, so attention stays a function of (scaled) offsets within each sample.
    """

    shift: float | None = None
    jitter: float | None = None
    rescale: float | None = None

    def __post_init__(self) -> None:
        if self.shift is not None:
            object.__setattr__(self, "shift", check_float("shift_coords", self.shift, minimum=0.0))
        for name, value in (("jitter", self.jitter), ("rescale", self.rescale)):
            if value is not None:
                object.__setattr__(self, name, check_float(f"{name}_coords", value, minimum=1.0))

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.shift, self.jitter, self.rescale))

    def __call__(self, coords: torch.Tensor) -> torch.Tensor:
        """coords [N, 2] -> transformed coords (random draws on coords' device, in coords' dtype)."""

        def uniform(n: int, bound: float) -> torch.Tensor:
            return torch.empty(n, device=coords.device, dtype=coords.dtype).uniform_(-bound, bound)

        if self.shift is not None:
            coords = coords + uniform(2, self.shift)
        if self.jitter is not None:
            coords = coords * uniform(2, math.log(self.jitter)).exp()
        if self.rescale is not None:
            coords = coords * uniform(1, math.log(self.rescale)).exp()
        return coords


def frame_coords(yx: torch.Tensor, axes: str, augment: CoordAugment, training: bool, normalized: bool) -> torch.Tensor:
    """(y, x) coordinates [N, 2] -> in ``axes`` order, augmented in training, times 2 pi when normalized
    (DINOv3's angle = 2 pi x coordinate / period). The one coordinate pipeline of both 2D RoPEs."""
    coords = yx if axes == "yx" else yx.flip(-1)
    if training and augment.active:
        coords = augment(coords)
    return coords * (2 * math.pi) if normalized else coords
