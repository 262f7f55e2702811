"""BEiT's resampling of a relative-bias table to another grid: samples on a geometric grid, read linearly.

A table of 2n + 1 offsets per axis (n = H - 1) is taken to stand at positions 0, +-1, +-(1 + q),
+-(1 + q + q^2), ... where q is chosen (by bisection in [1.01, 1.5], to 1e-6) so that the last one,
(1 - q^n) / (1 - q), reaches the new grid's largest offset m = H' - 1; the new table is read at the
integer offsets -m..m, linearly between those positions (the end values beyond them). Near offsets keep
their spacing, far ones are stretched. This is BEiT's fine-tuning rule (unilm, ``run_class_finetuning.py``),
as timm's ``resize_rel_pos_bias_table`` applies it without scipy (its ``RegularGridInterpolator``).
"""

from __future__ import annotations

import torch

_STEPS = 19  # BEiT's bisection of [1.01, 1.5] until it is narrower than 1e-6: 0.49 / 2**19 < 1e-6 < 0.49 / 2**18


def geometric_ratio(n: int, m: torch.Tensor) -> torch.Tensor:
    """The ratio q whose n-term geometric sum 1 + q + ... + q^(n-1) reaches m (a float64 scalar tensor), bisected
    as BEiT does. Tensor maths, so that an exported program keeps the new size ``m`` symbolic."""
    left, right = torch.full_like(m, 1.01), torch.full_like(m, 1.5)
    q = (left + right) / 2
    for _ in range(_STEPS):
        q = (left + right) / 2
        over = (1 - q**n) / (1 - q) > m
        left, right = torch.where(over, left, q), torch.where(over, q, right)
    return q


def geometric_positions(size: int, m: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[size]: where the ``size`` = 2n + 1 samples of one axis stand when it is resampled to offsets -m..m
    (``m`` a float64 scalar tensor); the integers -n..n themselves where ``keep`` (a bool scalar tensor: the
    table keeps its size, which BEiT does not resample; an axis that keeps its size beside one that changes
    is resampled too, as BEiT does)."""
    n = size // 2
    q = geometric_ratio(n, m)
    far = torch.cumsum(q ** torch.arange(n, dtype=torch.float64, device=m.device), 0)  # [n]: 1, 1 + q, ...
    points = torch.cat((-far.flip(0), far.new_zeros(1), far))
    same = torch.arange(-n, n + 1, dtype=torch.float64, device=m.device)
    return torch.where(keep, same, points).float()


def linear_weights(points: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """[S] sorted sample positions, [T] query positions -> [T, S]: linear interpolation, ends held beyond them."""
    right = torch.bucketize(at, points).clamp(max=points.numel() - 1)  # first sample >= the query
    left = (right - 1).clamp(min=0)
    to_left = (at - points[left]).clamp(min=0)  # [T]
    to_right = (points[right] - at).clamp(min=0)
    span = to_left + to_right
    exact = span == 0  # on a sample, or beyond an end
    w_left = torch.where(exact, torch.ones_like(span), to_right / torch.where(exact, 1.0, span))
    w_right = torch.where(exact, torch.zeros_like(span), to_left / torch.where(exact, 1.0, span))
    weights = torch.zeros(at.numel(), points.numel(), dtype=at.dtype, device=at.device)
    rows = torch.arange(at.numel(), device=at.device)
    weights.index_put_((rows, left), w_left, accumulate=True)
    weights.index_put_((rows, right), w_right, accumulate=True)
    return weights


def resize_geometric(per_offset: torch.Tensor, new_size: tuple[int, int]) -> torch.Tensor:
    """Per-offset values [heads, 2H-1, 2W-1] -> [heads, 2H'-1, 2W'-1] on BEiT's geometric grid (fp32 maths,
    the input's dtype back). ``new_size``: (2H'-1, 2W'-1)."""
    _, sh, sw = per_offset.shape
    device = per_offset.device
    targets = [torch.arange(-(new // 2), new // 2 + 1, dtype=torch.float32, device=device) for new in new_size]
    keep = (targets[0][-1] == sh // 2) & (targets[1][-1] == sw // 2)  # [] bool: the same size (-m..m = -n..n)
    axes = []
    for size, at in zip((sh, sw), targets, strict=True):
        points = geometric_positions(size, at[-1].double(), keep)
        axes.append(linear_weights(points, at))  # [new, size]
    rows, cols = axes
    out = torch.einsum("ys,hst,xt->hyx", rows, per_offset.float(), cols)  # separable: rows, then columns
    return out.to(per_offset.dtype)
