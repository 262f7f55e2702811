"""Rotary schemes whose angles are a linear map of N-D coordinates: the shared maths, and golden-gate RoPE.

Every scheme here turns rotary pair j of a head by the angle <omega_j, p> for a token at coordinates p
[A] (A axes; 2 for images), with a frequency matrix omega [A, d/2] (per head: [heads, A, d/2]):

- axial (``rope2d``): omega_j points along one axis; no pair mixes x and y, so logits split as
  f(dx) + g(dy) (no cross term).
- directional (``rope2d_golden``, Xiong 2025, "golden gate RoPE"): fixed directions spread over the
  plane, pair f of head h along the angle (h F + f) x spacing (F = d/2 pairs per head), so that the
  sequence of directions continues over the heads; magnitudes log-spaced from ``min_freq`` to
  ``max_freq``: pairs see diagonal offsets.
- learned (``rope2d_mixed``, RoPE-Mixed): omega trained per head and layer.

All are exactly relative: R(p)^T R(p') = R(p' - p). STRING (``string.py``) puts such a map in a learned
orthogonal basis.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from .._validate import check_bool, check_choice, check_dim, check_float, check_grid, check_int
from ..registry import register
from .coords2d import COORDS, CoordAugment, frame_coords, grid_coords
from .rope import LAYOUTS, Rotary, expand_angles
from .rope_fused import coordinate_sum
from .rope_scaling import rope_inv_freq

GOLDEN_ANGLE: float = math.pi * (3.0 - math.sqrt(5.0))  # 2 pi / phi^2, about 137.5 degrees
PI_OVER_PHI: float = math.pi * (math.sqrt(5.0) - 1.0) / 2.0  # pi / phi, about 111.2 degrees
# a direction and its opposite turn a pair alike (up to the sign of the angle), so directions live on a
# half turn: pi / phi spreads them there as the golden angle does on the full turn
SPACINGS: dict[str, float] = {"pi_over_phi": PI_OVER_PHI, "golden_angle": GOLDEN_ANGLE}
GOLDEN_COORDS: tuple[str, ...] = ("linspace", *COORDS)
FREQ_RANGE: tuple[float, float] = (0.2, 20.0)  # golden-gate RoPE's ImageNet setting on linspace coords


def linear_angles(coords: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """coords [N, A] x freqs [(heads,) A, F] -> per-pair angles [(heads,) N, F] in fp32: <omega_j, p> (also
    under autocast, which would run a product in bf16 / fp16: angles of tens of rad would lose 0.1 rad), as the A
    products summed (``coordinate_sum``): under ``torch.compile`` they fuse into the rotation's kernel."""
    with torch.autocast(coords.device.type, enabled=False):
        return coordinate_sum(coords, freqs, 1)


def golden_freqs(
    dim: int,
    num_heads: int = 1,
    *,
    theta: float | None = None,
    min_freq: float = FREQ_RANGE[0],
    max_freq: float = FREQ_RANGE[1],
    spacing: str = "pi_over_phi",
    zero_freqs: float = 0.0,
    per_head: bool = True,
) -> torch.Tensor:
    """Directional frequencies [heads, 2 (x, y), dim / 2].

    Pair f of head h points along the angle n x ``spacing`` with n = h (dim / 2) + f (``per_head``: the
    sequence continues over the heads) or n = f (every head alike). Magnitudes: the first
    round(zero_freqs x dim / 2) pairs 0, the others log-spaced from ``min_freq`` up to ``max_freq``, or
    with ``theta`` RoPE's theta ** (-2j / dim') over them (dim' = 2 x their count).
    """
    pairs = dim // 2
    zeros = round(zero_freqs * pairs)
    turning = pairs - zeros
    if theta is not None:
        mag = rope_inv_freq(2 * turning, theta).double()  # [turning]
    else:
        mag = min_freq * (max_freq / min_freq) ** torch.linspace(0, 1, turning, dtype=torch.float64)
    mag = torch.cat((torch.zeros(zeros, dtype=torch.float64), mag))  # [d/2]
    index = torch.arange(num_heads * pairs if per_head else pairs, dtype=torch.float64).reshape(-1, pairs)
    phase = (index * SPACINGS[spacing]).expand(num_heads, pairs)  # [heads, d/2]
    return torch.stack((mag * phase.cos(), mag * phase.sin()), dim=1).float()  # [heads, 2, d/2]


def axial_freqs(dim: int, theta: float) -> torch.Tensor:
    """``rope2d``'s frequencies as a map [2 (x, y), dim / 2]: the first half of the pairs turn with x at
    theta ** (-4j / dim), the second half with y."""
    mag = rope_inv_freq(dim // 2, theta)  # [d/4]
    zero = torch.zeros_like(mag)
    return torch.stack((torch.cat((mag, zero)), torch.cat((zero, mag))))


def linspace_coords(
    grid: tuple[int, int], device: torch.device | None, cells: torch.Tensor | None = None
) -> torch.Tensor:
    """(x, y) [H*W or M, 2]: golden-gate RoPE's frame, x = linspace(-sqrt(W/H), sqrt(W/H), W) and
    y = linspace(-sqrt(H/W), sqrt(H/W), H) (the image's aspect at a fixed area: [-1, 1]^2 on a square grid,
    corners included); ``cells`` (fractional indices) on the same lines."""
    one = torch.ones((), device=device, dtype=torch.float32)
    hw = torch.stack((one * grid[0], one * grid[1]))  # (H, W) as a tensor: export keeps the sizes symbolic
    half = (hw / hw.flip(0)).sqrt()  # (y, x) half extents
    step = torch.where(hw > 1, 2 / (hw - 1).clamp(min=1), 0.0)  # linspace's step; a single point at -half
    yx = grid_coords(grid, "pixel", device, cells=cells)  # indices [N, 2]
    return (half * (yx * step - 1)).flip(-1)


def _coords(
    module: nn.Module, grid: tuple[int, int], device: torch.device | None, cells: torch.Tensor | None = None
) -> torch.Tensor:
    """(x, y) coordinates [H*W, 2] of a patch grid (or of ``cells`` [M, 2] on it): golden-gate RoPE's
    ``linspace`` frame, indices (``pixel``) or DINOv3's normalized frame (x 2 pi)."""
    grid = check_grid(grid)
    if module.coords == "linspace":
        return linspace_coords(grid, device, cells)
    yx = grid_coords(grid, module.coords, device, cells=cells)
    return frame_coords(yx, "xy", module.augment, module.training, module.coords == "normalized")


@register("rope2d_golden", ndim=2, kind="rotary", trainable=False, relative=True, context=("dim", "num_heads"),
    summary="golden-gate RoPE: fixed directions, (head x pair) x pi/phi, every head different; magnitudes "
    "0.2-20 on [-1, 1] coords (tested against the reference)",
    extrapolation="linspace coords: a larger grid samples [-1, 1] more densely (interpolation); pixel: "
    "unseen angles",
    reference="Xiong 2025 (golden gate RoPE, jerryxio.ng/posts/nd-rope); Heo et al. 2024 (RoPE-Mixed)")
class Rope2dGolden(nn.Module):
    """Golden-gate RoPE (Xiong 2025): every rotary pair turns with its own fixed direction of the plane.

    Pair f of head h turns by <omega_hf, (x, y)>, omega_hf = |omega_f| (cos n s, sin n s), n = h F + f
    (F = dim / 2; ``per_head=False``: n = f, every head alike), s = ``spacing``: ``pi_over_phi``
    (the reference's) or ``golden_angle`` (its double modulo pi, less even on a half turn: at dim 16 it
    leaves a 42.5 degree gap where pi/phi leaves 26.3, ideal 22.5). Magnitudes: ``min_freq`` to ``max_freq``
    log-spaced (None: 0.2 and 20, the reference's setting), or RoPE's theta ** (-2j / dim) with ``theta``;
    ``zero_freqs``: the fraction of pairs left unturned (the reference's p_zero_freqs). ``coords``:
    ``linspace`` (the reference's, see ``linspace_coords``), ``pixel`` indices or ``normalized``
    (DINOv3's). Relative, with cross terms.
    """

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        min_freq: float | None = None,
        max_freq: float | None = None,
        theta: float | None = None,
        spacing: str = "pi_over_phi",
        zero_freqs: float = 0.0,
        per_head: bool = True,
        coords: str = "linspace",
        layout: str = "half",
    ) -> None:
        super().__init__()
        self.dim = check_dim(dim, 2, "rope2d_golden")
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.theta = None if theta is None else check_float("theta", theta, positive=True)
        if self.theta is not None and (min_freq is not None or max_freq is not None):
            raise ValueError("give theta (RoPE's magnitudes) or min_freq / max_freq (a log-spaced range), not both")
        lo = FREQ_RANGE[0] if min_freq is None else check_float("min_freq", min_freq, positive=True)
        hi = FREQ_RANGE[1] if max_freq is None else check_float("max_freq", max_freq, positive=True)
        if hi < lo:
            raise ValueError(f"max_freq must be >= min_freq, got {hi} < {lo}")
        self.min_freq, self.max_freq = lo, hi
        self.spacing = check_choice("spacing", spacing, SPACINGS)
        self.zero_freqs = check_float("zero_freqs", zero_freqs, minimum=0.0)
        if self.zero_freqs > 1:
            raise ValueError(f"zero_freqs is a fraction of the pairs, in [0, 1]; got {self.zero_freqs}")
        self.per_head = check_bool("per_head", per_head)
        self.coords = check_choice("coords", coords, GOLDEN_COORDS)
        self.layout = check_choice("layout", layout, LAYOUTS)
        self.augment = CoordAugment()  # none: the coordinate pipeline of rope2d, unaugmented
        self.register_buffer("freqs", self.table(), persistent=False)  # [heads, 2, d/2]

    def table(self) -> torch.Tensor:
        """The fixed frequencies [heads, 2, d/2] of the options, fp32."""
        return golden_freqs(self.dim, self.num_heads, theta=self.theta, min_freq=self.min_freq,
                            max_freq=self.max_freq, spacing=self.spacing, zero_freqs=self.zero_freqs,
                            per_head=self.per_head)  # fmt: skip

    @torch.no_grad()
    def init_non_persistent_buffers(self) -> None:
        """timm's protocol for buffers a checkpoint does not hold (``reinit_non_persistent_buffers``, after
        ``to_empty``): the fixed frequencies are computed again from the options."""
        self.freqs.copy_(self.table())

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        """Module casts move the table but leave it fp32 and unrounded (``.to(torch.bfloat16)`` would
        round magnitudes up to 20 by 0.04 rad per unit): fixed RoPE maths stays fp32, as in timm."""
        super()._apply(fn, recurse)
        self.freqs = self.table().to(self.freqs.device)
        return self

    def forward(
        self, grid: tuple[int, int], device: torch.device | None = None, *, cells: torch.Tensor | None = None
    ) -> Rotary:
        """The rotations of the patches of ``grid``, or of the points ``cells`` [M, 2] of an image of that grid."""
        device = device or self.freqs.device
        angles = linear_angles(_coords(self, grid, device, cells), self.freqs.to(device))  # [heads, HW or M, d/2]
        angles = expand_angles(angles, self.layout)  # [heads, HW or M, d]
        return Rotary(angles.cos(), angles.sin(), self.layout)

    def extra_repr(self) -> str:
        mags = f"theta={self.theta}" if self.theta is not None else f"freqs={self.min_freq}..{self.max_freq}"
        return (
            f"dim={self.dim}, num_heads={self.num_heads}, {mags}, spacing={self.spacing!r}, "
            f"zero_freqs={self.zero_freqs}, per_head={self.per_head}, coords={self.coords!r}, layout={self.layout!r}"
        )
