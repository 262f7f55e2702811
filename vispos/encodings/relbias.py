"""Learned relative position biases on the attention logits: Swin's table and SwinV2's continuous MLP.

Both return a bias [heads, H*W, H*W] for the patch tokens of a grid; prefix tokens get zero bias from
the caller (see ``vispos.attention``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._state import decode, encode
from .._validate import check_bool, check_float, check_grid, check_int, same_size
from ..registry import register
from .learned import resize_bicubic


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
    t = torch.tensor((2 * h - 1) * (2 * w - 1), **i32)
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


def resize_bias_table(table: torch.Tensor, old_grid: tuple[int, int], new_grid: tuple[int, int]) -> torch.Tensor:
    """[(2H-1)(2W-1), heads] -> [(2H'-1)(2W'-1), heads], bicubic over the (dy, dx) plane."""
    if same_size(old_grid, new_grid):
        return table  # bicubic at the same size returns the table exactly; this only skips the work
    (h, w), (h2, w2) = old_grid, new_grid
    heads = table.shape[-1]
    plane = table.T.reshape(1, heads, 2 * h - 1, 2 * w - 1).float()
    out = resize_bicubic(plane, (2 * h2 - 1, 2 * w2 - 1))
    return out.reshape(heads, -1).T.to(table.dtype)


def prefix_bias(num_heads: int, num_prefix_tokens: int, prefix_entries: bool) -> nn.Parameter | None:
    """BEiT's three extra entries per head, [3, heads]: prefix->patch, patch->prefix, prefix->prefix (shared by
    every prefix token). Zero at the start, as the prefix rows and columns are without them; without them a
    token-pooled model's last-layer bias would never reach its output (and never learn)."""
    check_int("num_prefix_tokens", num_prefix_tokens, minimum=0)
    if not check_bool("prefix_entries", prefix_entries) or num_prefix_tokens == 0:
        return None
    return nn.Parameter(torch.zeros(3, num_heads))


class RelativeBias2d(nn.Module):
    """What the relative biases share: heads, the training grid and BEiT's prefix entries
    (``prefix_entries``, on by default where the model has prefix tokens)."""

    def __init__(
        self, num_heads: int, train_grid: tuple[int, int], num_prefix_tokens: int, prefix_entries: bool
    ) -> None:
        super().__init__()
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.train_grid = check_grid(train_grid, "train_grid")
        self.prefix_bias = prefix_bias(self.num_heads, num_prefix_tokens, prefix_entries)


@register("relbias2d", ndim=2, kind="bias", trainable=True, relative=True, context=("num_heads", "train_grid",
    "num_prefix_tokens"), per_layer=True, summary="Swin relative position bias: a ((2H-1)(2W-1), heads) table",
    extrapolation="table resized (bicubic) to the new grid", reference="Liu et al. 2021 (Swin)")
class RelBias2d(RelativeBias2d):
    """Swin relative position bias: one learned scalar per head for each (dy, dx) of the training grid;
    other grids resize the table bicubically over the (dy, dx) plane."""

    def __init__(self, *, num_heads: int, train_grid: tuple[int, int] = (14, 14), num_prefix_tokens: int = 0,
                 prefix_entries: bool = True, init_std: float = 0.02) -> None:  # fmt: skip
        super().__init__(num_heads, train_grid, num_prefix_tokens, prefix_entries)
        init_std = check_float("init_std", init_std, minimum=0.0)
        h, w = self.train_grid
        self.table = nn.Parameter(torch.zeros((2 * h - 1) * (2 * w - 1), self.num_heads))
        nn.init.trunc_normal_(self.table, std=init_std)

    def offset_bias(self, grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
        """-> [heads, 2H-1, 2W-1], one value per offset; the table is resized when ``grid`` differs from training."""
        h, w = check_grid(grid)
        return resize_bias_table(self.table, self.train_grid, (h, w)).T.reshape(self.num_heads, 2 * h - 1, 2 * w - 1)

    def resample_state(
        self, state: dict[str, torch.Tensor], prefix: str, old_grid: tuple[int, int], new_grid: tuple[int, int]
    ) -> None:
        """Loading a checkpoint made at ``old_grid``: its table, resized to this module's grid (Swin's rule)."""
        key = f"{prefix}table"
        if key in state:
            state[key] = resize_bias_table(state[key], old_grid, new_grid)

    def forward(self, grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
        """-> [heads, HW, HW]."""
        return bias_from_offsets(self.offset_bias(grid, device), check_grid(grid))


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


@register("cpb2d", ndim=2, kind="bias", trainable=True, relative=True, context=("num_heads", "train_grid",
    "num_prefix_tokens"), per_layer=True, summary="SwinV2 continuous bias: MLP on log-spaced (dy, dx), 16 sigmoid",
    extrapolation="continuous: the MLP is evaluated at new offsets", reference="Liu et al. 2022 (Swin V2)")
class ContinuousBias2d(RelativeBias2d):
    """SwinV2 continuous position bias: an MLP on log-spaced (dy, dx), 16 * sigmoid. Extrapolates by design.

    Offsets are normalised by ``offset_grid``: the training grid, or, once a checkpoint made at another
    grid is loaded, that checkpoint's grid (SwinV2's ``pretrained_window_size``), so the MLP keeps the
    inputs it learned on; it travels with the weights."""

    def __init__(self, *, num_heads: int, train_grid: tuple[int, int] = (14, 14), num_prefix_tokens: int = 0,
                 prefix_entries: bool = True, hidden: int = 512, max_bias: float = 16.0) -> None:  # fmt: skip
        super().__init__(num_heads, train_grid, num_prefix_tokens, prefix_entries)
        self.max_bias = check_float("max_bias", max_bias, positive=True)
        hidden = check_int("hidden", hidden, minimum=1)
        self.mlp = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, num_heads, bias=False))
        self.offset_grid = self.train_grid

    def get_extra_state(self) -> torch.Tensor:
        return encode({"offset_grid": list(self.offset_grid)})

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.offset_grid = check_grid(tuple(decode(state)["offset_grid"]), "offset_grid")

    def offset_bias(self, grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
        """-> [heads, 2H-1, 2W-1] fp32, one value per offset: the MLP evaluated at the offsets of ``grid``."""
        weight = self.mlp[0].weight
        inputs = log_spaced_offsets(check_grid(grid), self.offset_grid, weight.device).to(weight.dtype)
        return self.max_bias * torch.sigmoid(self.mlp(inputs).permute(2, 0, 1).float())  # [heads, 2H-1, 2W-1]

    def pair_bias(self, offsets: torch.Tensor) -> torch.Tensor:
        """The bias at offsets (dy, dx) = query - key [..., 2] in patch units, possibly fractional ->
        [heads, ...] fp32: the MLP at their log-spaced form, as at the offsets of a grid."""
        weight = self.mlp[0].weight
        return self.max_bias * torch.sigmoid(self.mlp(log_spaced(offsets, self.offset_grid).to(weight.dtype))
                                             .movedim(-1, 0).float())  # fmt: skip

    def forward(self, grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
        """-> [heads, HW, HW] fp32."""
        return bias_from_offsets(self.offset_bias(grid, device), check_grid(grid))
