"""Decomposed relative positions (MViTv2, ViTDet, SAM): a query-dependent bias, one table per axis.

For a query at cell (qy, qx) with content q and a key at (ky, kx) the logit gains

    q . R_h[qy - ky] + q . R_w[qx - kx]

with learned tables R_h [2H-1, head_dim] and R_w [2W-1, head_dim], shared by the heads (Li et al. 2022,
MViTv2; Kirillov et al. 2023, SAM). q is the query before the logit scale. The term is a sum of a y-only
and an x-only part: no row meets a column.

Another grid: each table is interpolated linearly (``F.interpolate(mode="linear")``, half-pixel centres) to
2 * max(q_size, k_size) - 1 entries, and when the query and key sides differ the shorter side's coordinates
are stretched to the longer one's (timm's ``get_rel_pos``); in self-attention both sides are the grid's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .._validate import check_float, check_grid, check_int, same_size
from ..registry import register


def resize_rel_table(table: torch.Tensor, length: int) -> torch.Tensor:
    """[L, d] -> [length, d]: linear interpolation along the offsets (the table as it is when L == length; in
    an exported program, whose sizes are unknown when it is traced, interpolated to its own size: the same)."""
    if same_size((table.shape[0],), (length,)):
        return table
    out = F.interpolate(table.T[None].float(), size=length, mode="linear")  # [1, d, length]
    return out[0].T.to(table.dtype)


def relative_rows(table: torch.Tensor, q_size: int, k_size: int) -> torch.Tensor:
    """One axis of the decomposed term: [L, d] -> [q_size, k_size, d], the row of ``table`` (resized to
    2 * max(q_size, k_size) - 1 entries) for every (query, key) pair of coordinates along that axis."""
    table = resize_rel_table(table, 2 * max(q_size, k_size) - 1)
    q_stretch, k_stretch = max(k_size / q_size, 1.0), max(q_size / k_size, 1.0)
    q_coords = torch.arange(q_size, device=table.device, dtype=torch.float32)[:, None] * q_stretch  # [q, 1]
    k_coords = torch.arange(k_size, device=table.device, dtype=torch.float32)[None, :] * k_stretch  # [1, k]
    offsets = q_coords - k_coords + (k_size - 1) * k_stretch  # [q, k], >= 0: the table's index
    return table[offsets.long()]


def self_relative_rows(table: torch.Tensor, size: int) -> torch.Tensor:
    """``relative_rows(table, size, size)``, self-attention's case: integer offsets, no stretch, no size compared
    (so that an exported program keeps the size symbolic). [size, size, d]."""
    table = resize_rel_table(table, 2 * size - 1)
    coords = torch.arange(size, device=table.device)
    return table[coords[:, None] - coords[None, :] + size - 1]


def decomposed_bias(
    q: torch.Tensor, rows_h: torch.Tensor, rows_w: torch.Tensor, num_prefix_tokens: int = 0
) -> torch.Tensor:
    """q [B, heads, P + H*W, d] (P prefix tokens, then the patch tokens, row-major), ``relative_rows`` of each axis
    [H, H, d] and [W, W, d] -> the additive logits [B, heads, P + H*W, P + H*W]: q . R_h[qy - ky] + q . R_w[qx - kx]
    between patches, zero in the prefix rows and columns. Written into one tensor: no padded copy of the mask."""
    p = num_prefix_tokens
    b, heads, t, d = q.shape
    h, w = rows_h.shape[0], rows_w.shape[0]
    n = t - p
    grid_q = q[:, :, p:].reshape(b, heads, h, w, d)
    # contiguous: einsum returns a permuted view (its batch axis, y or x, outermost in memory), and the broadcast
    # add below orders such strides by comparing them: with symbolic sizes, a guard on the batch size that an
    # exported program then fails at batch 1. The same values, laid out plainly.
    along_h = torch.einsum("bnyxd,ykd->bnyxk", grid_q, rows_h.to(q.dtype)).contiguous()  # [B, heads, H, W, H]: key row
    along_w = torch.einsum("bnyxd,xkd->bnyxk", grid_q, rows_w.to(q.dtype)).contiguous()  # [B, heads, H, W, W]: key col
    if p == 0:
        return (along_h[..., :, None] + along_w[..., None, :]).reshape(b, heads, n, n)
    out = q.new_zeros(b, heads, t, t)
    patches = out[:, :, p:, p:].view(b, heads, h, w, h, w)  # [B, heads, qy, qx, ky, kx], a view into ``out``
    patches.add_(along_h[..., :, None]).add_(along_w[..., None, :])
    return out


@dataclass
class QueryBias:
    """A decomposed relative bias awaiting its queries: ``logits(q)`` is the additive mask of a layer.

    ``rows_h`` [H, H, d], ``rows_w`` [W, W, d] (``relative_rows`` at the grid); ``num_prefix_tokens`` tokens
    before the grid get zero bias; ``tokens`` [B, M] (a subset: which of the P + H*W tokens each row holds) or
    None; ``extra``: a mask added to the result (the caller's)."""

    rows_h: torch.Tensor
    rows_w: torch.Tensor
    num_prefix_tokens: int = 0
    tokens: torch.Tensor | None = None
    extra: torch.Tensor | None = None

    def with_prefix(self, num_prefix_tokens: int) -> QueryBias:
        return QueryBias(self.rows_h, self.rows_w, num_prefix_tokens, self.tokens, self.extra)

    def take(self, tokens: torch.Tensor) -> QueryBias:
        """The rows of a token subset, ``tokens`` [B, M] indices into the P + H*W tokens."""
        return QueryBias(self.rows_h, self.rows_w, self.num_prefix_tokens, tokens, self.extra)

    def plus(self, mask: torch.Tensor | None) -> QueryBias:
        """With ``mask`` (broadcastable to [B, heads, M, M]) added to the logits."""
        extra = mask if self.extra is None or mask is None else self.extra + mask
        return QueryBias(self.rows_h, self.rows_w, self.num_prefix_tokens, self.tokens, extra)

    def logits(self, q: torch.Tensor) -> torch.Tensor:
        """q [B, heads, M, d] (unscaled) -> the additive mask [B, heads, M, M] in q's dtype."""
        p = self.num_prefix_tokens
        if self.tokens is None:
            bias = decomposed_bias(q, self.rows_h, self.rows_w, p)  # prefix rows and columns: zero
        else:
            bias = self._gathered(q)
        return bias if self.extra is None else bias + self.extra.to(bias.dtype)

    def _gathered(self, q: torch.Tensor) -> torch.Tensor:
        """A token subset: each query's rows of the tables at its own cell, read at each key's cell."""
        p, w = self.num_prefix_tokens, self.rows_w.shape[0]
        b, heads, m, _ = q.shape
        cell = (self.tokens - p).clamp(min=0)  # [B, M]; prefix tokens: cell 0, zeroed below
        y, x = cell // w, cell % w
        along_h = torch.einsum("bnmd,bmkd->bnmk", q, self.rows_h.to(q.dtype)[y])  # [B, heads, M, H]
        along_w = torch.einsum("bnmd,bmkd->bnmk", q, self.rows_w.to(q.dtype)[x])  # [B, heads, M, W]
        key_y = y[:, None, None, :].expand(b, heads, m, m)
        key_x = x[:, None, None, :].expand(b, heads, m, m)
        bias = along_h.gather(-1, key_y) + along_w.gather(-1, key_x)  # [B, heads, M, M]
        patch = self.tokens >= p  # [B, M]
        return bias * (patch[:, None, :, None] & patch[:, None, None, :]).to(bias.dtype)


@register("decomposed2d", ndim=2, kind="query_bias", trainable=True, relative=True, context=("dim", "train_grid"),
    per_layer=True, summary="decomposed relative positions: q . R_h[dy] + q . R_w[dx], one table per axis",
    extrapolation="tables interpolated linearly to the new grid (SAM's rule)",
    reference="Li et al. 2022 (MViTv2); Kirillov et al. 2023 (SAM)")  # fmt: skip
class Decomposed2d(nn.Module):
    """MViTv2 / ViTDet / SAM decomposed relative positions: tables ``rel_pos_h`` [2H-1, dim] and ``rel_pos_w``
    [2W-1, dim] (SAM's names) shared by the heads, one pair per layer; zero at the start as in SAM
    (``init_std`` > 0: truncated normal)."""

    def __init__(self, *, dim: int, train_grid: tuple[int, int] = (14, 14), init_std: float = 0.0) -> None:
        super().__init__()
        self.dim = check_int("dim (head dimension)", dim, minimum=1)
        self.train_grid = check_grid(train_grid, "train_grid")
        init_std = check_float("init_std", init_std, minimum=0.0)
        h, w = self.train_grid
        self.rel_pos_h = nn.Parameter(torch.zeros(2 * h - 1, self.dim))
        self.rel_pos_w = nn.Parameter(torch.zeros(2 * w - 1, self.dim))
        if init_std > 0:
            for table in (self.rel_pos_h, self.rel_pos_w):
                nn.init.trunc_normal_(table, std=init_std)

    def resample_state(
        self, state: dict[str, torch.Tensor], prefix: str, old_grid: tuple[int, int], new_grid: tuple[int, int]
    ) -> None:
        """Loading a checkpoint: its tables at this module's size (linear, as at any grid). The tables' own
        lengths say their grid, so a window block's tables need no grid of the model's."""
        h, w = self.train_grid
        for name, length in (("rel_pos_h", 2 * h - 1), ("rel_pos_w", 2 * w - 1)):
            key = f"{prefix}{name}"
            if key in state:
                state[key] = resize_rel_table(state[key], length)

    def forward(self, grid: tuple[int, int], device: torch.device | None = None) -> QueryBias:
        """-> a ``QueryBias`` at ``grid`` (self-attention: queries and keys on the same grid)."""
        h, w = check_grid(grid)
        return QueryBias(self_relative_rows(self.rel_pos_h, h), self_relative_rows(self.rel_pos_w, w))
