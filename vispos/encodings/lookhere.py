"""LookHere (Fuller et al., NeurIPS 2024): a fixed additive mask per layer and head, no learned positions.

Every head looks in one field of view and pays for distance:

    bias_h(q, k) = -g * s_layer * s_head * f(|p_k - p_q|)   when k lies in head h's field, else -M

with g the global slope, s_layer = linspace(a, b, depth)[layer], s_head the head's slope, f the Euclidean
patch distance (``distance``: as it is, its square root or its square) and M the largest bfloat16 (the
released code's stand-in for infinity, finite so that no row of softmax is all -inf). Prefix tokens (cls,
registers) get zero bias, in their rows and their columns.

Fields of view are named per group of heads and joined with ``-`` (``"corners-triangles-none"``, LH-90).
A group lists four fields, one per head of a block of four heads (offsets dy, dx = key - query, y down):

| group | its four fields (visible keys) |
| --- | --- |
| ``none`` | everywhere, x4 |
| ``zero`` | everywhere, no distance penalty, x4 |
| ``none1zero3`` / ``none2zero2`` / ``none3zero1`` | ``none`` then ``zero`` heads, 1 + 3, 2 + 2, 3 + 1 |
| ``halves`` | up (dy <= 0), down (dy >= 0), left (dx <= 0), right (dx >= 0) |
| ``corners`` | up-left, up-right, down-left, down-right (two halves at once) |
| ``triangles`` | 90 degrees around an axis: up (abs(dx) <= -dy), down, left, right |
| ``diagonals`` | two triangles: up or right, up or left, down or right, down or left |
| ``eighths1`` / ``eighths2`` | a triangle's left or right half (up, down) or upper or lower half (left, right) |
| ``zerohalves`` / ``zerocorners`` / ``zerotriangles`` | the fields of halves, corners, triangles, no distance |

Boundaries are inclusive, so every head sees its own token. A directional group's block of four fields looks
every way between them (for ``eighths1`` / ``eighths2``, the pair of them); fewer of its fields leave some
offsets to no head of it. The released code (``create_lh_layer_tensor``) deals heads in blocks of four, one head
per field, the blocks as evenly as possible with earlier groups first, and defines the splits it was run with: one
group over 4k heads, two to four groups over 12 and 16 heads (12 over two groups 8 + 4, 16 over three 8 + 4 + 4)
and 6 heads, which it splits 4 + 2 (the second group's first two fields; a third group gets none). vispos follows
those splits exactly (at 6 heads when the first group is directional, so that its block looks every way) and
extends the rule to any head count:

- ``num_heads // 4`` whole blocks are dealt as the released code deals them (6 heads: its 4 + 2 split), in the
  order listed, with two exceptions: when there are fewer blocks than groups the directional groups are dealt
  first, and a global group that takes the heads left over is dealt last;
- the ``num_heads % 4`` heads left over go to the first undirected group listed (``none``, ``zero``,
  ``noneNzeroM``: global heads, which need no block), or else take the first fields of the next group dealt;
- under 4 heads no block fits, so every head goes to the undirected groups: with none listed no split looks
  every way, and ``fields`` is refused.

So from 4 heads on the directional heads hold a whole block and together look every way, and a listed global
group gets a head whenever the heads outnumber the blocks (5, 7, 9 or more heads for ``corners-triangles-none``).
A group left without heads (4, 6 or 8 heads over three groups) is dropped with a ``UserWarning`` naming each
head's field.

Head slopes, per run of heads of one group name: directional groups 2^-(1 + j // 4) for the run's j-th head
(0.5 for the first four); groups without a field (``none``, ``zero``...) 1/4, 1/16, 1/64, 1/256, the first k
of them for k <= 4 heads, each repeated for more.

Masked keys: ``fill="inf"`` gives them -M; ``"zero"`` no penalty (only the distance heads' fields differ);
``"max"`` the penalty of the grid's largest distance (the paper's appendix ablations).

On a larger grid the mask is rebuilt with the same slopes over the longer distances (the released
``set_pos_embed``); nothing is resized. The released code holds the mask in bfloat16; here it is fp32.
"""

from __future__ import annotations

import warnings
from itertools import groupby

import torch

from .._validate import check_choice, check_float, check_grid, check_int
from ..registry import register
from .relbias import OffsetBias, offsets_2d

# bfloat16's largest value: the released code's "infinite" penalty (finite in fp32, bf16 and as a float mask).
MASKED = torch.finfo(torch.bfloat16).max

# One field of view = the directions whose half-planes or triangles must all contain the key; "zero" drops
# the distance penalty; "diag_a_b" is the union of triangles a and b.
_BLOCKS: dict[str, tuple[tuple[str, ...], ...]] = {
    "none": ((),) * 4,
    "zero": (("zero",),) * 4,
    "none1zero3": ((),) + (("zero",),) * 3,
    "none2zero2": ((),) * 2 + (("zero",),) * 2,
    "none3zero1": ((),) * 3 + (("zero",),),
    "halves": (("up",), ("down",), ("left",), ("right",)),
    "corners": (("up", "left"), ("up", "right"), ("down", "left"), ("down", "right")),
    "triangles": (("tri_up",), ("tri_down",), ("tri_left",), ("tri_right",)),
    "diagonals": (("diag_up_right",), ("diag_up_left",), ("diag_down_right",), ("diag_down_left",)),
    "eighths1": (("tri_up", "left"), ("tri_down", "left"), ("tri_left", "up"), ("tri_right", "up")),
    "eighths2": (("tri_up", "right"), ("tri_down", "right"), ("tri_left", "down"), ("tri_right", "down")),
    "zerohalves": (("zero", "up"), ("zero", "down"), ("zero", "left"), ("zero", "right")),
    "zerocorners": (("zero", "up", "left"), ("zero", "up", "right"), ("zero", "down", "left"),
                    ("zero", "down", "right")),
    "zerotriangles": (("zero", "tri_up"), ("zero", "tri_down"), ("zero", "tri_left"), ("zero", "tri_right")),
}  # fmt: skip
GROUPS: tuple[str, ...] = tuple(_BLOCKS)
DISTANCES = ("linear", "sqrt", "square")
FILLS = ("inf", "zero", "max")
_UNDIRECTED_SLOPES = (0.25, 0.0625, 0.015625, 0.00390625)


def _undirected(group: str) -> bool:
    """A group whose fields are all the whole grid (global heads: ``none``, ``zero``, ``noneNzeroM``)."""
    return all(set(view) <= {"zero"} for view in _BLOCKS[group])


def _split(groups: list[str], num_heads: int) -> list[str]:
    """Each head's group, in head order (module docstring: the released splits, extended to any count)."""
    blocks, left = divmod(num_heads, 4)
    if num_heads == 6 and len(groups) > 1 and not _undirected(groups[0]):  # the released split: 4 + 2 of the second
        return [groups[0]] * 4 + [groups[1]] * 2
    undirected = [i for i, g in enumerate(groups) if _undirected(g)]
    order = list(range(len(groups)))  # the dealing order: as listed, but for two turns
    if blocks < len(groups):  # not every group gets a block: the directional ones first
        order = [i for i in order if i not in undirected] + undirected
    if left and undirected:  # the global group that takes the heads left over is dealt its blocks last
        order = [i for i in order if i != undirected[0]] + [undirected[0]]
    share = [0] * len(groups)
    for turn, i in enumerate(order):
        share[i] = 4 * (blocks // len(groups) + (turn < blocks % len(groups)))
    if blocks == 0 and not undirected:
        raise ValueError(
            f"fields={'-'.join(groups)!r} on {num_heads} head(s): a directional group looks every way only with a "
            "block of four heads, one per field; under 4 heads use an undirected group ('none', 'zero', "
            "'none1zero3'...: global heads), or another scheme"
        )
    share[undirected[0] if undirected else order[blocks % len(groups)]] += left
    return [g for g, count in zip(groups, share, strict=True) for _ in range(count)]


def _field(view: tuple[str, ...]) -> str:
    """One head's field in words (warnings): "up & left", "up triangle", "everywhere (no distance)"."""
    parts = [d.replace("diag_", "").replace("_", " or ") + " triangles" if d.startswith("diag_")
             else d[4:] + " triangle" if d.startswith("tri_") else d for d in view if d != "zero"]  # fmt: skip
    return " & ".join(parts or ["everywhere"]) + (" (no distance)" if "zero" in view else "")


def head_layout(fields: str, num_heads: int) -> tuple[list[tuple[str, ...]], list[float]]:
    """Each head's field of view (a tuple of direction names) and slope, for ``fields`` such as
    ``"corners-triangles-none"`` (module docstring: whole blocks of four heads per directional group, the heads
    left over to a global group). A group left without heads is said with a ``UserWarning``."""
    if not isinstance(fields, str):
        raise TypeError(f"fields must be a str of groups joined with '-', got {type(fields).__name__} {fields!r}")
    groups = fields.split("-")
    if "center" in groups:
        raise ValueError("fields: 'center' (each key's distance to the grid's centre) is absolute, not a field of "
                         f"view; accepted groups, joined with '-': {', '.join(GROUPS)}")  # fmt: skip
    unknown = [g for g in groups if g not in _BLOCKS]
    if unknown:
        raise ValueError(f"fields: unknown group(s) {', '.join(map(repr, unknown))}; accepted, joined with '-': "
                         f"{', '.join(GROUPS)}")  # fmt: skip
    names = _split(groups, num_heads)
    views: list[tuple[str, ...]] = []
    for group, run in groupby(names):
        views += [_BLOCKS[group][j % 4] for j in range(len(list(run)))]
    dropped = [g for g in dict.fromkeys(groups) if g not in names]
    if dropped:
        heads = ", ".join(f"head {h}: {_field(v)} ({g})" for h, (g, v) in enumerate(zip(names, views, strict=True)))
        warnings.warn(
            f"lookhere2d: fields={fields!r} on {num_heads} head(s) gives {heads}; {', '.join(dropped)} get(s) no "
            "head (a directional group takes blocks of four heads, one per field): list fewer groups or use more heads",
            UserWarning,
            stacklevel=2,
        )
    slopes: list[float] = []
    for group, run in groupby(names):
        k = len(list(run))
        if any(word in group for word in ("none", "zero")):
            slopes += [_UNDIRECTED_SLOPES[j if k <= 4 else j * 4 // k] for j in range(k)]
        else:
            slopes += [2.0 ** -(1 + j // 4) for j in range(k)]
    return views, slopes


def _visible(direction: str, dy: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
    """Whether keys at offsets (dy, dx) = key - query lie in one direction's half-plane or triangle."""
    if direction.startswith("diag_"):
        _, a, b = direction.split("_")
        return _visible(f"tri_{a}", dy, dx) | _visible(f"tri_{b}", dy, dx)
    return {
        "up": lambda: dy <= 0,
        "down": lambda: dy >= 0,
        "left": lambda: dx <= 0,
        "right": lambda: dx >= 0,
        "tri_up": lambda: dx.abs() <= -dy,
        "tri_down": lambda: dx.abs() <= dy,
        "tri_left": lambda: dy.abs() <= -dx,
        "tri_right": lambda: dy.abs() <= dx,
    }[direction]()


def shaped(dist: torch.Tensor, distance: str) -> torch.Tensor:
    """A Euclidean distance as ``distance`` says: as it is, its square root or its square."""
    if distance == "sqrt":
        return dist.sqrt()
    return dist.square() if distance == "square" else dist


def lookhere_bias(
    offsets: torch.Tensor,
    views: list[tuple[str, ...]],
    slopes: list[float],
    *,
    distance: str = "linear",
    fill: str = "inf",
    largest: torch.Tensor | None = None,
) -> torch.Tensor:
    """The LookHere bias at offsets (dy, dx) = query - key [..., 2] in patch units -> [heads, ...] fp32.

    ``views``: each head's field of view (``head_layout``); ``slopes``: one per head, the product of the global,
    layer and head slopes. ``fill="max"`` needs ``largest``, the grid's largest distance (after ``distance``)."""
    d = -offsets.float()  # key - query
    dy, dx = d[..., 0], d[..., 1]
    dist = shaped(d.norm(dim=-1), distance)
    rows = []
    for view, slope in zip(views, slopes, strict=True):
        penalty = torch.zeros_like(dist) if "zero" in view else dist
        seen = torch.ones_like(dist, dtype=torch.bool)
        for direction in view:
            if direction != "zero":
                seen = seen & _visible(direction, dy, dx)
        if fill == "inf":
            rows.append(torch.where(seen, -slope * penalty, -MASKED))
            continue
        hidden = torch.zeros_like(dist) if fill == "zero" or "zero" in view else largest.expand_as(dist)
        rows.append(-slope * torch.where(seen, penalty, hidden))
    return torch.stack(rows)


@register(
    "lookhere2d",
    ndim=2,
    kind="bias",
    trainable=False,
    relative=True,
    context=("num_heads", "layer", "depth"),
    per_layer=True,
    summary="LookHere: per-head fields of view (keys outside masked), slope x layer x Euclidean distance penalty; "
    "LH-90 defaults, equal to the released code (tested)",
    extrapolation="mask rebuilt for the new grid: the same slopes over the longer distances (the released rule)",
    reference="Fuller et al. 2024 (LookHere)",
)
class LookHere2d(OffsetBias):
    """LookHere's mask for one layer (module docstring). Defaults: LH-90 as released (global slope 2, layer
    slopes from 1.5 to 0.5, ``"corners-triangles-none"``). ``head_slopes`` replaces the per-head slopes."""

    def __init__(self, *, num_heads: int, layer: int = 0, depth: int = 1, fields: str = "corners-triangles-none",
                 global_slope: float = 2.0, layer_slopes: tuple[float, float] = (1.5, 0.5),
                 head_slopes: tuple[float, ...] | None = None, distance: str = "linear",
                 fill: str = "inf") -> None:  # fmt: skip
        super().__init__()
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.depth = check_int("depth", depth, minimum=1)
        self.layer = check_int("layer", layer, minimum=0)
        if self.layer >= self.depth:
            raise ValueError(f"layer must be < depth ({self.depth}), got {self.layer}")
        self.global_slope = check_float("global_slope", global_slope, minimum=0.0)
        if not isinstance(layer_slopes, (list, tuple)) or len(layer_slopes) != 2:
            raise TypeError(f"layer_slopes must be a pair (first layer, last layer), got {layer_slopes!r}")
        first, last = (check_float(f"layer_slopes[{i}]", s, minimum=0.0) for i, s in enumerate(layer_slopes))
        self.distance = check_choice("distance", distance, DISTANCES)
        self.fill = check_choice("fill", fill, FILLS)
        self.views, slopes = head_layout(fields, self.num_heads)
        if head_slopes is not None:
            if not isinstance(head_slopes, (list, tuple)) or len(head_slopes) != self.num_heads:
                raise ValueError(f"head_slopes must list one slope per head ({self.num_heads}), got {head_slopes!r}")
            slopes = [check_float(f"head_slopes[{i}]", s, minimum=0.0) for i, s in enumerate(head_slopes)]
        self.layer_slope = torch.linspace(first, last, self.depth, dtype=torch.float64, device="cpu")[self.layer].item()
        # global x layer x head slope, per head: plain floats (constants to torch.compile), all set by options
        self.slopes = [self.global_slope * self.layer_slope * s for s in slopes]

    def _largest(self, grid: tuple[int, int], device: torch.device | None) -> torch.Tensor:
        """The grid's largest distance after ``distance`` (``fill="max"``), as a 0-dim fp32 tensor."""
        h, w = grid
        corner = torch.tensor([float(h - 1), float(w - 1)], device=device).norm()
        return shaped(corner, self.distance)

    def offset_bias(self, grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
        """-> [heads, 2H-1, 2W-1] fp32, one value per offset (dy, dx) = query - key."""
        grid = check_grid(grid)
        return lookhere_bias(
            offsets_2d(grid, device), self.views, self.slopes, distance=self.distance, fill=self.fill,
            largest=self._largest(grid, device) if self.fill == "max" else None,
        )  # fmt: skip

    @property
    def cells_only(self) -> str | None:
        """Why fractional points are refused (read by the host), or None."""
        if self.fill == "max":
            return "fill='max' penalises hidden keys by their image's largest distance; use fill='inf' or 'zero'"
        return None

    def pair_bias(self, offsets: torch.Tensor) -> torch.Tensor:
        """The bias at offsets (dy, dx) = query - key [..., 2] in patch units, possibly fractional -> [heads, ...]."""
        return lookhere_bias(offsets, self.views, self.slopes, distance=self.distance, fill=self.fill)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, layer={self.layer}/{self.depth}, slope={self.layer_slope:.4g}"
