"""The learned-rotation maths in the form ``torch.compile`` fuses: each rotation of q or k one generated kernel.

In eager mode the block rotations (ComRoPE, LieRE) are an einsum and STRING's basis change a matrix product:
library calls that hold no products in memory. Compiled by inductor, the same calls are library kernels with a
copy of q or k before them (into the layout the call needs) and the rotation's own kernel after: three passes
where one does. Here they are written as elementwise products summed over the small axis they contract
(``row_products``), which inductor turns into one reduction kernel reading q where the projection left it, and
the result is computed tokens before heads (``tokens_first``), the layout the projection gave q and attention's
output follows: laid out heads first, the attention output would be copied once more before the out projection.
Used only while compiling (``torch.compiler.is_compiling``): in eager mode the products would be materialised.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from einops import rearrange


def coordinate_sum(coords: torch.Tensor, per_axis: torch.Tensor, trailing: int) -> torch.Tensor:
    """sum_k p_k T_k: coords [N, A] x per-axis tables [(heads,) A, *rest] (``trailing`` = len(rest)) ->
    [(heads,) N, *rest], fp32, as A elementwise products summed in order: under ``torch.compile`` one fused kernel
    with what follows (a product over A = 2 as a matrix product is a library call with a copy before and after)."""
    c, t = coords.float(), per_axis.float().unsqueeze(-trailing - 2)  # t: [(heads,) 1, A, *rest]
    column = (slice(None), *([None] * trailing))  # p_k as [N, 1, ...]
    summed = c[:, 0][column] * t.select(-trailing - 1, 0)
    for k in range(1, c.shape[-1]):
        summed = summed + c[:, k][column] * t.select(-trailing - 1, k)
    return summed


def row_products(matrices: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """matrices [..., i, j] times vectors x [..., j] (broadcast) -> [..., i]: the products summed over j."""
    return (matrices * x.unsqueeze(-2)).sum(-1)


def tokens_first(t: torch.Tensor, trailing: int) -> torch.Tensor:
    """A view of t [..., (heads,) N, *trailing dims] with the token axis before the heads': [..., N, heads | 1, *]."""
    t = t if t.dim() >= trailing + 2 else t.unsqueeze(0)
    return t.transpose(-trailing - 2, -trailing - 1)


def fused_blocks(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``apply_blocks``: x [B, heads, N, d] turned by blocks [(B,) (heads | 1,) N, d/b, b, b], fp32 maths, x's
    dtype out, as one reduction over each block's b channels."""
    b = blocks.shape[-1]
    xb = rearrange(tokens_first(x, 1).float(), "... (m b) -> ... m b", b=b)  # [B, N, heads, d/b, b]
    out = row_products(tokens_first(blocks, 3).float(), xb)  # [B, N, heads, d/b, b]
    return rearrange(out, "... m b -> ... (m b)").transpose(-3, -2).to(x.dtype)


def fused_basis(
    x: torch.Tensor,
    basis: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rot: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """RoPE in a basis: (x @ P) cos + rot(x @ P) sin for x [B, heads, N, d], P = ``basis`` [(heads,) d, d],
    cos/sin [(B,) (heads,) N, d] and ``rot`` the layout's rotate-half: rot(x @ P) = x @ rot(P) (rot moves and
    negates P's columns, exactly), so both terms are sums of products over x's channels, fp32, x's dtype out."""
    p = basis.float()
    rows, turned = p.transpose(-1, -2), rot(p).transpose(-1, -2)  # row i: column i of P, of rot(P)
    xf = tokens_first(x, 1).float()  # [B, N, heads, d]
    c, s = tokens_first(cos, 1).float(), tokens_first(sin, 1).float()
    out = row_products(rows, xf) * c + row_products(turned, xf) * s
    return out.transpose(-3, -2).to(x.dtype)
