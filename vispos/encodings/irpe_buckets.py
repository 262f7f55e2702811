"""iRPE's bucketed offsets (Wu et al., ICCV 2021), the released code's rules: which bucket of a table each offset
(dy, dx) = query - key reads, for ``irpe2d`` and ``irpe2d_bias`` (``vispos.encodings.irpe``).

The piecewise index (the paper's Eq. 18, ``piecewise_index``), with alpha, beta, gamma = 1, 2, 8 x ``ratio``
(``get_single_rpe_config``) and B = int(beta):

    g(x) = round(x)                                                                  |x| <= alpha
    g(x) = sign(x) min(round(alpha + ln(|x| / alpha) / ln(gamma / alpha) (beta - alpha)), B)   otherwise

exact within alpha, logarithmic beyond, clipped at beta (by |x| = gamma at the latest): g(x) in [-B, B] (``round``
is torch's, half to even; it only matters at fractional offsets). The four methods (``method``):

| method | bucket of (dy, dx) | buckets (+1 with prefix tokens) | released ratio |
| --- | --- | --- | --- |
| ``euclidean`` | g(round(sqrt(dy^2 + dx^2))) + B (only B..2B are reached) | 2B + 1 | 20 |
| ``quant`` | g(dy^2 + dx^2) + B: the squared distance, as the code has it | 2B + 1 | 33 |
| ``cross`` | two tables, rows g(dy) + B and columns g(dx) + B; their terms add | 2 x (2B + 1) | 20 |
| ``product`` | (g(dy) + B) (2B + 1) + g(dx) + B | (2B + 1)^2 | 1.9 |

Product at ratio 1.9 (the released default and DeiT models): g in {0, +-1, +-2 (|x| = 2, 3), +-3 (|x| >= 4)} per
axis, 7 x 7 = 49 buckets, 50 with the class token's ("ctx_product_50").
"""

from __future__ import annotations

import math

import torch

from .relbias import offsets_2d, relative_index_2d

METHODS = ("euclidean", "quant", "cross", "product")


def piecewise_index(x: torch.Tensor, alpha: float, beta: float, gamma: float) -> torch.Tensor:
    """The released ``piecewise_index``: offsets (long or float) -> integer buckets in [-int(beta), int(beta)],
    same shape, int64. Written with ``torch.where`` instead of boolean indexing (one graph), same float32 maths."""
    x = x if x.is_floating_point() else x.float()  # the code's long / alpha is float32 too
    inside = x.abs() <= alpha
    far = x.abs().clamp(min=alpha)  # the log branch's own values (> alpha) are unchanged
    log_part = alpha + torch.log(far / alpha) / math.log(gamma / alpha) * (beta - alpha)
    y = torch.sign(x) * log_part.round().clip(max=beta)
    return torch.where(inside, x.round(), y).to(torch.long)  # .to(long) truncates: min(round(...), int(beta))


def coefficients(ratio: float) -> tuple[float, float, float]:
    """alpha, beta, gamma = 1, 2, 8 x ratio (``get_single_rpe_config``)."""
    return 1 * ratio, 2 * ratio, 8 * ratio


def num_buckets(method: str, ratio: float) -> int:
    """Buckets of one table without the prefix bucket (``get_num_buckets``): (2B + 1)^2 for product, else 2B + 1."""
    b = int(2 * ratio)
    return (2 * b + 1) ** 2 if method == "product" else 2 * b + 1


def bucket_ids(offsets: torch.Tensor, method: str, ratio: float) -> torch.Tensor:
    """Offsets (dy, dx) = query - key [..., 2] (long or float) -> bucket ids [K, ...] int64, K = 2 for cross (the
    rows' and the columns' table), else 1 (``_rp_2d_*`` plus ``get_bucket_ids_2d_without_skip``'s + B)."""
    alpha, beta, gamma = coefficients(ratio)
    b = int(beta)

    def g(x: torch.Tensor) -> torch.Tensor:
        return piecewise_index(x, alpha, beta, gamma)

    if method == "product":
        return ((g(offsets[..., 0]) + b) * (2 * b + 1) + g(offsets[..., 1]) + b)[None]
    if method == "cross":
        return torch.stack((g(offsets[..., 0]), g(offsets[..., 1]))) + b
    squared = offsets.square().sum(-1)
    if method == "euclidean":
        return (g(squared.float().sqrt().round()) + b)[None]
    return (g(squared) + b)[None]  # quant


def grid_bucket_ids(grid: tuple[int, int], method: str, ratio: float, device: torch.device | None) -> torch.Tensor:
    """Every pair of patches of ``grid`` (row-major): [K, HW, HW] int64, from the ids of each offset."""
    per_offset = bucket_ids(offsets_2d(grid, device), method, ratio)  # [K, 2H-1, 2W-1]
    return per_offset.flatten(1)[:, relative_index_2d(grid, per_offset.device)]
