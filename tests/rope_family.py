"""The rotary-family tests' set-up: 2D schemes on a 5 x 7 grid with every parameter drawn afresh, their logits on
random q and k, and the dense reference (R_p q) . (R_p' k) / sqrt(d) that rotations written out as matrices give."""

from __future__ import annotations

import math

import torch
from torch import nn

import vispos
from vispos.diagnostics import scheme_logits
from vispos.encodings.coords2d import grid_coords

GRID = (5, 7)
HEADS, HEAD_DIM = 4, 16
FP, CLEAR = 1e-4, 1e-2
SEEDS = (0, 1, 2)


def content(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def build(name: str, seed: int, **options: object) -> nn.Module:
    torch.manual_seed(seed)
    context = {"dim": HEAD_DIM, "num_heads": HEADS, "train_grid": GRID}
    info = vispos.get_info(name, 2)
    enc = vispos.create_encoding(name, **{k: context[k] for k in info.context} | options)
    with torch.no_grad():
        for p in enc.parameters():  # every parameter drawn afresh: no property may rest on an init
            p.copy_(content(100 + seed, *p.shape) * 0.5)
    return enc


def logits(enc: nn.Module, seed: int) -> torch.Tensor:
    return scheme_logits(enc, GRID, q=content(seed, HEADS, HEAD_DIM), k=content(seed + 7, HEADS, HEAD_DIM))


def dense_logits(rotations: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """rotations [heads, N, d, d], q/k [heads, d] -> (R_p q) . (R_p' k) / sqrt(d), [heads, N, N]."""
    rq = rotations @ q.double()[:, None, :, None]  # [heads, N, d, 1]
    rk = rotations @ k.double()[:, None, :, None]
    return (rq[..., 0] @ rk[..., 0].transpose(-1, -2)) / math.sqrt(q.shape[-1])


def xy(grid: tuple[int, int], coords: str) -> torch.Tensor:
    return grid_coords(grid, coords).flip(-1).double()  # (x, y) per patch, row-major
