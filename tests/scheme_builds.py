"""Every registered scheme built small, for the registry-wide tests: the context it declares filled with small values,
run on a 3 x 4 grid (a conditional scheme on tokens laid on it)."""

from __future__ import annotations

import torch

import vispos

GRID = (3, 4)
HEADS = 2
DIM = 16  # embedding dim for additive schemes, head dim for attention schemes
WIDTH = 12  # the attention's input width (schemes of channels compute from it)
SCHEMES_2D = vispos.list_encodings(ndim=2)
SCHEMES_1D = vispos.list_encodings(ndim=1)


def build(name: str, ndim: int = 2, **extra: object) -> torch.nn.Module:
    """The scheme with small values for the context it declares (dim, num_heads, train_grid...)."""
    context = {"dim": DIM, "width": WIDTH, "num_heads": HEADS, "train_grid": GRID, "num_prefix_tokens": 0,
               "causal": False}  # fmt: skip
    context |= {"layer": 0, "depth": 1}
    info = vispos.get_info(name, ndim)
    return vispos.create_encoding(name, ndim=ndim, **{k: context[k] for k in info.context} | extra)


def run_2d(module: torch.nn.Module, grid: tuple[int, int], dtype: torch.dtype = torch.float32) -> object:
    """A 2D scheme's output at ``grid``; a conditional scheme transforms tokens [2, H*W, DIM] laid on it."""
    if module.scheme_info.kind != "conditional":
        return module(grid)
    tokens = torch.randn(2, grid[0] * grid[1], DIM, generator=torch.Generator().manual_seed(3))
    return module(tokens.to(dtype), grid)
