"""Shaw et al. (2018) relative position representations: learned vectors for clipped offsets, added to
the keys (in the logits) and to the values (in the weighted sum). Shared across heads, as in the paper."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .._validate import check_bool, check_float, check_int, check_positions
from ..registry import register


def shaw_index(positions: torch.Tensor, max_distance: int) -> torch.Tensor:
    """clip(j - i, -k, k) + k for query i and key j: [(B,) N, N] indices into a (2k + 1)-row table."""
    relative = positions[..., None, :] - positions[..., :, None]
    return relative.clamp(-max_distance, max_distance) + max_distance


@dataclass
class ShawTables:
    index: torch.Tensor  # [(B,) N, N]
    key_table: torch.Tensor  # [2k + 1, head_dim]
    value_table: torch.Tensor | None  # [2k + 1, head_dim]


@register("shaw", ndim=1, kind="relative_kv", trainable=True, relative=True, context=("dim",),
    summary="Shaw clipped relative embeddings on keys and values", extrapolation="offsets clipped at +-k",
    reference="Shaw et al. 2018")
class ShawRelative(nn.Module):
    def __init__(self, *, dim: int, max_distance: int = 16, values: bool = True, init_std: float = 0.02) -> None:
        super().__init__()
        self.dim = check_int("dim (head dimension)", dim, minimum=1)
        self.max_distance = check_int("max_distance", max_distance, minimum=1)
        init_std = check_float("init_std", init_std, minimum=0.0)
        rows = 2 * self.max_distance + 1
        self.key_table = nn.Parameter(torch.randn(rows, dim) * init_std)
        self.value_table = nn.Parameter(torch.randn(rows, dim) * init_std) if check_bool("values", values) else None

    def forward(self, positions: torch.Tensor | int) -> ShawTables:
        positions = check_positions(positions).to(self.key_table.device)
        return ShawTables(shaw_index(positions, self.max_distance), self.key_table, self.value_table)
