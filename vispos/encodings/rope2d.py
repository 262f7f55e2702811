"""2D rotary position embedding: axial ``rope2d`` (RoPE-ViT, EVA-02, DINOv3, PE conventions as options)
and ``rope2d_mixed`` (RoPE-Mixed), with DINOv3's training-time coordinate augmentation.

The rotation maths (layouts, ``Rotary``) is shared with 1D RoPE in ``rope.py``; the patch coordinates and their
augmentation are in ``coords2d.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, replace

import torch
from torch import nn

from .._state import decode, encode
from .._validate import check_bool, check_choice, check_dim, check_float, check_grid, check_int
from ..registry import register
from .coords2d import AXES, COORDS, NORMALIZE, CoordAugment, frame_coords, grid_coords, normalized_denominators
from .dype import SCHEDULED_TYPES, TimestepSchedule, angle_dtype, as_schedule, axis_inv_freq
from .rope import LAYOUTS, Rotary, expand_angles, rope_angles, saved_scaling
from .rope_scaling import RopeScaling, as_scaling, check_scaling_dim, rope_inv_freq, scaled_inv_freq

BANDS = ("shared", "alternate")  # both axes on the same frequencies, or alternate ones of one RoPE (Pixtral)

# RoPE-Mixed evaluates all layers in one product up to this many elements per cos / sin tensor (8 MiB in fp32:
# ViT-S and ViT-B at 224 px stack; larger grids take one layer's rotation at a time, so that a forward holds one
# layer's tables, not depth x them with the angles and prefixed copies beside)
STACK_LIMIT = 2**21


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
      ``min_period`` to ``max_period`` (DINOv3's alternative; both or neither). ``bands="alternate"``
      (Pixtral): the axes share out one RoPE over the whole head, theta ** (-2i / dim), the first axis taking
      its even i (theta ** (-4j / dim)), the second its odd i (theta ** (-(4j + 2) / dim)); a scaling then
      acts on that RoPE (per axis, at the axis's size).
    - ``shift_coords``, ``jitter_coords``, ``rescale_coords``: DINOv3's coordinate augmentation
      (``CoordAugment``), drawn once per forward in training mode only. DINOv3 trains with
      ``coords="normalized", rescale_coords=2.0``.

    With pixel coordinates a larger grid reaches angles never seen in training; ``scaling`` +
    ``train_grid`` then stretch each axis by its own factor (current / training size). Normalized
    coordinates sample the same angle range more densely instead: position interpolation by construction.
    A scaling on them first stretches each axis of a grid larger than training by size / training size (so
    that it reaches past [-1, 1] at the training spacing), then scales from there: ``linear`` gives back
    DINOv3's own attention at every size, ``ntk`` and ``yarn`` keep the fast pairs at the spacing they were
    trained at, with rotations counted over the training image (``span``).
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
        bands: str = "shared",
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
        self.bands = check_choice("bands", bands, BANDS)
        if (min_period is None) != (max_period is None):
            raise ValueError("give both min_period and max_period (DINOv3's periods), or neither (theta)")
        if min_period is not None and self.bands != "shared":
            raise ValueError("bands='alternate' shares out theta's frequencies; min_period / max_period give their own")
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
        # DyPE's timestep schedule: only inside a diffusion transformer, whose forward gives each step's noise level
        # ``sigma`` (vispos.diffusers sets ``timestep_aware`` at patch time and ``sigma`` per forward)
        self.timestep_aware = False
        self.schedule: TimestepSchedule | None = None
        self.sigma: torch.Tensor | None = None
        self.set_scaling(scaling, train_grid=train_grid)

    def set_scaling(
        self,
        scaling: RopeScaling | dict | str | None,
        *,
        train_grid: tuple[int, int] | None = None,
        schedule: TimestepSchedule | str | dict | None = None,
        **options: object,
    ) -> None:
        """Switch per-axis scaling (e.g. for evaluation above ``train_grid``) or off (``None``).

        ``scaling`` as for ``Rope.set_scaling``. Each axis gets ``original_length`` = its training size;
        without ``factor`` the factor follows the grid: max(1, H / H0) for y and max(1, W / W0) for x.
        ``schedule="dype"`` (``ntk`` or ``yarn``; pixel coordinates, shared bands): the strength follows the
        denoising timestep (DyPE, ``encodings/dype.py``), for a rope2d inside a diffusion transformer only.
        """
        plan = as_schedule(schedule)
        if plan is not None:
            self._check_schedule(plan, scaling)
        train_grid = self.train_grid if train_grid is None else check_grid(train_grid, "train_grid")
        if scaling is not None:
            if self.ref_grid is not None:
                raise ValueError("RoPE scaling does not combine with ref_grid, which already rescales every grid")
            if self.periods is not None:
                raise ValueError("RoPE scaling is defined on theta's frequencies, not on min_period / max_period")
            if train_grid is None:
                raise ValueError("rope2d scaling needs train_grid=(H, W), the grid it was trained on")
            if "original_length" in options:
                raise ValueError("rope2d reads each axis's original length from train_grid=(H, W), not original_length")
        h0, w0 = train_grid if train_grid is not None else (None, None)
        scaling = as_scaling(scaling, original_length=h0, **options)
        check_scaling_dim(scaling, self.dim // 2 if self.bands == "shared" else self.dim)  # per axis, or the head
        self.train_grid = train_grid
        self.scaling_y = None if scaling is None else replace(scaling, original_length=h0)
        self.scaling_x = None if scaling is None else replace(scaling, original_length=w0)
        self.schedule = plan

    def _check_schedule(self, plan: TimestepSchedule, scaling: object) -> None:
        if not self.timestep_aware:
            raise ValueError(
                f"schedule={plan.type!r} follows a diffusion model's denoising timestep: it applies to rope2d inside "
                "a diffusion transformer (vispos.patch(transformer, 'rope2d', inherit=False)), whose forward gives "
                "the noise level; this rope2d has none"
            )
        kind = scaling.get("type") if isinstance(scaling, dict) else getattr(scaling, "type", scaling)
        if kind not in SCHEDULED_TYPES:
            raise ValueError(f"schedule={plan.type!r} schedules {' or '.join(SCHEDULED_TYPES)} scaling (DyPE defines "
                             f"no other); got {kind!r}")  # fmt: skip
        if self.coords != "pixel" or self.bands != "shared" or self.periods is not None:
            raise ValueError(f"schedule={plan.type!r} is defined on theta's frequencies at pixel coordinates with "
                             "shared bands (DyPE's axial RoPE)")  # fmt: skip

    def set_train_grid(self, train_grid: tuple[int, int]) -> None:
        """Make the scaling in use (if any) relative to ``train_grid``: each axis's original length becomes its
        size there. A patched model calls it so that its RoPE scaling follows the model's one training grid
        (``Positions.scaling_grid``), also after loading a checkpoint made at another grid."""
        self.train_grid = check_grid(train_grid, "train_grid")
        h0, w0 = self.train_grid
        if self.scaling_y is not None:
            self.scaling_y = replace(self.scaling_y, original_length=h0)
            self.scaling_x = replace(self.scaling_x, original_length=w0)

    def get_extra_state(self) -> torch.Tensor:
        """The scaling in use, its timestep schedule and the grid it is relative to travel with the weights (a
        tensor record)."""
        if self.scaling_y is None:
            return encode({"scaling": None, "train_grid": None})
        said = {"scaling": asdict(self.scaling_y), "train_grid": list(self.train_grid)}
        if self.schedule is not None:
            said["schedule"] = asdict(self.schedule)
        return encode(said)

    def set_extra_state(self, state: torch.Tensor | dict[str, object]) -> None:
        state = decode(state)
        if state["scaling"] is None:  # nothing to restore: the module keeps its own training grid
            self.set_scaling(None)
            return
        self.set_scaling(saved_scaling(state["scaling"]), train_grid=tuple(state["train_grid"]),
                         schedule=state.get("schedule"))  # fmt: skip

    def inv_freq(self, scaling: RopeScaling | None, length: int, axis: int = 0) -> tuple[torch.Tensor, float]:
        """One axis's (``axis``: 0 for y, 1 for x) inverse frequencies [dim / 4] and attention factor at ``length``
        tokens on that axis."""
        if self.periods is not None:
            return period_inv_freq(self.dim // 2, *self.periods), 1.0
        if self.schedule is not None and scaling is not None:
            return self.scheduled_inv_freq(scaling, length)
        span = self.span(scaling, axis)
        if self.bands == "shared":
            return scaled_inv_freq(self.dim // 2, self.theta, scaling, length, span=span)
        whole, factor = scaled_inv_freq(self.dim, self.theta, scaling, length, span=span)  # [dim / 2]: the head's
        first = (axis == 0) == (self.axes == "yx")  # this axis takes the first half of the pairs
        return whole[0::2] if first else whole[1::2], factor

    def scheduled_inv_freq(self, scaling: RopeScaling, length: int) -> tuple[torch.Tensor, float]:
        """One axis's inverse frequencies (on the noise level's device: nothing is read back) and attention factor
        under DyPE's schedule at this forward's noise level. The factor does not follow the noise level (YaRN's
        0.1 ln s + 1 at every step, as ``dype.axis_inv_freq`` gives it; 1 for NTK), so it stays a Python number."""
        if self.sigma is None:
            raise ValueError(
                "rope2d under DyPE's schedule needs the noise level of the forward, which the diffusion "
                "transformer's forward sets from its timestep; call the transformer, not its attention alone"
            )
        ratio = length / scaling.original_length if scaling.factor is None else float(scaling.factor)  # type: ignore[operator]
        s = torch.tensor(ratio, dtype=angle_dtype(self.sigma.device), device=self.sigma.device)
        inv, _ = axis_inv_freq(self.dim // 2, self.theta, scaling, s, schedule=self.schedule, sigma=self.sigma)
        if scaling.attention_factor is not None:
            factor = float(scaling.attention_factor)
        else:
            factor = 0.1 * math.log(max(1.0, ratio)) + 1.0 if scaling.type == "yarn" else 1.0
        return inv.float(), factor

    def span(self, scaling: RopeScaling | None, axis: int) -> float | None:
        """The coordinate extent of the training grid along ``axis``, where YaRN and Llama 3 count rotations:
        its size for pixel coordinates (None: the scaling's original length), 2 pi x 2 x size / denominator for
        normalized ones (4 pi with ``normalize="separate"``: [-1, 1] whatever the size)."""
        if scaling is None or self.coords == "pixel":
            return None
        size = self.train_grid[axis]  # type: ignore[index]
        return 4 * math.pi * size / normalized_denominators(self.train_grid, self.normalize)[axis]  # type: ignore[arg-type]

    def frame(self, grid: tuple[int, int]) -> tuple[float, float] | None:
        """What normalized coordinates at ``grid`` are multiplied by while a scaling is set: per axis max(1, size /
        training size), so that a larger grid reaches past [-1, 1] at the training spacing (the frame the
        scaling then maps back; at or below the training size nothing changes). None: DINOv3's own frame."""
        if self.coords != "normalized" or self.scaling_y is None:
            return None
        return tuple(max(1.0, n / n0) for n, n0 in zip(grid, self.train_grid, strict=True))  # type: ignore[return-value,arg-type]

    def coordinates(
        self, grid: tuple[int, int], device: torch.device | None = None, cells: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Coordinates [H*W, 2] (or of ``cells`` [M, 2]) in ``axes`` order, augmented in training mode."""
        yx = grid_coords(
            grid, self.coords, device, offset=self.offset, normalize=self.normalize, ref_grid=self.ref_grid,
            cells=cells,
        )  # fmt: skip
        if (stretch := self.frame(grid)) is not None:
            yx = yx * yx.new_tensor(stretch)  # [N, 2] (y, x): the training spacing beyond the training size
        return frame_coords(yx, self.axes, self.augment, self.training, self.coords == "normalized")

    def angles(
        self, grid: tuple[int, int], device: torch.device | None = None, cells: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, float]:
        """Per-pair angles [H*W or M, dim/2] (the first axis's pairs, then the second's) and the attention
        factor; ``grid`` sets the frequencies (scaling) and the coordinate frame, ``cells`` the points."""
        h, w = check_grid(grid)
        inv_y, att_y = self.inv_freq(self.scaling_y, h, 0)
        inv_x, att_x = self.inv_freq(self.scaling_x, w, 1)
        first, second = (inv_y, inv_x) if self.axes == "yx" else (inv_x, inv_y)
        c = self.coordinates((h, w), device, cells)
        angles = torch.cat((rope_angles(c[:, 0], first), rope_angles(c[:, 1], second)), dim=-1)
        return angles, math.sqrt(att_y * att_x)

    def forward(
        self, grid: tuple[int, int], device: torch.device | None = None, *, cells: torch.Tensor | None = None
    ) -> Rotary:
        """The rotations of the H*W patches of ``grid``, or of the points ``cells`` [M, 2] ((y, x), possibly
        fractional) of an image whose grid is ``grid``."""
        angles, temperature = self.angles(grid, device, cells)
        angles = expand_angles(angles, self.layout)  # [HW or M, dim]
        return Rotary(angles.cos() * temperature, angles.sin() * temperature, self.layout, temperature=temperature)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, " + describe_options(self, ROPE2D_DEFAULTS)


@register("rope2d_mixed", ndim=2, kind="rotary", trainable=True, relative=True, context=("dim", "num_heads"),
    per_layer=True, summary="RoPE-Mixed: learnable per-layer, per-head 2D frequencies",
    extrapolation="unseen angles at pixel coords; best above training size in RoPE-ViT (ImageNet), "
    "below learned2d at 2x on Fashion-MNIST (docs/fmnist_native, docs/fmnist_full)",
    reference="Heo et al. 2024 (RoPE-ViT)")
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

    def angles(
        self, grid: tuple[int, int], device: torch.device | None = None, cells: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-pair angles [heads, H*W or M, dim/2]."""
        yx = grid_coords(check_grid(grid), self.coords, device or self.freqs.device, offset=self.offset, cells=cells)
        xy = frame_coords(yx, "xy", self.augment, self.training, self.coords == "normalized")
        freqs = self.freqs.float()
        return xy[:, 0, None] * freqs[0][:, None] + xy[:, 1, None] * freqs[1][:, None]

    def forward(
        self, grid: tuple[int, int], device: torch.device | None = None, *, cells: torch.Tensor | None = None
    ) -> Rotary:
        """The rotations of the patches of ``grid``, or of the points ``cells`` [M, 2] (as ``Rope2d``)."""
        angles = expand_angles(self.angles(grid, device, cells), self.layout)  # [heads, HW or M, dim]
        return Rotary(angles.cos(), angles.sin(), self.layout)

    @staticmethod
    def stacked(layers: Sequence[Rope2dMixed], grid: tuple[int, int], device: torch.device) -> Rotary | None:
        """Every layer's rotation at once, cos/sin [layers, heads, H*W, dim]: one product of the coordinates with
        all layers' frequencies, one cos and one sin, instead of a dozen small kernels per layer (timm's
        RoPE-Mixed batches its layers the same way). The same elementwise maths as ``forward``, so each slice
        equals that layer's ``forward`` bit for bit. None where a layer must be evaluated on its own: coordinate
        augmentation in training (each layer draws its own frame), frequencies offloaded (accelerate's hooks
        bring a layer's in around its own call only), or a grid whose stacked tensors would pass
        ``STACK_LIMIT`` elements (there the kernels are large and one layer's rotation at a time keeps memory
        at one layer's)."""
        first = layers[0]
        heads, tokens = first.num_heads, grid[0] * grid[1]
        if len(layers) * heads * tokens * first.dim > STACK_LIMIT:
            return None
        if first.training and any(layer.augment.active for layer in layers):
            return None
        if any(layer.freqs.is_meta for layer in layers):  # offloaded: each layer's call brings its own in
            return None
        yx = grid_coords(check_grid(grid), first.coords, device, offset=first.offset)
        xy = frame_coords(yx, "xy", first.augment, False, first.coords == "normalized")  # [HW, 2]
        freqs = torch.stack([layer.freqs for layer in layers]).float()[..., None, :]  # [L, 2, heads, 1, d/2]
        angles = xy[:, 0, None] * freqs[:, 0] + xy[:, 1, None] * freqs[:, 1]  # [L, heads, HW, d/2]
        angles = expand_angles(angles, first.layout)
        return Rotary(angles.cos(), angles.sin(), first.layout)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, " + describe_options(self, MIXED_DEFAULTS)


ROPE2D_DEFAULTS: dict[str, object] = {"theta": 100.0, "coords": "pixel", "layout": "half", "axes": "xy",
    "offset": 0.0, "normalize": "separate", "ref_grid": None, "bands": "shared", "periods": None}  # fmt: skip
MIXED_DEFAULTS: dict[str, object] = {"theta": 10.0, "coords": "pixel", "layout": "half", "offset": 0.0}


def describe_options(module: nn.Module, defaults: dict[str, object]) -> str:
    """``theta=100.0, layout='interleaved', ...``: theta and layout always, other conventions where they
    differ from the default, then the coordinate augmentation and scaling when set."""
    parts = []
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
