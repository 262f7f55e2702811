"""A diffusion transformer's own axial RoPE over position ids, recomputed by vispos (``AxisRope``), with per-axis
scaling of its two image axes, DyPE's timestep schedule and log-n attention.

The rotation is ``ropend``'s (``encodings/ropend.py``: one contiguous channel section per id axis, ``axes_dim``,
pair j of a section of d channels turning at theta ** (-2j / d)); the scaling maths is ``encodings/dype.py``. What
the families differ in (interleaved cos / sin pairs for FLUX, complex numbers for Qwen-Image and Lumina 2, which
ids) stays in ``modules.py``. Attention factors: each scaled axis's factor (YaRN's 0.1 ln s + 1) multiplies the
channels of its own section, as the DyPE authors' code applies it per axis; log-n attention's logit scale
max(1, ln N / ln N_train) (N: image tokens) multiplies every logit, as sqrt(scale) on every channel of q and k.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from typing import Any

import torch
from torch import nn

from .._state import decode, encode
from .._validate import check_grid
from ..encodings.dype import SCHEDULED_TYPES, TENSOR_TYPES, TimestepSchedule, angle_dtype, as_schedule, axis_inv_freq
from ..encodings.rope import saved_scaling
from ..encodings.rope_scaling import RopeScaling, as_scaling
from ..registry import SchemeInfo


class AxisRope(nn.Module):
    """RoPE over ids [..., S, A]: ``axes_dim`` channels per axis, ``theta``; ``spatial``: the (y, x) axes a scaling
    stretches, each by max(1, extent / training size) (``set_scaling``)."""

    def __init__(self, *, axes_dim: tuple[int, ...], theta: float, spatial: tuple[int, int],
                 train_grid: tuple[int, int], source: str) -> None:  # fmt: skip
        super().__init__()
        self.axes_dim = tuple(int(d) for d in axes_dim)
        self.theta = float(theta)
        self.spatial = spatial
        self.source = source
        self.scaling: RopeScaling | None = None
        self.schedule: TimestepSchedule | None = None
        self.released_grid = check_grid(train_grid, "train_grid")  # the family's checkpoints' (tokens)
        self.set_train_grid(train_grid)
        self.sigma: torch.Tensor | None = None  # the noise level of the forward in progress (set by the transformer)
        self.extent: torch.Tensor | None = None  # its image grid (y, x), where the ids alone do not say it (FLUX.2)
        self.log_n_tokens: int | None = None  # the training token count while log-n attention is on (Positions')

    def set_scaling(self, scaling: RopeScaling | dict | str | None, *, train_grid: tuple[int, int] | None = None,
                    schedule: TimestepSchedule | str | dict | None = None, **options: Any) -> None:  # fmt: skip
        """Per-axis ``linear``, ``ntk`` or ``yarn`` (``RopeScaling`` fields as keywords), relative to ``train_grid``;
        ``schedule="dype"`` makes its strength follow the denoising timestep (ntk and yarn). None: off."""
        if "original_length" in options:
            raise ValueError("the training size of each axis comes from train_grid=(H, W), not original_length")
        grid = self.train_grid if train_grid is None else self.token_grid(train_grid)
        read = as_scaling(scaling, original_length=grid[0], **options)
        plan = as_schedule(schedule)
        if read is not None and read.type not in TENSOR_TYPES:
            raise ValueError(f"{read.type!r} scaling: a diffusers transformer takes {', '.join(TENSOR_TYPES)}")
        if plan is not None and (read is None or read.type not in SCHEDULED_TYPES):
            got = "no scaling" if read is None else f"{read.type!r} scaling"
            raise ValueError(f"schedule={plan.type!r} schedules {' or '.join(SCHEDULED_TYPES)} scaling (DyPE defines "
                             f"no other); got {got}")  # fmt: skip
        self.scaling, self.schedule = read, plan
        self.set_train_grid(grid)

    def token_grid(self, train_grid: tuple[int, int]) -> tuple[int, int]:
        """``train_grid`` checked as a grid of latent tokens: one more than 8 times the family's released checkpoints'
        on a side (FLUX: 64 x 64 tokens at 1024 px) is a size in pixels given for tokens, refused."""
        grid = check_grid(train_grid, "train_grid")
        if max(grid) > 8 * max(self.released_grid):
            h, w = self.released_grid
            raise ValueError(
                f"train_grid={grid} counts latent tokens, not pixels: this transformer's released checkpoints train "
                f"at {h} x {w} tokens (FLUX: 64 x 64 at 1024 px, 16 px per token); give the training grid in tokens, "
                f"e.g. train_grid=({grid[0] // 16}, {grid[1] // 16}) for {grid[0]} x {grid[1]} px"
            )
        return grid

    def set_train_grid(self, train_grid: tuple[int, int]) -> None:
        """Make the scaling relative to ``train_grid``: each scaled axis's original length is its size there."""
        self.train_grid = self.token_grid(train_grid)
        self.axis_scalings = tuple(  # made here, not in forward: a compiled forward builds no dataclass
            None if self.scaling is None or axis not in self.spatial
            else replace(self.scaling, original_length=self.train_grid[self.spatial.index(axis)])
            for axis in range(len(self.axes_dim))
        )  # fmt: skip

    def get_extra_state(self) -> torch.Tensor:
        return encode({"scaling": None if self.scaling is None else asdict(self.scaling),
                       "schedule": None if self.schedule is None else asdict(self.schedule),
                       "train_grid": list(self.train_grid)})  # fmt: skip

    def set_extra_state(self, state: torch.Tensor | dict[str, Any]) -> None:
        state = decode(state)
        scaling = saved_scaling(state["scaling"])  # its original length comes from the training grid
        if scaling is not None:
            scaling.pop("original_length", None)
        self.set_scaling(scaling, train_grid=tuple(state["train_grid"]), schedule=state["schedule"])

    def pairs(self, ids: torch.Tensor, extent: torch.Tensor | None = None, *,
              scaled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """ids [..., S, A] -> (angles [..., S, sum(axes_dim) / 2], magnitude per pair [sum / 2]), float64 (float32 on
        MPS and NPU: ``angle_dtype``).
        ``extent`` [2]: the image grid (y, x) the scaling and log-n follow (default: the ids' own extent).
        ``scaled=False``: the model's own frequencies with magnitude 1 whatever is configured (Qwen-Image's text rows,
        as the DyPE authors' code keeps them)."""
        dtype = angle_dtype(ids.device)  # float64, float32 on MPS and NPU (diffusers' rule)
        if not scaled:
            pos = ids.to(dtype)
            angles = [pos[..., axis, None] * axis_inv_freq(dim, self.theta, None, pos.new_ones(()))[0]
                      for axis, dim in enumerate(self.axes_dim)]  # fmt: skip
            return torch.cat(angles, dim=-1), pos.new_ones(sum(self.axes_dim) // 2)
        if extent is None:
            extent = self.extent if self.extent is not None else self.id_extent(ids)
        extent = extent.to(device=ids.device, dtype=dtype)
        pos = ids.to(dtype)
        sigma = self.sigma if self.sigma is not None else torch.ones((), dtype=dtype)
        angles, magnitude = [], []
        for axis, (dim, scaling) in enumerate(zip(self.axes_dim, self.axis_scalings, strict=True)):
            size = extent[self.spatial.index(axis)] if axis in self.spatial else extent.new_ones(())
            length = self.train_grid[self.spatial.index(axis)] if axis in self.spatial else 1
            inv, factor = axis_inv_freq(dim, self.theta, scaling, size / length, schedule=self.schedule,
                                        sigma=sigma.to(ids.device))  # fmt: skip
            angles.append(pos[..., axis, None] * inv)
            magnitude.append(factor.expand(dim // 2))
        scale = torch.cat(magnitude)
        if self.log_n_tokens is not None:  # logits x max(1, ln N / ln N_train): its square root on q and on k
            ratio = torch.log(extent.prod()) / math.log(self.log_n_tokens)
            scale = scale * ratio.clamp(min=1.0).sqrt()
        return torch.cat(angles, dim=-1), scale

    def id_extent(self, ids: torch.Tensor) -> torch.Tensor:
        """The (y, x) extent of the ids, max - min + 1 per spatial axis (a tensor: nothing is read back)."""
        spatial = ids[..., list(self.spatial)].reshape(-1, 2).to(angle_dtype(ids.device))
        return spatial.amax(0) - spatial.amin(0) + 1

    def extra_repr(self) -> str:
        said = f"axes_dim={self.axes_dim}, theta={self.theta}, spatial={self.spatial}, from {self.source}"
        if self.scaling is not None:
            said += f", scaling={self.scaling.type!r}" + (f", schedule={self.schedule.type!r}" if self.schedule else "")
        return said


AxisRope.scheme_info = SchemeInfo(  # type: ignore[attr-defined]
    name="rope2d",
    ndim=2,
    kind="rotary",
    trainable=False,
    relative=True,
    builder=AxisRope,
    scalable=True,
    summary="a diffusion transformer's own axial RoPE, recomputed",
    extrapolation="linear/ntk/yarn per axis; DyPE",
)
