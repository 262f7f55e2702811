"""Rotary position embedding (RoPE): 1D, axial 2D, RoPE-Mixed 2D, and the pure rotation maths.

Layouts of the rotary pairs inside a head of ``dim`` channels:

- ``half`` (default, GPT-NeoX / timm ``RotaryEmbeddingCat`` style): channel i pairs with i + dim/2.
  x: [x0 x1 .. x(d/2-1) | x(d/2) .. x(d-1)]  rotate_half(x): [-x(d/2) .. -x(d-1) | x0 .. x(d/2-1)]
- ``interleaved`` (the original RoFormer / GPT-J form): channel 2i pairs with 2i + 1.
  x: [x0 x1 x2 x3 ...]  rotate_interleaved(x): [-x1 x0 -x3 x2 ...]

Angles are computed in fp32 and the rotated result is cast back to the input dtype.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
from einops import rearrange
from torch import nn

from .._validate import check_bool, check_choice, check_dim, check_float, check_grid, check_int, check_positions
from ..registry import register
from .rope_scaling import RopeScaling, as_scaling, check_scaling_dim, rope_inv_freq, scaled_inv_freq

LAYOUTS: tuple[str, ...] = ("half", "interleaved")
COORDS: tuple[str, ...] = ("pixel", "normalized")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    pairs = rearrange(x, "... (d r) -> ... d r", r=2)
    x1, x2 = pairs.unbind(-1)
    return rearrange(torch.stack((-x2, x1), dim=-1), "... d r -> ... (d r)")


def expand_angles(angles: torch.Tensor, layout: str) -> torch.Tensor:
    """Per-pair angles [..., d/2] -> per-channel angles [..., d] in the given layout."""
    if layout == "half":
        return torch.cat((angles, angles), dim=-1)
    return angles.repeat_interleave(2, dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """Rotate x [..., N, d] by per-channel cos/sin [..., N, d] (broadcast); fp32 maths, x's dtype out."""
    rot = rotate_half if layout == "half" else rotate_interleaved
    xf = x.float()
    return (xf * cos + rot(xf) * sin).to(x.dtype)


@dataclass
class Rotary:
    """Angles ready to apply to q and k: cos/sin [..., N, head_dim] in fp32, in ``layout``.

    xPos adds per-channel scales: q is multiplied by ``q_scale`` and k by ``k_scale`` (same shape).
    """

    cos: torch.Tensor
    sin: torch.Tensor
    layout: str = "half"
    q_scale: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    temperature: float = 1.0  # the scaling method's attention factor, already folded into cos and sin

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: [B, heads, N, head_dim] -> rotated (and, for xPos, scaled) q, k."""
        if self.q_scale is None:
            return apply_rope(q, self.cos, self.sin, self.layout), apply_rope(k, self.cos, self.sin, self.layout)
        qc, qs = self.cos * self.q_scale, self.sin * self.q_scale
        kc, ks = self.cos * self.k_scale, self.sin * self.k_scale
        return apply_rope(q, qc, qs, self.layout), apply_rope(k, kc, ks, self.layout)

    def with_prefix(self, num_prefix_tokens: int) -> Rotary:
        """Prepend identity rotations for prefix tokens (cls, registers): they stay exactly unrotated."""
        if num_prefix_tokens == 0:
            return self

        def pad(t: torch.Tensor | None, value: float) -> torch.Tensor | None:
            if t is None:
                return None
            shape = (*t.shape[:-2], num_prefix_tokens, t.shape[-1])
            return torch.cat((t.new_full(shape, value), t), dim=-2)

        # identity rotation, at the same temperature (scaling attention factor) as the patch tokens
        cos, sin = pad(self.cos, self.temperature), pad(self.sin, 0.0)
        return Rotary(cos, sin, self.layout, pad(self.q_scale, 1.0), pad(self.k_scale, 1.0), self.temperature)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """positions [..., N] x inv_freq [F] -> angles [..., N, F] in fp32."""
    return positions.float()[..., None] * inv_freq.to(positions.device)


@register("rope", ndim=1, kind="rotary", trainable=False, relative=True, context=("dim",), scalable=True,
    summary="rotary, rotate-half or interleaved layout",
    extrapolation="poor unscaled; linear/ntk/dynamic_ntk/yarn/longrope/llama3 scaling",
    reference="Su et al. 2021 (RoFormer)")
class Rope(nn.Module):
    """1D RoPE (Su et al. 2021) with optional scaling for sequences longer than training.

    ``scaling`` is read-only; switch it with ``set_scaling`` or, on a whole model, ``vispos.configure``.
    """

    def __init__(
        self,
        *,
        dim: int,
        theta: float = 10000.0,
        layout: str = "half",
        scaling: RopeScaling | dict | str | None = None,
    ) -> None:
        super().__init__()
        self.dim = check_dim(dim, 2, "rope")
        self.theta = check_float("theta", theta, positive=True)
        self.layout = check_choice("layout", layout, LAYOUTS)
        self._scaling: RopeScaling | None = None
        self.set_scaling(scaling)

    @property
    def scaling(self) -> RopeScaling | None:
        """RoPE scaling in use (None: plain RoPE)."""
        return self._scaling

    def set_scaling(self, scaling: RopeScaling | dict | str | None, **options: object) -> None:
        """Switch scaling (e.g. for evaluation beyond the training length) or off (``None``).

        ``scaling``: a ``RopeScaling``, a type name with its fields as keywords, or a dict of fields.
        """
        scaling = as_scaling(scaling, **options)
        check_scaling_dim(scaling, self.dim)
        self._scaling = scaling

    def get_extra_state(self) -> dict[str, object]:
        """The scaling in use travels with the weights (plain data, loadable with ``weights_only=True``)."""
        return {"scaling": None if self.scaling is None else asdict(self.scaling)}

    def set_extra_state(self, state: dict[str, object]) -> None:
        self.set_scaling(state["scaling"])

    def inv_freq(self, length: int) -> tuple[torch.Tensor, float]:
        return scaled_inv_freq(self.dim, self.theta, self.scaling, length)

    def forward(self, positions: torch.Tensor | int) -> Rotary:
        """positions: length or integer positions [N] / [B, N] -> Rotary with cos/sin [(B,) N, dim]."""
        positions = check_positions(positions)
        length = int(positions.max()) + 1 if self.scaling is not None else positions.shape[-1]
        inv_freq, temperature = self.inv_freq(length)
        angles = expand_angles(rope_angles(positions, inv_freq), self.layout)
        if positions.dim() == 2:
            angles = angles[:, None]  # [B, 1, N, d]: broadcast over heads
        return Rotary(angles.cos() * temperature, angles.sin() * temperature, self.layout, temperature=temperature)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, theta={self.theta}, layout={self.layout!r}, scaling={self.scaling}"


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
) -> torch.Tensor:
    """Patch coordinates [H*W, 2] as (y, x), row-major, fp32.

    ``pixel``: integer indices + ``offset``; with ``ref_grid`` every grid is stretched onto the reference
    grid (index * ref / size per axis, EVA-02's rule). ``normalized`` (DINOv3): patch centres + ``offset``,
    divided per axis by its own size (``separate``) or by the smaller / larger side (``min`` / ``max``),
    mapped from [0, 1] to [-1, 1].
    """
    h, w = grid
    ys = torch.arange(h, device=device, dtype=torch.float32) + offset
    xs = torch.arange(w, device=device, dtype=torch.float32) + offset
    if coords == "pixel":
        if ref_grid is not None:
            ys, xs = ys / h * ref_grid[0], xs / w * ref_grid[1]
    else:
        den_h, den_w = {"separate": (h, w), "min": (min(h, w),) * 2, "max": (max(h, w),) * 2}[normalize]
        ys, xs = (ys + 0.5) / den_h * 2 - 1, (xs + 0.5) / den_w * 2 - 1
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack((yy.flatten(), xx.flatten()), dim=-1)


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


def period_inv_freq(dim: int, min_period: float, max_period: float) -> torch.Tensor:
    """DINOv3's alternative parametrisation: periods spaced geometrically from min to max, [dim // 2]."""
    periods = min_period * (max_period / min_period) ** torch.linspace(0, 1, dim // 2, dtype=torch.float32)
    return 1.0 / periods


@register("rope2d", ndim=2, kind="rotary", trainable=False, relative=True, context=("dim", "train_grid"),
    scalable=True, summary="axial 2D RoPE: half the rotary pairs turn with x, half with y",
    extrapolation="unseen angles at pixel coords; linear/ntk/yarn scaling per axis; normalized coords",
    reference="Heo et al. 2024 (RoPE-ViT); Simeoni et al. 2025 (DINOv3)")
class Rope2d(nn.Module):
    """Axial 2D RoPE: half the rotary pairs turn with one axis, half with the other (RoPE-ViT's RoPE-Axial).

    Conventions, so that every published variant is a setting (``vispos.patch`` sets them from a timm
    model's own RoPE):

    - ``axes``: which axis takes the first half of the pairs: ``xy`` (RoPE-ViT, PE) or ``yx`` (EVA-02,
      DINOv3, timm's ``vit_*_rope_reg*``).
    - ``layout``: ``half`` (DINOv3) or ``interleaved`` (RoPE-ViT, EVA-02, PE) rotary pairs.
    - ``coords``: ``pixel`` (integer indices + ``offset``; ``ref_grid`` stretches every grid onto a
      reference grid, EVA-02) or ``normalized`` (DINOv3: patch centres in [-1, 1] per axis, see
      ``normalize``; angles are 2 pi x coordinate / period).
    - frequencies: theta ** (-4j / dim) per axis (``theta``), or periods spaced geometrically from
      ``min_period`` to ``max_period`` (DINOv3's alternative; both or neither).
    - ``shift_coords``, ``jitter_coords``, ``rescale_coords``: DINOv3's coordinate augmentation
      (``CoordAugment``), drawn once per forward in training mode only. DINOv3 trains with
      ``coords="normalized", rescale_coords=2.0``.

    With pixel coordinates a larger grid reaches angles never seen in training; ``scaling`` +
    ``train_grid`` then stretch each axis by its own factor (current / training size). Normalized
    coordinates sample the same angle range more densely instead.
    """

    def __init__(
        self,
        *,
        dim: int,
        theta: float = 100.0,
        coords: str = "pixel",
        layout: str = "half",
        axes: str = "xy",
        offset: float = 0.0,
        normalize: str = "separate",
        ref_grid: tuple[int, int] | None = None,
        min_period: float | None = None,
        max_period: float | None = None,
        shift_coords: float | None = None,
        jitter_coords: float | None = None,
        rescale_coords: float | None = None,
        scaling: RopeScaling | dict | str | None = None,
        train_grid: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.dim = check_dim(dim, 4, "rope2d")
        self.theta = check_float("theta", theta, positive=True)
        self.coords = check_choice("coords", coords, COORDS)
        self.layout = check_choice("layout", layout, LAYOUTS)
        self.axes = check_choice("axes", axes, AXES)
        self.offset = check_float("offset", offset)
        self.normalize = check_choice("normalize", normalize, NORMALIZE)
        self.ref_grid = None if ref_grid is None else check_grid(ref_grid, "ref_grid")
        if self.ref_grid is not None and self.coords != "pixel":
            raise ValueError("ref_grid applies to coords='pixel'; normalized coordinates already span [-1, 1]")
        if (min_period is None) != (max_period is None):
            raise ValueError("give both min_period and max_period (DINOv3's periods), or neither (theta)")
        self.periods = None
        if min_period is not None:
            lo = check_float("min_period", min_period, positive=True)
            hi = check_float("max_period", max_period, positive=True)
            if hi < lo:
                raise ValueError(f"max_period must be >= min_period, got {hi} < {lo}")
            self.periods = (lo, hi)
        self.augment = CoordAugment(shift_coords, jitter_coords, rescale_coords)
        self.train_grid: tuple[int, int] | None = None
        self.scaling_y: RopeScaling | None = None
        self.scaling_x: RopeScaling | None = None
        self.set_scaling(scaling, train_grid=train_grid)

    def set_scaling(
        self, scaling: RopeScaling | dict | str | None, *, train_grid: tuple[int, int] | None = None, **options: object
    ) -> None:
        """Switch per-axis scaling (e.g. for evaluation above ``train_grid``) or off (``None``).

        ``scaling`` as for ``Rope.set_scaling``. Each axis gets ``original_length`` = its training size;
        without ``factor`` the factor follows the grid: max(1, H / H0) for y and max(1, W / W0) for x.
        """
        train_grid = self.train_grid if train_grid is None else check_grid(train_grid, "train_grid")
        if scaling is not None:
            if self.coords != "pixel":
                raise ValueError("RoPE scaling applies to coords='pixel'; normalized coordinates never leave [-1, 1]")
            if self.ref_grid is not None:
                raise ValueError("RoPE scaling does not combine with ref_grid, which already rescales every grid")
            if self.periods is not None:
                raise ValueError("RoPE scaling is defined on theta's frequencies, not on min_period / max_period")
            if train_grid is None:
                raise ValueError("rope2d scaling needs train_grid=(H, W), the grid it was trained on")
        h0, w0 = train_grid if train_grid is not None else (None, None)
        scaling = as_scaling(scaling, original_length=h0, **options)
        check_scaling_dim(scaling, self.dim // 2)  # per axis
        self.train_grid = train_grid
        self.scaling_y = None if scaling is None else replace(scaling, original_length=h0)
        self.scaling_x = None if scaling is None else replace(scaling, original_length=w0)

    def get_extra_state(self) -> dict[str, object]:
        """Training grid and scaling travel with the weights (plain data, loadable with ``weights_only=True``)."""
        grid = None if self.train_grid is None else list(self.train_grid)
        return {"train_grid": grid, "scaling": None if self.scaling_y is None else asdict(self.scaling_y)}

    def set_extra_state(self, state: dict[str, object]) -> None:
        grid = state["train_grid"]
        self.set_scaling(state["scaling"], train_grid=None if grid is None else tuple(grid))

    def inv_freq(self, scaling: RopeScaling | None, length: int) -> tuple[torch.Tensor, float]:
        """One axis's inverse frequencies [dim / 4] and attention factor at ``length`` tokens on that axis."""
        if self.periods is not None:
            return period_inv_freq(self.dim // 2, *self.periods), 1.0
        return scaled_inv_freq(self.dim // 2, self.theta, scaling, length)

    def coordinates(self, grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
        """Coordinates [H*W, 2] in ``axes`` order, augmented in training mode."""
        yx = grid_coords(
            grid, self.coords, device, offset=self.offset, normalize=self.normalize, ref_grid=self.ref_grid
        )
        first_second = yx if self.axes == "yx" else yx.flip(-1)
        if self.training and self.augment.active:
            first_second = self.augment(first_second)
        return first_second * (2 * math.pi) if self.coords == "normalized" else first_second

    def angles(self, grid: tuple[int, int], device: torch.device | None = None) -> tuple[torch.Tensor, float]:
        """Per-pair angles [H*W, dim/2] (the first axis's pairs, then the second's) and the attention factor."""
        h, w = check_grid(grid)
        inv_y, att_y = self.inv_freq(self.scaling_y, h)
        inv_x, att_x = self.inv_freq(self.scaling_x, w)
        first, second = (inv_y, inv_x) if self.axes == "yx" else (inv_x, inv_y)
        c = self.coordinates((h, w), device)
        angles = torch.cat((rope_angles(c[:, 0], first), rope_angles(c[:, 1], second)), dim=-1)
        return angles, math.sqrt(att_y * att_x)

    def forward(self, grid: tuple[int, int], device: torch.device | None = None) -> Rotary:
        angles, temperature = self.angles(grid, device)
        angles = expand_angles(angles, self.layout)  # [HW, dim]
        return Rotary(angles.cos() * temperature, angles.sin() * temperature, self.layout, temperature=temperature)

    def extra_repr(self) -> str:
        return describe_options(self, ROPE2D_DEFAULTS)


@register("rope2d_mixed", ndim=2, kind="rotary", trainable=True, relative=True, context=("dim", "num_heads"),
    per_layer=True, summary="RoPE-Mixed: learnable per-layer, per-head 2D frequencies",
    extrapolation="best of the RoPE-ViT schemes above training size", reference="Heo et al. 2024 (RoPE-ViT)")
class Rope2dMixed(nn.Module):
    """RoPE-Mixed (Heo et al. 2024): learnable 2D frequency vectors per head (one module per layer).

    Pair j of head h turns by x * fx[h, j] + y * fy[h, j]. Initialised like rope-vit: axial magnitudes
    theta ** (-4j / dim) along a random direction per head; with ``rotate=False`` the start is exactly
    axial RoPE. The angles are computed in fp32 whatever the parameters' dtype; train under autocast
    (parameters stay fp32) rather than on a ``.half()`` model, which rounds ``freqs`` like every weight.
    ``shift_coords`` / ``jitter_coords`` / ``rescale_coords`` as for ``rope2d`` (drawn per layer).
    """

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        theta: float = 10.0,
        layout: str = "half",
        coords: str = "pixel",
        offset: float = 0.0,
        rotate: bool = True,
        shift_coords: float | None = None,
        jitter_coords: float | None = None,
        rescale_coords: float | None = None,
    ) -> None:
        super().__init__()
        self.dim = check_dim(dim, 4, "rope2d_mixed")
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.theta = check_float("theta", theta, positive=True)
        self.layout = check_choice("layout", layout, LAYOUTS)
        self.coords = check_choice("coords", coords, COORDS)
        self.offset = check_float("offset", offset)
        self.rotate = check_bool("rotate", rotate)
        self.augment = CoordAugment(shift_coords, jitter_coords, rescale_coords)
        self.freqs = nn.Parameter(self.init_freqs(self.dim, self.num_heads, self.theta, rotate=rotate))

    @staticmethod
    def init_freqs(dim: int, num_heads: int, theta: float, *, rotate: bool = True) -> torch.Tensor:
        """[2 (x, y), heads, dim/2] frequency components."""
        mag = rope_inv_freq(dim // 2, theta)  # [d/4]
        phase = torch.rand(num_heads, 1) * 2 * math.pi if rotate else torch.zeros(num_heads, 1)
        # x pairs point along phase, y pairs along phase + pi/2 (written so that phase 0 is exactly axial)
        fx = torch.cat((mag * torch.cos(phase), -mag * torch.sin(phase)), dim=-1)
        fy = torch.cat((mag * torch.sin(phase), mag * torch.cos(phase)), dim=-1)
        return torch.stack((fx, fy))

    def angles(self, grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
        """Per-pair angles [heads, H*W, dim/2]."""
        yx = grid_coords(check_grid(grid), self.coords, device or self.freqs.device, offset=self.offset)
        xy = yx.flip(-1)
        if self.training and self.augment.active:
            xy = self.augment(xy)
        if self.coords == "normalized":
            xy = xy * (2 * math.pi)
        freqs = self.freqs.float()
        return xy[:, 0, None] * freqs[0][:, None] + xy[:, 1, None] * freqs[1][:, None]

    def forward(self, grid: tuple[int, int], device: torch.device | None = None) -> Rotary:
        angles = expand_angles(self.angles(grid, device), self.layout)  # [heads, HW, dim]
        return Rotary(angles.cos(), angles.sin(), self.layout)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, " + describe_options(self, MIXED_DEFAULTS)


ROPE2D_DEFAULTS: dict[str, object] = {"theta": 100.0, "coords": "pixel", "layout": "half", "axes": "xy",
    "offset": 0.0, "normalize": "separate", "ref_grid": None, "periods": None}  # fmt: skip
MIXED_DEFAULTS: dict[str, object] = {"theta": 10.0, "coords": "pixel", "layout": "half", "offset": 0.0}


def describe_options(module: nn.Module, defaults: dict[str, object]) -> str:
    """``theta=100.0, layout='interleaved', ...``: theta and layout always, other conventions where they
    differ from the default, then the coordinate augmentation and scaling when set."""
    parts = [f"dim={module.dim}"] if isinstance(module, Rope2d) else []
    for name, default in defaults.items():
        value = getattr(module, name)
        if name in ("theta", "layout") or value != default:
            parts.append(f"{name}={value!r}")
    if module.augment.active:
        parts.append(f"augment={module.augment}")
    scaling = getattr(module, "scaling_y", None)
    if scaling is not None:
        parts.append(f"scaling={scaling.type!r}")
    return ", ".join(parts)
