"""Learned relative position biases on the attention logits: Swin's table and SwinV2's continuous MLP.

Both return a bias [heads, H*W, H*W] for the patch tokens of a grid; prefix tokens get zero bias from
the caller (see ``vispos.attention``), or BEiT's three learned entries (``prefix_entries``).

relbias2d's table goes to another grid by one of the rules of ``relbias_resize`` (``resize``).

cpb2d's MLP reads the offsets (dy, dx) in one of two forms (``coords``):

- ``"swin"`` (SwinV2): t = 8 d / (G - 1) per axis, G the training grid (``offset_scale="train"``) or the grid
  at hand (``"grid"``, timm's ``RelPosMlp(mode="swin")`` without a pretrained window); sign(t) log2(1 + |t|) / 3.
- ``"log"`` (timm's ``RelPosMlp(mode="cr")``): sign(d) ln(1 + |d|) in patch units, the same at every grid.

and gives the bias as ``max_bias * sigmoid(mlp)`` (``output="sigmoid"``, SwinV2) or the MLP's output itself
(``output="linear"``, timm's "cr").
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._state import decode, encode
from .._validate import check_bool, check_choice, check_float, check_grid, check_int
from ..registry import register
from .relbias_resize import RESIZE, resize_table


def relative_offsets_2d(grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
    """Offsets (dy, dx) = p_query - p_key for every pair of patches: [HW, HW, 2], row-major."""
    h, w = grid
    yy, xx = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    coords = torch.stack((yy.flatten(), xx.flatten()), dim=-1)  # [HW, 2]
    return coords[:, None, :] - coords[None, :, :]


def relative_index_2d(grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
    """Swin's rule: index = (dy + H - 1) * (2W - 1) + (dx + W - 1), into a (2H-1)(2W-1) table. [HW, HW]."""
    h, w = grid
    rel = relative_offsets_2d(grid, device)
    return (rel[..., 0] + h - 1) * (2 * w - 1) + (rel[..., 1] + w - 1)


def offsets_2d(grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
    """Every offset (dy, dx) between two patches of the grid: [2H-1, 2W-1, 2], from (-(H-1), -(W-1))."""
    h, w = grid
    dy, dx = torch.arange(-(h - 1), h, device=device), torch.arange(-(w - 1), w, device=device)
    return torch.stack(torch.meshgrid(dy, dx, indexing="ij"), dim=-1)


def bias_from_offsets(per_offset: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """A relative bias given per offset, [heads, 2H-1, 2W-1], for every pair of patches: [heads, HW, HW]."""
    return per_offset.flatten(1)[:, relative_index_2d(grid, per_offset.device)]


def prefixed_offset_index(
    grid: tuple[int, int], num_prefix_tokens: int, device: torch.device | None = None
) -> torch.Tensor:
    """Where each (query, key) pair of P prefix + H*W patch tokens reads its bias: [P+HW, P+HW] int32.

    Patch pairs read Swin's index of their offset among the T = (2H-1)(2W-1) per-offset values; pairs
    with a prefix token read one of three entries after them: T (prefix -> patch), T + 1 (patch ->
    prefix), T + 2 (prefix -> prefix), BEiT's order. int32 keeps the index at 1 / heads of the fp32 mask
    it gathers (``bias_mask``), which is then built in one step, prefix rows and columns included.
    """
    h, w = grid
    p = num_prefix_tokens
    i32 = dict(device=device, dtype=torch.int32)
    yy, xx = torch.meshgrid(torch.arange(h, **i32), torch.arange(w, **i32), indexing="ij")
    zeros = torch.zeros(p, **i32)  # prefix tokens get placeholder coordinates, replaced below
    ys, xs = torch.cat((zeros, yy.flatten())), torch.cat((zeros, xx.flatten()))
    index = (ys[:, None] - ys[None, :] + (h - 1)) * (2 * w - 1) + (xs[:, None] - xs[None, :] + (w - 1))
    if p == 0:
        return index
    t = torch.full((), (2 * h - 1) * (2 * w - 1), **i32)
    prefix = torch.arange(p + h * w, device=device) < p
    query, key = prefix[:, None], prefix[None, :]
    return torch.where(query, torch.where(key, t + 2, t), torch.where(key, t + 1, index))


def bias_mask(per_offset: torch.Tensor, entries: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor:
    """Per-offset values [heads, 2H-1, 2W-1] and prefix entries [3, heads] (None: zero) gathered by a
    ``prefixed_offset_index`` into the bias of every token pair, [heads, P+HW, P+HW]."""
    values = with_prefix_entries(per_offset, entries)
    return values.index_select(1, index.flatten()).view(per_offset.shape[0], *index.shape)


def with_prefix_entries(per_offset: torch.Tensor, entries: torch.Tensor | None) -> torch.Tensor:
    """Per-offset values [heads, ...] and prefix entries [3, heads] (None: zero) -> [heads, V + 3], the table
    a ``prefixed_offset_index`` (or a ragged batch's offset index) reads."""
    extra = per_offset.new_zeros(per_offset.shape[0], 3) if entries is None else entries.T.to(per_offset.dtype)
    return torch.cat((per_offset.flatten(1), extra), dim=1)


def prefix_bias(num_heads: int, num_prefix_tokens: int, prefix_entries: bool) -> nn.Parameter | None:
    """BEiT's three extra entries per head, [3, heads]: prefix->patch, patch->prefix, prefix->prefix (shared by
    every prefix token). Zero at the start, as the prefix rows and columns are without them; without them a
    token-pooled model's last-layer bias would never reach its output (and never learn)."""
    check_int("num_prefix_tokens", num_prefix_tokens, minimum=0)
    if not check_bool("prefix_entries", prefix_entries) or num_prefix_tokens == 0:
        return None
    return nn.Parameter(torch.zeros(3, num_heads))


class OffsetBias(nn.Module):
    """The call of a bias given per offset: ``offset_bias(grid, device)`` [heads, 2H-1, 2W-1], ``pair_bias(offsets)``
    at any offsets (dy, dx) [..., 2] -> [heads, ...], and BEiT's ``prefix_bias`` [3, heads] if the scheme has it.

    The host reads them through the call, never as attributes: hooks that bring a module's weights in around its
    own call (accelerate's ``cpu_offload`` / ``disk_offload``, device maps with offloading) then see every read.

    - ``module(grid, device)``: the bias of every pair of patches, [heads, HW, HW];
    - ``module(grid, device, per_offset=True)``: (``offset_bias``, ``prefix_bias`` or None);
    - ``module(offsets=offsets)``: (``pair_bias(offsets)``, ``prefix_bias`` or None)."""

    def forward(
        self,
        grid: tuple[int, int] | None = None,
        device: torch.device | None = None,
        *,
        per_offset: bool = False,
        offsets: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        entries = getattr(self, "prefix_bias", None)
        if entries is not None:  # a view, not the parameter itself: a forward's outputs are results (module hooks
            entries = entries.view_as(entries)  # such as torch's ModuleTracker hook the outputs' autograd nodes)
        if offsets is not None:
            return self.pair_bias(offsets), entries
        values = self.offset_bias(check_grid(grid), device)  # [heads, 2H-1, 2W-1]
        return (values, entries) if per_offset else bias_from_offsets(values, check_grid(grid))


class RelativeBias2d(OffsetBias):
    """What the relative biases share: heads, the training grid and BEiT's prefix entries
    (``prefix_entries``, on by default where the model has prefix tokens)."""

    def __init__(
        self, num_heads: int, train_grid: tuple[int, int], num_prefix_tokens: int, prefix_entries: bool
    ) -> None:
        super().__init__()
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.train_grid = check_grid(train_grid, "train_grid")
        self.prefix_bias = prefix_bias(self.num_heads, num_prefix_tokens, prefix_entries)


@register(
    "relbias2d",
    ndim=2,
    kind="bias",
    trainable=True,
    relative=True,
    context=("num_heads", "train_grid", "num_prefix_tokens"),
    per_layer=True,
    summary="Swin relative position bias: a ((2H-1)(2W-1), heads) table",
    extrapolation="table resized (bicubic) to the new grid",
    reference="Liu et al. 2021 (Swin)",
)
class RelBias2d(RelativeBias2d):
    """Swin relative position bias: one learned scalar per head for each (dy, dx) of the training grid;
    other grids resize the table bicubically over the (dy, dx) plane (``resize="geometric"``: BEiT's rule).
    One table per layer, or one shared by every layer (``per_layer=False``, BEiT's shared bias)."""

    def __init__(self, *, num_heads: int, train_grid: tuple[int, int] = (14, 14), num_prefix_tokens: int = 0,
                 prefix_entries: bool = True, init_std: float = 0.02, resize: str = "bicubic",
                 per_layer: bool = True) -> None:  # fmt: skip
        super().__init__(num_heads, train_grid, num_prefix_tokens, prefix_entries)
        init_std = check_float("init_std", init_std, minimum=0.0)
        self.resize = check_choice("resize", resize, RESIZE)
        self.per_layer = check_bool("per_layer", per_layer)  # read by the host (one module per layer, or one)
        h, w = self.train_grid
        self.table = nn.Parameter(torch.zeros((2 * h - 1) * (2 * w - 1), self.num_heads))
        nn.init.trunc_normal_(self.table, std=init_std)

    def offset_bias(self, grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
        """-> [heads, 2H-1, 2W-1], one value per offset; the table is resized when ``grid`` differs from training."""
        h, w = check_grid(grid)
        table = resize_table(self.table, self.train_grid, (h, w), self.resize)
        return table.T.reshape(self.num_heads, 2 * h - 1, 2 * w - 1)

    def resample_state(
        self, state: dict[str, torch.Tensor], prefix: str, old_grid: tuple[int, int], new_grid: tuple[int, int]
    ) -> None:
        """Loading a checkpoint made at ``old_grid``: its table, resized to this module's grid (its ``resize`` rule)."""
        key = f"{prefix}table"
        if key in state:
            state[key] = resize_table(state[key], old_grid, new_grid, self.resize)


def log_spaced_offsets(grid: tuple[int, int], train_grid: tuple[int, int], device: torch.device | None = None):
    """SwinV2's inputs: (dy, dx) / (train size - 1) * 8, then sign * log2(1 + |t|) / log2(8). [2H-1, 2W-1, 2]."""
    h, w = grid
    dy = torch.arange(-(h - 1), h, device=device, dtype=torch.float32) / max(train_grid[0] - 1, 1)
    dx = torch.arange(-(w - 1), w, device=device, dtype=torch.float32) / max(train_grid[1] - 1, 1)
    table = torch.stack(torch.meshgrid(dy, dx, indexing="ij"), dim=-1) * 8
    return torch.sign(table) * torch.log2(table.abs() + 1.0) / math.log2(8)


def log_spaced(offsets: torch.Tensor, train_grid: tuple[int, int]) -> torch.Tensor:
    """``log_spaced_offsets``'s map at any offsets (dy, dx) [..., 2] (fp32), possibly fractional."""
    den = torch.tensor([max(train_grid[0] - 1, 1), max(train_grid[1] - 1, 1)], device=offsets.device)
    t = offsets.float() / den * 8
    return torch.sign(t) * torch.log2(t.abs() + 1.0) / math.log2(8)


def log_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """timm's "cr" log coordinates: sign(d) ln(1 + |d|) of offsets (dy, dx) [..., 2] in patch units (fp32)."""
    d = offsets.float()
    return torch.sign(d) * torch.log1p(d.abs())


COORDS = ("swin", "log")
OFFSET_SCALES = ("train", "grid")
OUTPUTS = ("sigmoid", "linear")


@register(
    "cpb2d",
    ndim=2,
    kind="bias",
    trainable=True,
    relative=True,
    context=("num_heads", "train_grid", "num_prefix_tokens"),
    per_layer=True,
    summary="SwinV2 continuous bias: MLP on log-spaced (dy, dx), 16 sigmoid",
    extrapolation="continuous: the MLP is evaluated at new offsets",
    reference="Liu et al. 2022 (Swin V2)",
)
class ContinuousBias2d(RelativeBias2d):
    """SwinV2 continuous position bias: an MLP on log-spaced (dy, dx), 16 * sigmoid. Extrapolates by design.

    Offsets are normalised by ``offset_grid``: the training grid, or, once a checkpoint made at another
    grid is loaded, that checkpoint's grid (SwinV2's ``pretrained_window_size``), so the MLP keeps the
    inputs it learned on; it travels with the weights. ``offset_scale="grid"`` normalises by the grid at
    hand instead; ``coords="log"`` takes timm's size-free log coordinates (module docstring).

    The MLP is Linear(2, hidden) -> ReLU -> (``dropout`` on the hidden units, training only) ->
    Linear(hidden, heads), with a bias on the output layer if ``out_bias``; ``per_layer=False``: one MLP for
    the whole network (timm's ``shared_rel_pos``)."""

    def __init__(self, *, num_heads: int, train_grid: tuple[int, int] = (14, 14), num_prefix_tokens: int = 0,
                 prefix_entries: bool = True, hidden: int = 512, max_bias: float = 16.0, coords: str = "swin",
                 offset_scale: str = "train", output: str = "sigmoid", out_bias: bool = False, dropout: float = 0.0,
                 per_layer: bool = True) -> None:  # fmt: skip
        super().__init__(num_heads, train_grid, num_prefix_tokens, prefix_entries)
        self.max_bias = check_float("max_bias", max_bias, positive=True)
        hidden = check_int("hidden", hidden, minimum=1)
        self.coords = check_choice("coords", coords, COORDS)
        self.offset_scale = check_choice("offset_scale", offset_scale, OFFSET_SCALES)
        self.output = check_choice("output", output, OUTPUTS)
        check_bool("out_bias", out_bias)
        self.per_layer = check_bool("per_layer", per_layer)  # read by the host (one MLP per layer, or one)
        dropout = check_float("dropout", dropout, minimum=0.0)
        if dropout >= 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if self.coords == "log" and self.offset_scale != "train":
            raise ValueError("offset_scale sets the grid that scales coords='swin' offsets; coords='log' is in patch "
                             "units at every grid: leave offset_scale at 'train'")  # fmt: skip
        if self.output == "linear" and self.max_bias != 16.0:
            raise ValueError("max_bias bounds output='sigmoid' (max_bias * sigmoid); output='linear' is the MLP's "
                             "output, unbounded: leave max_bias at 16.0")  # fmt: skip
        act: nn.Module = nn.ReLU(inplace=True)
        if dropout > 0:  # inside the activation's slot: the weights keep their keys (mlp.0, mlp.2)
            act = nn.Sequential(act, nn.Dropout(dropout))
        self.mlp = nn.Sequential(nn.Linear(2, hidden), act, nn.Linear(hidden, num_heads, bias=out_bias))
        self.offset_grid = self.train_grid

    def get_extra_state(self) -> torch.Tensor:
        return encode({"offset_grid": list(self.offset_grid)})

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.offset_grid = check_grid(tuple(decode(state)["offset_grid"]), "offset_grid")

    def _inputs(self, offsets: torch.Tensor, grid: tuple[int, int] | None) -> torch.Tensor:
        """Offsets (dy, dx) [..., 2] -> the MLP's inputs [..., 2] (fp32); ``grid``: the grid at hand."""
        if self.coords == "log":
            return log_offsets(offsets)
        if self.offset_scale == "train":
            return log_spaced(offsets, self.offset_grid)
        if grid is None:
            raise ValueError("cpb2d(offset_scale='grid') scales offsets by the grid of the tokens, which fractional "
                             "points have not; use offset_scale='train' or coords='log'")  # fmt: skip
        return log_spaced(offsets, grid)

    def _bias(self, raw: torch.Tensor) -> torch.Tensor:
        """The MLP's output -> the bias (fp32)."""
        raw = raw.float()
        return self.max_bias * torch.sigmoid(raw) if self.output == "sigmoid" else raw

    def offset_bias(self, grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
        """-> [heads, 2H-1, 2W-1] fp32, one value per offset: the MLP evaluated at the offsets of ``grid``."""
        grid = check_grid(grid)
        weight = self.mlp[0].weight  # its dtype (on the meta device between calls when offloaded: not its device)
        device = weight.device if device is None else device
        if self.coords == "swin":  # SwinV2's table, built as it builds it
            scale = self.offset_grid if self.offset_scale == "train" else grid
            inputs = log_spaced_offsets(grid, scale, device)
        else:
            inputs = log_offsets(offsets_2d(grid, device))
        return self._bias(self.mlp(inputs.to(weight.dtype)).permute(2, 0, 1))  # [heads, 2H-1, 2W-1]

    def pair_bias(self, offsets: torch.Tensor) -> torch.Tensor:
        """The bias at offsets (dy, dx) = query - key [..., 2] in patch units, possibly fractional ->
        [heads, ...] fp32: the MLP at their log-spaced form, as at the offsets of a grid."""
        weight = self.mlp[0].weight
        return self._bias(self.mlp(self._inputs(offsets, None).to(weight.dtype)).movedim(-1, 0))
