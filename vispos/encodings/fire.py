"""FIRE (Li et al., ICLR 2024): a learned function of the log-transformed relative distance, normalised so that
longer inputs are interpolated into the range seen in training ("progressive interpolation").

1D, as FIRE defines it, for a query at position i and a key at j:

    b_h(i, j) = MLP(psi(i - j) / (psi(max(i, L)) + eps))_h,   psi(x) = log(|c x| + 1)

with the MLP 1 -> ``mlp_width`` -> heads (ReLU), c learned (init ``init_c`` 0.1) and the threshold
L = |L_multiplier * ``threshold``| (512, its multiplier learned from 1 unless ``learn_threshold=False``); the
threshold keeps short prefixes from being stretched. Queries past L normalise by their own position, so the
bias is relative only among queries before L. Parameter names follow the copy of FIRE in common use
(``c``, ``init_L``, ``L_multiplier``, ``mlp``), so its weights load as they are.

2D (``fire2d``; no source defines one, so vispos does): the offsets (dy, dx) = query - key are transformed and
normalised per axis, keeping their signs (attention over an image sees both sides of a query),

    u_a = sign(d_a) psi(d_a) / (psi(max(G_a - 1, L)) + eps),   a in (y, x)

with G_a the grid's size along the axis (its largest offset G_a - 1 plays the role of FIRE's query position,
the farthest key a query sees), and b_h = MLP(u_y, u_x)_h with the MLP 2 -> ``mlp_width`` -> heads. Inputs lie in
[-1, 1] on every grid: a grid larger than the threshold is interpolated into the training range, FIRE's rule.
The threshold is in patches, by default the training grid's longest extent max(H, W) - 1: at initialisation
relative at and below the training grid, interpolated beyond it. The threshold is learned by default
(``L_multiplier``, as FIRE's), so training moves the grid size up to which the bias stays relative;
``learn_threshold=False`` holds it at the training grid. Prefix tokens take BEiT's learned entries
(``prefix_entries``), as the other learned biases.
"""

from __future__ import annotations

import torch
from torch import nn

from .._validate import check_bool, check_float, check_grid, check_int, check_positions
from ..registry import register
from .alibi import causal_mask
from .relbias import RelativeBias2d, offsets_2d


def log_distance(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """FIRE's psi: log(|c x| + 1), elementwise (fp32)."""
    return torch.log((c * x).abs() + 1)


class FireParameters(nn.Module):
    """What FIRE's 1D and 2D forms share: the MLP, c, and the threshold L = |L_multiplier * init_L|."""

    def __init__(self, inputs: int, num_heads: int, mlp_width: int, init_c: float, threshold: float,
                 learn_threshold: bool, eps: float) -> None:  # fmt: skip
        super().__init__()
        width = check_int("mlp_width", mlp_width, minimum=1)
        self.mlp = nn.Sequential(nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, num_heads))
        self.c = nn.Parameter(torch.tensor(check_float("init_c", init_c, positive=True)))
        self.register_buffer("init_L", torch.tensor(check_float("threshold", threshold, positive=True)))
        one = torch.tensor(1.0)
        if check_bool("learn_threshold", learn_threshold):
            self.L_multiplier = nn.Parameter(one)
        else:
            self.register_buffer("L_multiplier", one)
        self.eps = check_float("eps", eps, positive=True)

    @property
    def threshold(self) -> torch.Tensor:
        """L = |L_multiplier * init_L| (0-dim fp32)."""
        return (self.L_multiplier * self.init_L).abs().float()

    def heads(self, inputs: torch.Tensor) -> torch.Tensor:
        """MLP over normalised inputs [..., k] -> [heads, ...] fp32."""
        weight = self.mlp[0].weight
        return self.mlp(inputs.to(weight.dtype)).float().movedim(-1, 0)


@register(
    "fire",
    ndim=1,
    kind="bias",
    trainable=True,
    relative=False,
    context=("num_heads", "causal"),
    summary="FIRE: MLP of log distance over log max(query position, L), equal to the copy in use (tested)",
    extrapolation="holds to 4x the training length on passkey, 96% at 8x (docs/seq1d.md); past the threshold L "
    "(512 tokens), distances over the query's position (progressive interpolation)",
    reference="Li et al. 2024 (FIRE)",
)
class Fire(FireParameters):
    """FIRE on token positions (module docstring). ``causal=True`` also masks later keys."""

    def __init__(self, *, num_heads: int, mlp_width: int = 32, init_c: float = 0.1, threshold: float = 512.0,
                 learn_threshold: bool = True, eps: float = 1e-6, causal: bool = False) -> None:  # fmt: skip
        check_int("num_heads", num_heads, minimum=1)
        super().__init__(1, num_heads, mlp_width, init_c, threshold, learn_threshold, eps)
        self.num_heads = num_heads
        self.causal = check_bool("causal", causal)

    def forward(self, positions: torch.Tensor | int) -> torch.Tensor:
        """positions [N] or [B, N] (or a length) -> [(B,) heads, N, N] fp32."""
        positions = check_positions(positions).to(self.c.device).float()
        distance = positions[..., :, None] - positions[..., None, :]  # query - key, [(B,) N, N]
        normaliser = torch.maximum(positions, self.threshold)[..., :, None]  # the query's, [(B,) N, 1]
        inputs = log_distance(distance, self.c) / (log_distance(normaliser, self.c) + self.eps)
        bias = self.heads(inputs[..., None])  # [heads, (B,) N, N]
        if positions.dim() == 2:
            bias = bias.transpose(0, 1)
        if self.causal:
            bias = bias + causal_mask(positions.shape[-1], positions.device)
        return bias


class FireOffsets(FireParameters):
    """FIRE's parameters in 2D: the bias of every offset of a grid, computed in this module's own call (where
    offloading hooks bring its weights in)."""

    def inputs(self, offsets: torch.Tensor, extent: torch.Tensor) -> torch.Tensor:
        """Offsets (dy, dx) [..., 2] on a grid whose largest offsets are ``extent`` (H - 1, W - 1) -> the MLP's
        inputs [..., 2] fp32, in [-1, 1]."""
        normaliser = log_distance(torch.maximum(extent.float(), self.threshold), self.c) + self.eps  # [2]
        offsets = offsets.float()
        return torch.sign(offsets) * log_distance(offsets, self.c) / normaliser

    def forward(self, grid: tuple[int, int]) -> torch.Tensor:
        """-> [heads, 2H-1, 2W-1] fp32, one value per offset (dy, dx) = query - key."""
        offsets = offsets_2d(check_grid(grid), self.c.device)  # [2H-1, 2W-1, 2]
        extent = offsets[-1, -1]  # (H - 1, W - 1), read off the offsets: sizes stay symbolic under export
        return self.heads(self.inputs(offsets, extent))


@register(
    "fire2d",
    ndim=2,
    kind="bias",
    trainable=True,
    relative=True,
    context=("num_heads", "train_grid", "num_prefix_tokens"),
    per_layer=True,
    summary="FIRE in 2D, vispos's form (no source defines one): MLP of signed log (dy, dx), each over the log of "
    "max(grid extent, L)",
    extrapolation="relative up to the threshold L (at init the training grid; learned unless learn_threshold=False); "
    "beyond it interpolated: offsets over the grid's extent, inputs in [-1, 1] (tested)",
    reference="Li et al. 2024 (FIRE), 2D form defined by vispos",
)
class Fire2d(RelativeBias2d):
    """FIRE on the patch grid, vispos's 2D form (module docstring); relative within each grid. ``threshold``
    None: the training grid's longest extent, max(H, W) - 1, so that at initialisation the bias is relative at and
    below the training grid and interpolated beyond it; with ``learn_threshold`` (default) training moves it."""

    # read by the host: a ragged batch of fractional points is refused with this reason
    cells_only = "its offsets are normalised by their image's grid, which a point between cells does not give"

    def __init__(self, *, num_heads: int, train_grid: tuple[int, int] = (14, 14), num_prefix_tokens: int = 0,
                 prefix_entries: bool = True, mlp_width: int = 32, init_c: float = 0.1, threshold: float | None = None,
                 learn_threshold: bool = True, eps: float = 1e-6) -> None:  # fmt: skip
        super().__init__(num_heads, train_grid, num_prefix_tokens, prefix_entries)
        if threshold is None:
            threshold = float(max(max(self.train_grid) - 1, 1))
        self.fire = FireOffsets(2, self.num_heads, mlp_width, init_c, threshold, learn_threshold, eps)

    def offset_bias(self, grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
        """-> [heads, 2H-1, 2W-1] fp32, one value per offset (dy, dx) = query - key."""
        return self.fire(check_grid(grid))
