"""A relative bias table [heads, 2H-1, 2W-1] taken to another grid (relbias2d's ``resize``, checkpoints loaded at
another grid).

Two rules take relbias2d's table to another grid (``resize``): ``"bicubic"`` over the (dy, dx) plane (Swin's
checkpoint rule), or ``"geometric"``, BEiT's (``resize_rel_pos_bias_table`` in timm, from unilm's BEiT
fine-tuning code): the old offsets 0, +-1, +-(1 + q), +-(1 + q + q^2)... are spread over the new range with
q in [1.01, 1.5] found by bisection so that the last one reaches the new largest offset, and the table is read
between them piecewise-linearly, each axis on its own, constant beyond the ends.
"""

from __future__ import annotations

import torch

from .._validate import same_size
from .learned import resize_bicubic


def resize_bias_table(table: torch.Tensor, old_grid: tuple[int, int], new_grid: tuple[int, int]) -> torch.Tensor:
    """[(2H-1)(2W-1), heads] -> [(2H'-1)(2W'-1), heads], bicubic over the (dy, dx) plane."""
    if same_size(old_grid, new_grid):
        return table  # bicubic at the same size returns the table exactly; this only skips the work
    (h, w), (h2, w2) = old_grid, new_grid
    heads = table.shape[-1]
    plane = table.T.reshape(1, heads, 2 * h - 1, 2 * w - 1).float()
    out = resize_bicubic(plane, (2 * h2 - 1, 2 * w2 - 1))
    return out.reshape(heads, -1).T.to(table.dtype)


RESIZE: tuple[str, ...] = ("bicubic", "geometric")


def _bisection_steps(low: float, high: float, tolerance: float) -> int:
    """How many halvings BEiT's bisection makes: the interval shrinks alike whichever half is kept."""
    steps = 0
    while high - low > tolerance:
        high, steps = (low + high) / 2.0, steps + 1
    return steps


GEOMETRIC_RANGE: tuple[float, float] = (1.01, 1.5)  # where BEiT's bisection looks for the ratio q
GEOMETRIC_STEPS: int = _bisection_steps(*GEOMETRIC_RANGE, 1e-6)


def geometric_points(n: int, reach: torch.Tensor) -> torch.Tensor:
    """BEiT's resize: where the offsets -n..n of a table axis go on an axis whose largest offset is ``reach``
    (a 0-dim float64 tensor): 0, +-1, +-(1 + q), ... +-(1 + q + ... + q^(n-1)), q by bisection so that the
    sum of n terms ends next to ``reach``. [2n + 1] float64, ascending."""
    low, high = (torch.full((), v, dtype=torch.float64, device=reach.device) for v in GEOMETRIC_RANGE)
    q = low
    for _ in range(GEOMETRIC_STEPS):
        q = (low + high) / 2.0
        over = (1.0 - q**n) / (1.0 - q) > reach  # the n-term geometric sum overshoots the new reach
        high, low = torch.where(over, q, high), torch.where(over, low, q)
    outward = (q ** torch.arange(n, dtype=torch.float64, device=reach.device)).cumsum(0)  # [n]: 1, 1 + q, ...
    return torch.cat((-outward.flip(0), outward.new_zeros(1), outward))


def linear_weights(points: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Piecewise-linear interpolation from values at ascending ``points`` [M] to positions ``at`` [T], constant
    beyond the ends, as a matrix [T, M] (each row sums to 1): hat functions on the points."""
    x = torch.minimum(torch.maximum(at, points[0]), points[-1])[:, None]  # [T, 1], clamped to the points
    before = torch.cat((points[:1] - 1.0, points[:-1]))  # [M]: each point's left neighbour (a unit step at the end)
    after = torch.cat((points[1:], points[-1:] + 1.0))
    rise, fall = (x - before) / (points - before), (after - x) / (after - points)  # [T, M]
    return torch.minimum(rise, fall).clamp(0.0, 1.0)


def resize_bias_table_geometric(
    table: torch.Tensor, old_grid: tuple[int, int], new_grid: tuple[int, int]
) -> torch.Tensor:
    """[(2H-1)(2W-1), heads] -> [(2H'-1)(2W'-1), heads] by BEiT's rule (timm's ``resize_rel_pos_bias_table``):
    each axis's old offsets at ``geometric_points``, read at the new integer offsets; both axes are respread
    when either size changes, and the table is returned as it is on the same grid (also in an exported program,
    whose sizes are unknown when it is traced: there the integer points are chosen by value)."""
    if same_size(old_grid, new_grid):
        return table
    (h, w), (h2, w2) = old_grid, new_grid
    f64 = dict(dtype=torch.float64, device=table.device)
    targets = [torch.arange(-(s - 1), s, **f64) for s in (h2, w2)]  # [2H'-1], [2W'-1]: the new offsets
    same = (targets[0][-1] == h - 1) & (targets[1][-1] == w - 1)
    weights = []
    for n, target in zip((h - 1, w - 1), targets, strict=True):
        points = torch.where(same, torch.arange(-n, n + 1, **f64), geometric_points(n, target[-1]))
        weights.append(linear_weights(points.float(), target.float()))  # fp32, as timm interpolates
    heads = table.shape[-1]
    plane = table.T.reshape(heads, 2 * h - 1, 2 * w - 1).float()
    out = torch.einsum("ai,hij,bj->hab", weights[0], plane, weights[1])  # [heads, 2H'-1, 2W'-1]
    return out.reshape(heads, -1).T.to(table.dtype)


def resize_table(
    table: torch.Tensor, old_grid: tuple[int, int], new_grid: tuple[int, int], rule: str = "bicubic"
) -> torch.Tensor:
    """A per-offset table [(2H-1)(2W-1), heads] at ``new_grid`` by ``rule`` (``RESIZE``)."""
    if rule == "geometric":
        return resize_bias_table_geometric(table, old_grid, new_grid)
    return resize_bias_table(table, old_grid, new_grid)
