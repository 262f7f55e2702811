"""Learned absolute embeddings: a 1D table per position, a 2D table per patch (ViT), or row + column (NaViT)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .._validate import check_bool, check_choice, check_float, check_grid, check_int, check_positions, same_size
from ..registry import register

OUT_OF_RANGE: tuple[str, ...] = ("error", "clamp", "interpolate")
RESAMPLE: tuple[str, ...] = ("resize", "grid_sample")
INTERPOLATION: tuple[str, ...] = ("bicubic", "bilinear")


def resize_bicubic(
    img: torch.Tensor, size: tuple[int, int], antialias: bool = True, mode: str = "bicubic"
) -> torch.Tensor:
    """[1, C, H, W] -> [1, C, H', W'], bicubic (or ``mode="bilinear"``), with antialiasing unless
    ``antialias=False`` (which only changes a reduction: upsampled, both are the same).

    A one-column output is computed as a one-row output: torch's antialiased bicubic kernel (CPU, torch
    2.14) returns wrong values when it resizes the height of a width-1 output in some memory layouts.
    Under ``torch.compile`` a resize that takes gradients is ``resize_by_weights``: inductor (torch 2.14.1)
    fails on the backward of the resampling kernels at symbolic sizes ("isIntList() INTERNAL ASSERT FAILED").
    """
    if torch.compiler.is_compiling() and img.requires_grad and torch.is_grad_enabled():
        return resize_by_weights(img, size, antialias, mode)
    if size[1] == 1 and size[0] != 1 and img.shape[-2] != size[0]:
        return resize_bicubic(img.transpose(-2, -1), (1, size[0]), antialias, mode).transpose(-2, -1)
    return F.interpolate(img, size=size, mode=mode, antialias=antialias, align_corners=False)


def resize_weights(
    n: int, size: int, antialias: bool, mode: str, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """The resize of one axis from ``n`` to ``size`` points as a matrix [size, n]: the kernel's own weights, read
    by resizing the rows of the identity (as one-row images: see ``resize_bicubic``)."""
    eye = torch.eye(n, device=device, dtype=dtype)[None, :, None, :]  # [1, n, 1, n]: one-hot rows
    return F.interpolate(eye, size=(1, size), mode=mode, antialias=antialias, align_corners=False)[0, :, 0, :].T


def resize_by_weights(
    img: torch.Tensor, size: tuple[int, int], antialias: bool = True, mode: str = "bicubic"
) -> torch.Tensor:
    """``resize_bicubic`` as two matrix products: the resize is separable and linear in the image, so it is
    ``W_h @ img @ W_w^T`` with each axis's weights from ``resize_weights`` (equal to the kernel up to the order
    of its sums); its gradient is two matrix products too."""
    dtype = torch.promote_types(img.dtype, torch.float32)  # at least fp32, as the kernel computes
    rows = resize_weights(img.shape[-2], size[0], antialias, mode, img.device, dtype)  # [H', H]
    cols = resize_weights(img.shape[-1], size[1], antialias, mode, img.device, dtype)  # [W', W]
    return torch.einsum("ai,ncij,bj->ncab", rows, img.to(dtype), cols).to(img.dtype)


def resample_table_2d(
    table: torch.Tensor, grid: tuple[int, int], antialias: bool = True, mode: str = "bicubic"
) -> torch.Tensor:
    """[H, W, d] -> [H', W', d] in fp32, cast back: bicubic with antialiasing (timm's ``resample_abs_pos_embed``
    rule), or without (``antialias=False``: transformers' ViT, DeiT, DINOv2, CLIP and SigLIP); ``mode="bilinear"``
    with antialiasing is SigLIP 2's rule."""
    if same_size(table.shape[:2], grid):
        return table  # bicubic at the same size returns the table exactly; this only skips the work
    img = table.permute(2, 0, 1)[None].float()  # [1, d, H, W]
    out = resize_bicubic(img, tuple(grid), antialias, mode)
    return out[0].permute(1, 2, 0).to(table.dtype)


def interpolate_cells(table: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
    """A table [H, W, d] over the cells of a grid, read at points ``cells`` [M, 2] ((y, x), possibly
    fractional) -> [M, d] fp32: bicubic between cell centres (exactly the table's rows at integer cells),
    clamped to the border."""
    h, w, _ = table.shape
    size = torch.tensor([max(h - 1, 1), max(w - 1, 1)], device=cells.device, dtype=torch.float32)
    where = (2.0 * cells.float() / size - 1.0).flip(-1)  # [-1, 1] over the centres (align_corners=True), (x, y)
    img = table.float().permute(2, 0, 1)[None]  # [1, d, H, W]
    out = F.grid_sample(img, where[None, :, None], mode="bicubic", padding_mode="border", align_corners=True)
    return out[0, :, :, 0].T


@register("learned1d", ndim=1, kind="additive", trainable=True, relative=False, context=("dim",),
    summary="learned absolute table", extrapolation="none past max_len (error, clamp or interpolate: explicit)",
    reference="Devlin et al. 2019 (BERT)")
class Learned1d(nn.Module):
    """A trainable [max_len, dim] table. Beyond ``max_len`` it must be told what to do (``out_of_range``):
    ``error`` (default), ``clamp`` (reuse the last row) or ``interpolate`` (stretch the table linearly).
    ``init_std`` 0.02 (BERT / ViT) suits token embeddings of that scale; next to ``nn.Embedding``'s
    N(0, 1) tokens use about 1.0, or the table barely moves in a short run."""

    def __init__(self, *, dim: int, max_len: int = 512, out_of_range: str = "error", init_std: float = 0.02) -> None:
        super().__init__()
        self.dim = check_int("dim", dim, minimum=1)
        self.max_len = check_int("max_len", max_len, minimum=1)
        self.out_of_range = check_choice("out_of_range", out_of_range, OUT_OF_RANGE)
        init_std = check_float("init_std", init_std, minimum=0.0)
        self.table = nn.Parameter(torch.zeros(self.max_len, self.dim))
        nn.init.trunc_normal_(self.table, std=init_std)

    def forward(self, positions: torch.Tensor | int) -> torch.Tensor:
        """-> [(B,) N, dim] in the table's dtype."""
        positions = check_positions(positions).to(self.table.device)
        needed = int(positions.max()) + 1
        if needed <= self.max_len:
            return self.table[positions]
        if self.out_of_range == "error":
            raise ValueError(
                f"learned1d table has {self.max_len} positions, got position {needed - 1}; "
                "set out_of_range='clamp' or 'interpolate' to go beyond it"
            )
        if self.out_of_range == "clamp":
            return self.table[positions.clamp(max=self.max_len - 1)]
        stretched = F.interpolate(self.table.T[None].float(), size=needed, mode="linear", align_corners=True)
        return stretched[0].T.to(self.table.dtype)[positions]


@register("learned2d", ndim=2, kind="additive", trainable=True, relative=False,
    context=("dim", "train_grid", "num_prefix_tokens"),
    summary="learnable (H, W, d) table; optional row + column form (NaViT)",
    extrapolation="table resampled (bicubic: resized with antialias, or sampled at the cells)",
    reference="Dosovitskiy et al. 2021 (ViT); Dehghani et al. 2023 (NaViT)")
class Learned2d(nn.Module):
    """A trainable [H, W, dim] table for the training grid (ViT), resampled bicubically at other grids.

    ``factorized=True`` learns a row table [H, dim] and a column table [W, dim] and adds them (NaViT).
    ``num_prefix_tokens`` > 0 adds a [P, dim] table for prefix tokens (timm models whose ``pos_embed``
    covers the class token); the grid part never includes them.

    ``resample`` says how the table reaches another grid: ``"resize"`` (default) resizes it as a whole,
    bicubic with antialiasing (timm's ``resample_abs_pos_embed``, and NaFlexVit's default path);
    ``"grid_sample"`` samples it bicubically at each cell's centre, clamped to the table's border (timm
    NaFlexVit's ``pos_embed_use_grid_sample=True``), which defines it between cells too (``sample``).
    ``antialias=False`` resizes without antialiasing, as transformers' ViTs do (the same table upsampled,
    another one reduced); ``interpolation="bilinear"`` resizes bilinearly (SigLIP 2, with antialiasing).
    """

    def __init__(
        self,
        *,
        dim: int,
        train_grid: tuple[int, int] = (14, 14),
        factorized: bool = False,
        num_prefix_tokens: int = 0,
        init_std: float = 0.02,
        resample: str = "resize",
        antialias: bool = True,
        interpolation: str = "bicubic",
    ) -> None:
        super().__init__()
        self.dim = check_int("dim", dim, minimum=1)
        self.train_grid = check_grid(train_grid, "train_grid")
        self.antialias = check_bool("antialias", antialias)
        self.factorized = check_bool("factorized", factorized)
        self.resample = check_choice("resample", resample, RESAMPLE)
        self.interpolation = check_choice("interpolation", interpolation, INTERPOLATION)
        if self.interpolation != "bicubic" and self.resample == "grid_sample":
            raise ValueError("resample='grid_sample' samples bicubically; interpolation applies to resample='resize'")
        if self.factorized and self.resample == "grid_sample":
            raise ValueError("resample='grid_sample' samples a full [H, W, dim] table; use it with factorized=False")
        check_int("num_prefix_tokens", num_prefix_tokens, minimum=0)
        init_std = check_float("init_std", init_std, minimum=0.0)
        h, w = self.train_grid
        if self.factorized:
            self.row = nn.Parameter(torch.zeros(h, dim))
            self.col = nn.Parameter(torch.zeros(w, dim))
            tables = (self.row, self.col)
        else:
            self.table = nn.Parameter(torch.zeros(h, w, dim))
            tables = (self.table,)
        self.prefix = nn.Parameter(torch.zeros(num_prefix_tokens, dim)) if num_prefix_tokens else None
        for t in (*tables, self.prefix):
            if t is not None:
                nn.init.trunc_normal_(t, std=init_std)

    @property
    def num_prefix_tokens(self) -> int:
        return 0 if self.prefix is None else self.prefix.shape[0]

    @torch.no_grad()
    def adopt_pos_embed(self, pos_embed: torch.Tensor) -> bool:
        """Host hook: start from a model's own table ``pos_embed`` [1, P + H*W, dim] (P = this module's
        prefix rows), so the model's outputs at the training grid stay the same. A table of another square
        grid (a checkpoint of the model at another size) is resampled to this one, as timm's checkpoint
        filters resample it (bicubic, antialiased; a square source assumed, the prefix rows kept). Returns
        whether it fit."""
        h, w = self.train_grid
        p = self.num_prefix_tokens
        if self.factorized or pos_embed.dim() != 3 or pos_embed.shape[0] != 1 or pos_embed.shape[2] != self.dim:
            return False
        cells = pos_embed.shape[1] - p
        side = math.isqrt(max(cells, 0))
        if cells == h * w:
            grid = (h, w)
        elif cells > 0 and side * side == cells:
            grid = (side, side)
        else:
            return False
        if pos_embed.is_meta:  # a model built on the meta device: the table arrives with its weights, so does ours
            self.table = nn.Parameter(self.table.to("meta"), requires_grad=self.table.requires_grad)
            if self.prefix is not None:
                self.prefix = nn.Parameter(self.prefix.to("meta"), requires_grad=self.prefix.requires_grad)
            return True
        if self.table.is_meta:  # patched on the meta device, loading a plain checkpoint: the table arrives now
            self.table = nn.Parameter(torch.empty_like(self.table, device=pos_embed.device))
            if self.prefix is not None:
                self.prefix = nn.Parameter(torch.empty_like(self.prefix, device=pos_embed.device))
        table = pos_embed[0, p:].reshape(*grid, self.dim)
        if grid != (h, w):
            table = resample_table_2d(table, (h, w), self.antialias, self.interpolation)
        self.table.copy_(table)
        if self.prefix is not None:
            self.prefix.copy_(pos_embed[0, :p])
        return True

    def resample_state(
        self, state: dict[str, torch.Tensor], prefix: str, old_grid: tuple[int, int], new_grid: tuple[int, int]
    ) -> None:
        """Loading a checkpoint made at ``old_grid``: its tables, resampled to this module's grid as timm
        resamples ``pos_embed`` (bicubic, antialias); prefix rows are kept as they are."""
        (h, w), (h2, w2) = old_grid, new_grid
        for name, old, new in (("table", (h, w), (h2, w2)), ("row", (h, 1), (h2, 1)), ("col", (1, w), (1, w2))):
            key = f"{prefix}{name}"
            if key in state:
                table = state[key] if name == "table" else state[key].reshape(*old, -1)
                resampled = resample_table_2d(table, new, self.antialias, self.interpolation)
                state[key] = resampled if name == "table" else resampled.reshape(max(new), -1)

    def sample(self, cells: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        """The table at ``cells`` [M, 2] (y, x), in patch units, possibly fractional, of images whose grids
        are ``sizes`` [M, 2] (H, W) -> [M, dim] fp32: bicubic at the cell's centre, its place in the image
        mapped onto the table (``(y + 0.5) / H`` of the table's height), clamped to the table's border."""
        centre = (2.0 * cells.float() + 1.0) / sizes.float() - 1.0  # [-1, 1], grid_sample's align_corners=False
        table = self.table.float().permute(2, 0, 1)[None]  # [1, dim, H0, W0]
        where = centre.flip(-1)[None, :, None]  # [1, M, 1, 2] in grid_sample's (x, y) order
        out = F.grid_sample(table, where, mode="bicubic", padding_mode="border", align_corners=False)
        return out[0, :, :, 0].T

    def forward(
        self, grid: tuple[int, int] | None, device: torch.device | None = None, *, cells: torch.Tensor | None = None,
        prefix: bool = False,
    ) -> torch.Tensor:
        """-> [H*W, dim] for the patch tokens of ``grid``, in the parameters' dtype (fp32 when sampled);
        ``prefix=True``: the prefix rows [P, dim] instead (read through the module's call, as every weight is, so
        that hooks bringing the weights in before a call, such as accelerate's offloading, see it).

        ``cells`` [M, 2]: the table at these points ((y, x) in patch units, possibly fractional) of an image
        whose grid is ``grid`` -> [M, dim]: ``grid_sample`` samples the table there (``sample``); ``resize``
        interpolates the table resized to ``grid`` bicubically between its cells (its own rows at integer
        cells, clamped to its border)."""
        if prefix:  # a view, not the parameter itself: a forward's outputs are results (module hooks such as
            return self.prefix.view_as(self.prefix)  # torch's ModuleTracker hook the outputs' autograd nodes)
        h, w = check_grid(grid)
        if cells is not None:
            if self.resample == "grid_sample":
                return self.sample(cells, torch.tensor([h, w], device=cells.device).expand(cells.shape[0], 2))
            table = self(grid, device)
            return interpolate_cells(table.reshape(h, w, self.dim), cells).to(table.dtype)
        if self.resample == "grid_sample":
            at = self.table.device
            cells = torch.cartesian_prod(torch.arange(h, device=at), torch.arange(w, device=at))
            return self.sample(cells, torch.tensor([h, w], device=at).expand(h * w, 2))
        if self.factorized:
            row = resample_table_2d(self.row[:, None], (h, 1), self.antialias, self.interpolation)[:, 0]  # [H', d]
            col = resample_table_2d(self.col[None], (1, w), self.antialias, self.interpolation)[0]  # [W', d]
            return (row[:, None] + col[None]).reshape(h * w, self.dim)
        return resample_table_2d(self.table, (h, w), self.antialias, self.interpolation).reshape(h * w, self.dim)
