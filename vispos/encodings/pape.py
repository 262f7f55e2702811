"""PaPE, parabolic position encoding (arXiv 2602.01418): a learned sum of parabolas in the offset, computed inside
fused attention by channels appended to q and k.

Each head h of a layer holds P parabolas (``parabolas``, released default 50). A token at point pos = (x, y) (patch
units, x the column) has one coordinate per parabola, u = W pos (a learned ``position`` projection [heads P, 2]
without bias, so u_i - u_j = W (pos_i - pos_j)); the query token's own input x_i (the attention's input, after the
block's norm) sets each parabola's curvature and slope, (a_raw, b) = A x_i (a learned ``ab`` projection
[2 heads P, width] without bias), a = softplus(a_raw) > 0. The logit of query i and key j is

    (q_i . k_j + sum_p [ -a_ip (u_ip - u_jp)^2 + b_ip (u_ip - u_jp) ]) / sqrt(d)

an upside-down parabola per direction p: a peak that the content of each query places and sharpens. The sum expands
into a dot product of 3P + 2 extra channels, so SDPA computes it in its own kernel, with no mask:

    q_i gains [ -sum_p a_ip u_ip^2, a_i1..a_iP, 2 a_i1 u_i1..2 a_iP u_iP, sum_p b_ip u_ip, b_i1..b_iP ]
    k_j gains [ 1,                  -u_j1^2..-u_jP^2, u_j1..u_jP,          1,               -u_j1..-u_jP ]

and both are padded with zeros to a multiple of ``pad_to`` channels (released: 8, for the kernels); the logit scale
stays 1 / sqrt(d) of the head width d, as the released attention passes it. The values keep their width.

Positions as released: patch (row r, column c) at (x, y) = (c + 1, r + 1), every prefix token at (0, 0).
``normalize=True`` (released option, default off) divides x by the grid's columns and y by its rows; the released
code divides (x, y) by (rows, columns), the same on a square grid. On a larger grid the points extend (``normalize``:
they stay in (0, 1], finer), and every logit still depends on the patches' offset alone (relative): the parabolas
are evaluated further out, where each is steeper, a penalty on distance that the content scales.

Parameters keep the released names: ``position.weight`` [heads P, 2] and ``ab.weight`` [2 heads P, width], one pair
per layer, with ``nn.Linear``'s initialisation as released. vispos's log-n scaling multiplies q . k only (the
channels appended to q are divided by it), as for every bias. The host must pass the attention's input
(``PositionContext.layer(..., inputs=x)``): timm's ViT-family attentions and the transformers families do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .._validate import check_bool, check_grid, check_int
from ..registry import register


def grid_points(grid: tuple[int, int], device: torch.device | None, normalize: bool) -> torch.Tensor:
    """The released points of the patches of ``grid``, row-major: [H W, 2] fp32 (x, y) = (column + 1, row + 1),
    divided by (W, H) with ``normalize``."""
    h, w = grid
    rows, cols = torch.meshgrid(
        torch.arange(1, h + 1, device=device, dtype=torch.float32),
        torch.arange(1, w + 1, device=device, dtype=torch.float32),
        indexing="ij",
    )
    points = torch.stack((cols.flatten(), rows.flatten()), dim=-1)
    return points / torch.tensor([w, h], device=device, dtype=torch.float32) if normalize else points


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """fp16 / bf16 (autocast) -> fp32; fp32 and fp64 as they are."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


class PointLinear(nn.Linear):
    """``position``: points [..., 2] -> coordinates along the parabolas [..., heads P], in at least fp32. Its weight
    is read in its own call (where offloading hooks bring it in)."""

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        weight = _at_least_fp32(self.weight)
        return points.to(weight.dtype) @ weight.T


class InputLinear(nn.Linear):
    """``ab``: the attention's input [..., width] -> curvatures and slopes [..., 2 heads P], in the input's dtype
    (autocast: its own). Its weight is read in its own call (where offloading hooks bring it in)."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return F.linear(inputs, self.weight.to(inputs.dtype))


@dataclass
class ParabolaChannels:
    """A layer's PaPE channels awaiting the attention's input: ``rotate(q, k)`` appends them (module docstring).

    ``points`` [T, 2] or [B, T, 2] fp32 (x, y) of each token; ``origin``: its image's centre, which the channels
    measure from (an offset of all of an image's points leaves its logits unchanged; smaller coordinates keep
    the expanded square's cancellation small in fp32); ``inputs`` [B, T, width] the attention's input, bound by
    the host (``bind``); ``q_divisor``: the logit scale that multiplies q (log-n scaling: a float, or [B, 1, T, 1]
    per token), which the q channels are divided by so that the parabolas are not scaled."""

    points: torch.Tensor
    origin: torch.Tensor  # [2] or [B, T, 2]: subtracted from every point of its image (the logits do not change)
    position: PointLinear  # weight [heads P, 2]
    ab: InputLinear  # weight [2 heads P, width]
    num_heads: int
    parabolas: int
    pad: int  # zero channels appended after the 3P + 2
    inputs: torch.Tensor | None = None
    q_divisor: float | torch.Tensor = 1.0

    @property
    def width(self) -> int:
        """The width of the attention's input the channels take."""
        return self.ab.in_features

    def with_prefix(self, num_prefix_tokens: int) -> ParabolaChannels:
        """Prefix tokens first, each at (0, 0), as the released class token."""
        return replace(self, points=F.pad(self.points, (0, 0, num_prefix_tokens, 0)))

    def take(self, tokens: torch.Tensor) -> ParabolaChannels:
        """The rows of a token subset, ``tokens`` [B, M] indices into each row's tokens (the P + HW tokens of one
        grid, or a ragged row's own): per-token ``points`` and ``origin`` [B, T, 2] are gathered row by row."""

        def rows(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 2:  # [T, 2], shared by every row
                return t[tokens]
            return t.gather(1, tokens[..., None].expand(-1, -1, t.shape[-1]))  # [B, T, 2] -> [B, M, 2]

        origin = self.origin if self.origin.dim() == 1 else rows(self.origin)
        return replace(self, points=rows(self.points), origin=origin)

    def bind(self, inputs: torch.Tensor, q_divisor: float | torch.Tensor = 1.0) -> ParabolaChannels:
        """With the attention's input [B, T, width] and the logit scale q is multiplied by (the host's part)."""
        return replace(self, inputs=inputs, q_divisor=q_divisor)

    def coordinates(self) -> torch.Tensor:
        """u [1 or B, heads, T, P] (fp32, or fp64 for fp64 weights): each token's coordinate along each parabola."""
        points = self.points - self.origin  # about the image's centre: smaller u, less cancellation in the channels
        points = points if points.dim() == 3 else points[None]
        u = self.position(points)  # [1 or B, T, heads P]
        return u.unflatten(-1, (self.num_heads, self.parabolas)).transpose(1, 2)

    def shapes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, b) [B, heads, T, P] fp32 from the bound inputs: each query's curvature (softplus) and slope."""
        if self.inputs is None:
            raise ValueError(
                "pape2d computes its channels from the attention's input, which this host did not pass: call "
                "PositionContext.layer(index, dtype, inputs=x)"
            )
        b, t, _ = self.inputs.shape
        ab = self.ab(self.inputs)  # the inputs' dtype (autocast: its own)
        ab = _at_least_fp32(ab).view(b, t, 2, self.num_heads, self.parabolas).permute(2, 0, 3, 1, 4)
        return F.softplus(ab[0]), ab[1]

    def bias(self) -> torch.Tensor:
        """The dense form [B, heads, T, T]: sum_p -a_ip (u_ip - u_jp)^2 + b_ip (u_ip - u_jp), before the logit
        scale (diagnostics; attention uses the channels)."""
        u = self.coordinates()
        a, slope = self.shapes()
        diff = u[:, :, :, None, :] - u[:, :, None, :, :]  # [B, heads, T, T, P]
        return (-a[:, :, :, None] * diff.square() + slope[:, :, :, None] * diff).sum(-1)

    def channels(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q channels [B, heads, T, 3P + 2 + pad], k channels [1 or B, heads, T, 3P + 2 + pad]), fp32."""
        u = self.coordinates()
        a, slope = self.shapes()
        ones = torch.ones_like(u[..., :1])
        q_side = torch.cat(
            ((-a * u.square()).sum(-1, keepdim=True), a, 2 * a * u, (slope * u).sum(-1, keepdim=True), slope), dim=-1
        )
        k_side = torch.cat((ones, -u.square(), u, ones, -u), dim=-1)
        return F.pad(q_side / self.q_divisor, (0, self.pad)), F.pad(k_side, (0, self.pad))

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k [B, heads, T, d] -> [B, heads, T, d + 3P + 2 + pad] (the hosts' one call for what acts on q and k)."""
        q_side, k_side = self.channels()
        k_side = k_side.expand(k.shape[0], *k_side.shape[1:])
        return torch.cat((q, q_side.to(q.dtype)), dim=-1), torch.cat((k, k_side.to(k.dtype)), dim=-1)


@register(
    "pape2d",
    ndim=2,
    kind="channels",
    trainable=True,
    relative=True,
    context=("dim", "width", "num_heads"),
    per_layer=True,
    summary="PaPE: per head, P parabolas in the offset, curvature and slope from each query's input, as 3P + 2 "
    "channels on q and k (fused attention, no mask); equal to the released code (tested); on ViT-S +2.77M "
    "parameters (+12.6 %) and a training step 5.07x the unpatched one's (docs/performance.md)",
    extrapolation="points extend (1-based patch units, as released; normalize=True: in (0, 1], finer); the "
    "parabolas are evaluated at the new offsets",
    reference="PaPE (arXiv 2602.01418)",
)
class Pape2d(nn.Module):
    """PaPE, one per layer (module docstring). Defaults: the released ImageNet settings (50 parabolas, points not
    normalised, channels padded to a multiple of 8)."""

    # the released recipe decays every parameter (AdamW over all of them): these projections are left out of a
    # patched model's ``no_weight_decay()``, unlike the other schemes' tables and frequencies
    weight_decayed = True

    def __init__(self, *, dim: int, width: int, num_heads: int, parabolas: int = 50, normalize: bool = False,
                 pad_to: int = 8) -> None:  # fmt: skip
        super().__init__()
        self.dim = check_int("dim (head dimension)", dim, minimum=1)
        width = check_int("width", width, minimum=1)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.parabolas = check_int("parabolas", parabolas, minimum=1)
        self.normalize = check_bool("normalize", normalize)
        self.pad_to = check_int("pad_to", pad_to, minimum=1)
        self.position = PointLinear(2, self.num_heads * self.parabolas, bias=False)
        self.ab = InputLinear(width, 2 * self.num_heads * self.parabolas, bias=False)

    @property
    def pad(self) -> int:
        """Zero channels that bring d + 3P + 2 to a multiple of ``pad_to``."""
        total = self.dim + 3 * self.parabolas + 2
        return math.ceil(total / self.pad_to) * self.pad_to - total

    def channels_at(self, points: torch.Tensor, origin: torch.Tensor) -> ParabolaChannels:
        """The channels of tokens at ``points`` [T, 2] or [B, T, 2] (x, y) measured from ``origin``, before the
        inputs are bound."""
        return ParabolaChannels(points, origin, self.position, self.ab, self.num_heads, self.parabolas, self.pad)

    def _device(self, given: torch.device | None) -> torch.device:
        """The weights' device; ``given`` (the tokens') where they are offloaded (meta between their calls)."""
        weight = self.position.weight
        return given if weight.is_meta and given is not None else weight.device

    def centre(self, hw: torch.Tensor) -> torch.Tensor:
        """The centre (x, y) of a grid of (H, W) ``hw`` [..., 2], in the points' units."""
        wh = hw.flip(-1).to(torch.float32)
        return (wh + 1) / 2 / wh if self.normalize else (wh + 1) / 2

    def forward(
        self, grid: tuple[int, int], device: torch.device | None = None, cells: torch.Tensor | None = None
    ) -> ParabolaChannels:
        """-> the channels of ``grid``'s patches, row-major; ``cells`` [N, 2] (y, x) points in patch units (0-based,
        possibly fractional): those instead of every cell."""
        grid = check_grid(grid)
        device = self._device(device)
        origin = self.centre(torch.tensor(grid, device=device))
        if cells is None:
            return self.channels_at(grid_points(grid, device, self.normalize), origin)
        points = cells.to(device=device, dtype=torch.float32).flip(-1) + 1  # (y, x) cell -> released (x, y)
        if self.normalize:
            points = points / torch.tensor([grid[1], grid[0]], device=device, dtype=torch.float32)
        return self.channels_at(points, origin)

    def ragged(self, yx: torch.Tensor, hw: torch.Tensor, prefix: torch.Tensor) -> ParabolaChannels:
        """The channels of a ragged or packed batch (``vispos.ragged.RaggedLayout``'s ``yx``, ``hw`` and ``prefix``,
        [B, T, 2], [B, T, 2], [B, T]): each patch token at its point of its own image's grid (as that image alone),
        prefix tokens at (0, 0) -> points [B, T, 2]."""
        device = self._device(yx.device)
        points = yx.to(device=device, dtype=torch.float32).flip(-1) + 1
        if self.normalize:
            points = points / hw.flip(-1).to(points)
        points = points.masked_fill(prefix[..., None].to(device), 0.0)
        return self.channels_at(points, self.centre(hw.to(device)))

    def extra_repr(self) -> str:
        return f"parabolas={self.parabolas}, normalize={self.normalize}, pad={self.pad}"
