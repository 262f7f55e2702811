"""Measures on attention-logit maps: translation error and cross-term (separability) error.

A logit map ``L[..., p, q]`` holds the logit between the query at position p and the key at q for
every pair of positions of a grid (H, W) (row-major: index = y * W + x), or of a 1D sequence of
length N (treated as the grid (1, N)). Offsets are key minus query: (dy, dx) = q - p.

Both measures are relative RMS values (the square root of an energy ratio), per leading index (head):
scale-free, 0 for the property held exactly, and ``nan`` for a map with no positional variation
(a constant map, e.g. ``nope``), where a relative error has nothing to be relative to.
"""

from __future__ import annotations

import torch
from einops import rearrange

from .._validate import check_grid


def as_grid(grid: tuple[int, int] | int) -> tuple[int, int]:
    """(H, W) for a 2D grid; an int N (1D sequence) is the grid (1, N)."""
    if isinstance(grid, int) and not isinstance(grid, bool):
        return check_grid((1, grid), "sequence length")
    return check_grid(grid)


def _check_map(logits: torch.Tensor, grid: tuple[int, int]) -> int:
    n = grid[0] * grid[1]
    if logits.dim() < 2 or logits.shape[-2:] != (n, n):
        raise ValueError(f"logits must be [..., N, N] with N = H * W = {n} for grid {grid}, got {tuple(logits.shape)}")
    return n


def offset_ids(grid: tuple[int, int] | int, *, device: torch.device | None = None) -> torch.Tensor:
    """Index of the offset (dy, dx) = key - query of every pair: (dy + H - 1) * (2W - 1) + dx + W - 1. [N, N]."""
    h, w = as_grid(grid)
    yy, xx = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    yx = torch.stack((yy.flatten(), xx.flatten()), dim=-1)  # [N, 2]
    rel = yx[None, :, :] - yx[:, None, :]  # [N (query), N (key), 2]: key - query
    return (rel[..., 0] + h - 1) * (2 * w - 1) + rel[..., 1] + w - 1


def _relative(num: torch.Tensor, den: torch.Tensor, rms: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """num / den, nan where the map has no positional variation (den at rounding level of the map)."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    constant = den <= 64 * eps * rms
    return torch.where(constant, torch.full_like(num, float("nan")), num / den.clamp_min(torch.finfo(den.dtype).tiny))


def offset_map(logits: torch.Tensor, grid: tuple[int, int] | int) -> torch.Tensor:
    """Mean logit per offset: [..., N, N] -> S [..., 2H-1, 2W-1], S[dy + H - 1, dx + W - 1].

    Non-finite entries (causal masks) are left out; an offset with no finite entry is nan. For a
    relative scheme every pair with the same offset has the same logit, so S is the scheme's offset map.
    """
    h, w = as_grid(grid)
    n = _check_map(logits, (h, w))
    flat = logits.double().reshape(-1, n * n)  # [B, N*N]
    finite = flat.isfinite()
    ids = offset_ids((h, w), device=logits.device).flatten()
    groups = (2 * h - 1) * (2 * w - 1)
    sums = flat.new_zeros(flat.shape[0], groups).index_add_(1, ids, torch.where(finite, flat, 0.0))
    counts = flat.new_zeros(flat.shape[0], groups).index_add_(1, ids, finite.double())
    means = torch.where(counts > 0, sums / counts.clamp_min(1), float("nan"))
    return means.reshape(*logits.shape[:-2], 2 * h - 1, 2 * w - 1)


def translation_error(logits: torch.Tensor, grid: tuple[int, int] | int) -> torch.Tensor:
    """How much logits change when query and key shift together: [..., N, N] -> [...].

    RMS over all pairs of L(p, q) minus the mean logit of its offset q - p, divided by the RMS of the
    centred map. Zero exactly when every logit depends on the offset alone (a relative scheme): then
    L(p + t, q + t) = L(p, q) for every shift t that keeps both positions on the grid. Non-finite
    entries (causal masks) are left out.
    """
    h, w = as_grid(grid)
    n = _check_map(logits, (h, w))
    flat = logits.double().reshape(-1, n * n)  # [B, N*N]
    finite = flat.isfinite()
    count = finite.sum(-1).clamp_min(1)
    means = offset_map(logits, (h, w)).reshape(flat.shape[0], -1)  # [B, groups]
    ids = offset_ids((h, w), device=logits.device).flatten()
    resid = torch.where(finite, flat - means[:, ids], 0.0)
    mean = torch.where(finite, flat, 0.0).sum(-1, keepdim=True) / count[:, None]
    centred = torch.where(finite, flat - mean, 0.0)
    rms = (torch.where(finite, flat, 0.0).square().sum(-1) / count).sqrt()
    num = (resid.square().sum(-1) / count).sqrt()
    den = (centred.square().sum(-1) / count).sqrt()
    return _relative(num, den, rms, logits.dtype).reshape(logits.shape[:-2])


def separability_error(table: torch.Tensor) -> torch.Tensor:
    """How far a table T[..., a, b] is from f(a) + g(b): [..., A, B] -> [...].

    The interaction T - mean_b T - mean_a T + mean T (two-way ANOVA; the least-squares residual of the
    best f(a) + g(b)), RMS, divided by the RMS of the centred table. Zero exactly when T = f(a) + g(b);
    at most 1. The interaction is the mixed second difference T(a, b) - T(a, b0) - T(a0, b) + T(a0, b0)
    averaged over the reference (a0, b0), so it vanishes exactly when every such difference does.
    """
    t = table.double()
    mean = t.mean((-2, -1), keepdim=True)
    interaction = t - t.mean(-1, keepdim=True) - t.mean(-2, keepdim=True) + mean
    num = interaction.square().mean((-2, -1)).sqrt()
    den = (t - mean).square().mean((-2, -1)).sqrt()
    return _relative(num, den, t.square().mean((-2, -1)).sqrt(), table.dtype)


def mixed_difference(table: torch.Tensor, *, anchor: tuple[int, int] | None = None) -> torch.Tensor:
    """T(a, b) - T(a, b0) - T(a0, b) + T(a0, b0) for [..., A, B]; zero everywhere iff T = f(a) + g(b).

    On an offset map S [..., 2H-1, 2W-1] the default anchor is the centre, offset (0, 0): the map is
    S(dx, dy) - S(dx, 0) - S(0, dy) + S(0, 0).
    """
    a0, b0 = anchor if anchor is not None else (table.shape[-2] // 2, table.shape[-1] // 2)
    return table - table[..., :, b0 : b0 + 1] - table[..., a0 : a0 + 1, :] + table[..., a0 : a0 + 1, b0 : b0 + 1]


def axis_pairs(logits: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Regroup a logit map by axis: [..., HW, HW] -> [..., (px qx) = W*W, (py qy) = H*H].

    Entry [(px, qx), (py, qy)] is L((py, px), (qy, qx)). The map is free of row/column cross terms
    when it splits as F(px, qx) + G(py, qy): x coordinates meet only x coordinates, y only y.
    """
    h, w = check_grid(grid)
    _check_map(logits, (h, w))
    return rearrange(logits, "... (py px) (qy qx) -> ... (px qx) (py qy)", py=h, px=w, qy=h, qx=w)


def cross_term(logits: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Row/column cross-term energy of a 2D logit map: [..., HW, HW] -> [...].

    ``separability_error`` of ``axis_pairs(logits)``: zero exactly when L(p, q) = F(px, qx) + G(py, qy),
    i.e. no term couples an x coordinate with a y coordinate (the survey's Q_row K_col^T + Q_col K_row^T).
    Defined for any scheme, absolute or relative; for a relative scheme L(p, q) = S(q - p), and it is
    zero exactly when S(dx, dy) = f(dx) + g(dy) (the mixed second difference of S vanishes), with each
    offset weighted by how many pairs of the grid have it.
    """
    return separability_error(axis_pairs(logits, grid))


def query_map(logits: torch.Tensor, grid: tuple[int, int], *, query: tuple[int, int] | None = None) -> torch.Tensor:
    """Logits of one query (y, x) (default: the grid centre) against every key: [..., HW, HW] -> [..., H, W]."""
    h, w = check_grid(grid)
    _check_map(logits, (h, w))
    y, x = query if query is not None else (h // 2, w // 2)
    if not (0 <= y < h and 0 <= x < w):
        raise ValueError(f"query {(y, x)} is outside the grid {(h, w)}")
    return logits[..., y * w + x, :].reshape(*logits.shape[:-2], h, w)
