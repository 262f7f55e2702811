"""The sin-cos table of SD3, PixArt and DiT (diffusers' ``PatchEmbed``), recomputed by vispos, and its position
interpolation above the training grid.

The table is ``sincos2d``'s (``encodings/sincos.py``: x on the first half of the channels, y on the second, theta
1e4) with the channels of each half as the host orders them (every sine, then every cosine) and the host's
coordinates: row r of an H-row grid at r base / (H i) (PixArt, DiT: ``base_size`` B, ``interpolation_scale`` i; a
grid of any size spans the same range, so these tables interpolate already), or (SD3: a table of M x M cells,
``pos_embed_max_size``) at (top + r) B / (M i), top = (M - H) // 2, the centre crop, which extrapolates up to M.
``scaling="linear"`` (position interpolation) puts a grid larger than the training grid (H0, W0) over the cells the
training grid covers: row r at (top0 + r / s) B / (M i), s = H / H0 per axis (or the given factor), with no limit at M.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from .._state import decode, encode
from .._validate import check_grid
from ..encodings.rope import saved_scaling
from ..encodings.rope_scaling import RopeScaling, as_scaling
from ..encodings.sincos import sincos_1d
from ..registry import SchemeInfo


def host_order(table: torch.Tensor) -> torch.Tensor:
    """sincos_1d's channels (sin, cos per frequency) -> every sine, then every cosine."""
    return torch.cat((table[..., 0::2], table[..., 1::2]), dim=-1)


class SinCosTable(nn.Module):
    def __init__(self, *, dim: int, base_size: int, interpolation_scale: float, max_size: int | None,
                 train_grid: tuple[int, int]) -> None:  # fmt: skip
        super().__init__()
        self.dim, self.base_size, self.interpolation_scale = dim, base_size, interpolation_scale
        self.max_size = max_size
        self.train_grid = check_grid(train_grid, "train_grid")
        self.scaling: RopeScaling | None = None

    def set_scaling(self, scaling: RopeScaling | dict | str | None, *, train_grid: tuple[int, int] | None = None,
                    **options: Any) -> None:  # fmt: skip
        """``"linear"``: position interpolation above ``train_grid``; None: the host's own table at every size."""
        if "original_length" in options:
            raise ValueError("the training size of each axis comes from train_grid=(H, W), not original_length")
        grid = self.train_grid if train_grid is None else check_grid(train_grid, "train_grid")
        read = as_scaling(scaling, original_length=grid[0], **options)
        if read is not None and read.type != "linear":
            raise ValueError(f"{read.type!r} scaling is a RoPE scaling; a sin-cos table takes 'linear' (position "
                             "interpolation)")  # fmt: skip
        if read is not None:
            self.check_stored()
        self.scaling, self.train_grid = read, grid

    def check_stored(self) -> None:
        """Interpolation recomputes the table from the formula: refused where the host's stored table (SD3's
        ``pos_embed``, loaded from its checkpoint) is another table."""
        host = self.__dict__.get("_host_embed")
        table = None if host is None else host.__dict__["_buffers"].get("pos_embed")
        if table is None or self.max_size is None or table.device.type == "meta":
            return
        cells = torch.arange(self.max_size, dtype=torch.float32) / (self.max_size / self.base_size)
        axis = host_order(sincos_1d(cells / self.interpolation_scale, self.dim // 2))
        n = self.max_size
        formula = torch.cat((axis[None, :, :].expand(n, n, -1), axis[:, None, :].expand(n, n, -1)), dim=-1)
        gap = float((table.detach().float().cpu().reshape(n * n, -1) - formula.reshape(n * n, -1)).abs().max())
        if gap > 1e-5:
            raise ValueError(
                f"this transformer's stored pos_embed is not the sin-cos formula's table (max |difference| {gap:.3g}): "
                "scaling='linear' interpolates the formula's table, so it would change the positions the weights were "
                "trained with. Without a scaling the stored table is used, cropped as diffusers crops it"
            )

    def interpolates(self, grid: tuple[int, int]) -> bool:
        """Whether a grid is placed by interpolation (a scaling above the training grid) rather than the host's own
        table."""
        if self.scaling is None:
            return False
        if self.scaling.factor is not None:
            return self.scaling.factor > 1.0
        return grid[0] > self.train_grid[0] or grid[1] > self.train_grid[1]

    def set_train_grid(self, train_grid: tuple[int, int]) -> None:
        self.train_grid = check_grid(train_grid, "train_grid")

    def get_extra_state(self) -> torch.Tensor:
        return encode({"scaling": None if self.scaling is None else asdict(self.scaling),
                       "train_grid": list(self.train_grid)})  # fmt: skip

    def set_extra_state(self, state: torch.Tensor | dict[str, Any]) -> None:
        state = decode(state)
        scaling = saved_scaling(state["scaling"])  # its original length comes from the training grid
        if scaling is not None:
            scaling.pop("original_length", None)
        self.set_scaling(scaling, train_grid=tuple(state["train_grid"]))

    def coordinates(self, n: int, axis: int, device: torch.device | None) -> torch.Tensor:
        """The host's coordinates of the n cells of ``axis`` (0: y, 1: x), float32; interpolated above training."""
        cells = torch.arange(n, device=device, dtype=torch.float32)
        trained = self.train_grid[axis]
        if self.max_size is None:  # PixArt, DiT: stretched over base_size at every size
            return cells / (n / self.base_size) / self.interpolation_scale
        s = 1.0 if self.scaling is None else (self.scaling.factor or max(1.0, n / trained))
        if s > 1.0:  # the cells of the training grid's crop, at 1 / s spacing
            cells = (self.max_size - trained) // 2 + cells / s
        elif n > self.max_size:
            raise ValueError(f"a {n}-cell axis exceeds the table's pos_embed_max_size ({self.max_size}): configure "
                             "scaling='linear' (position interpolation) to go beyond it")  # fmt: skip
        else:
            cells = (self.max_size - n) // 2 + cells
        return cells / (self.max_size / self.base_size) / self.interpolation_scale

    def forward(self, grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
        """[H*W, dim] float32, row-major: x on the first half of the channels, y on the second."""
        h, w = grid
        y = host_order(sincos_1d(self.coordinates(h, 0, device), self.dim // 2))  # [H, dim / 2]
        x = host_order(sincos_1d(self.coordinates(w, 1, device), self.dim // 2))  # [W, dim / 2]
        return torch.cat((x[None, :, :].expand(h, w, -1), y[:, None, :].expand(h, w, -1)), dim=-1).reshape(h * w, -1)

    def extra_repr(self) -> str:
        said = f"dim={self.dim}, base_size={self.base_size}, interpolation_scale={self.interpolation_scale}"
        said += f", max_size={self.max_size}" if self.max_size else ""
        return said + (f", scaling={self.scaling.type!r}" if self.scaling else "")


SinCosTable.scheme_info = SchemeInfo(  # type: ignore[attr-defined]
    name="sincos2d",
    ndim=2,
    kind="additive",
    trainable=False,
    relative=False,
    builder=SinCosTable,
    scalable=True,
    summary="a diffusion transformer's own sin-cos table, recomputed",
    extrapolation="position interpolation",
)
