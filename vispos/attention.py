"""Attention maths shared by the sequence layer (``vispos.layers.Attention``) and patched timm blocks.

Every path ends in ``F.scaled_dot_product_attention`` unless the caller asks for the eager reference
(``fused=False``) or the scheme needs the attention weights themselves (Shaw's value term).
Masks follow SDPA: a bool mask is True where attention is allowed; a float mask is added to the logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch._dynamo
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .encodings.decomposed import QueryBias
from .encodings.shaw import ShawTables


def as_float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Bool (True = attend) or float mask -> additive float mask in ``dtype``."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def as_4d(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A mask broadcastable to [B, heads, N, N] as a 4-D view (leading dims of size 1 added)."""
    if mask is None or mask.dim() >= 4:
        return mask
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def query_mask(mask: torch.Tensor | QueryBias | None, q: torch.Tensor) -> torch.Tensor | None:
    """A layer's mask as SDPA takes it: a query-dependent bias (``QueryBias``'s protocol: decomposed2d, irpe2d)
    evaluated at the queries q [B, heads, N, head_dim] (before the logit scale), any other mask as it is."""
    return mask if mask is None or isinstance(mask, torch.Tensor) else mask.logits(q)


def widened(v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """v [..., d] zero-padded to q's width where channels were appended to q and k: the fused SDPA kernels (flash,
    CPU and CUDA) take one head width for q, k and v; the outputs' extra channels are zero, sliced off."""
    return v if v.shape[-1] == q.shape[-1] else F.pad(v, (0, q.shape[-1] - v.shape[-1]))


def combine_masks(*masks: torch.Tensor | None) -> torch.Tensor | None:
    """Sum of the given additive masks (broadcast), None when there are none."""
    out = None
    for m in masks:
        if m is not None:
            out = m if out is None else out + m
    return out


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    fused: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for q, k, v [B, heads, N, head_dim]; fused or the eager reference.

    A float mask goes to SDPA as 4-D in q's dtype: with a 3-D mask PyTorch's CPU dispatcher leaves the
    fused kernel for the math path (several times slower). q and k wider than v (channels appended: pape2d)
    attend with v padded to their width (``widened``), so that a fused kernel takes them."""
    mask = as_4d(as_float_mask(mask, q.dtype))
    if fused:
        width = v.shape[-1]
        out = F.scaled_dot_product_attention(
            q, k, widened(v, q), attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
        )
        return out if out.shape[-1] == width else out[..., :width]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = (q * scale) @ k.transpose(-2, -1)  # [B, heads, N, N]
    if is_causal:
        n = q.shape[-2]
        logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if mask is not None:
        logits = logits + mask
    probs = logits.softmax(dim=-1)
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p)
    return probs @ v


def shaw_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: ShawTables,
    *,
    mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Shaw et al.: e_ij = q_i (k_j + aK_ij) / sqrt(d), out_i = sum_j a_ij (v_j + aV_ij).

    The relative terms go through the (2k + 1)-row tables: q @ aK^T is gathered into an [N, N] bias, and
    the weights are summed per offset bucket before meeting aV, so no [N, N, head_dim] tensor is built.
    """
    b, h, n, _ = q.shape
    scale = 1.0 / math.sqrt(q.shape[-1])
    index = tables.index.expand(b, n, n)[:, None].expand(b, h, n, n)  # [B, heads, N, N]
    q_rel = q @ tables.key_table.to(q.dtype).T  # [B, heads, N, 2k+1]
    rel_bias = torch.gather(q_rel, -1, index) * scale
    mask = combine_masks(rel_bias, as_float_mask(mask, q.dtype))
    if tables.value_table is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    probs = ((q * scale) @ k.transpose(-2, -1) + mask).softmax(dim=-1)
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p)
    buckets = torch.zeros_like(q_rel).scatter_add_(-1, index, probs)  # weight per offset bucket
    return probs @ v + buckets @ tables.value_table.to(q.dtype)


# One compiled kernel for every input size: the dimensions that follow the size (the sequence, the bias
# table's length, a ragged batch's per-token values) are marked dynamic before each call, and nothing of a
# size reaches a score_mod as a Python value (the grid comes as a tensor). A captured int or float is a guard:
# it would recompile for each new size and, past torch._dynamo's cache limit, fall back to uncompiled
# FlexAttention, which materialises the scores. On CPU, sizes stay static (one compile per size): torch 2.14's
# CPU kernel renames its block-size symbols by string replacement, which breaks the generated C++ whenever
# another size symbol's name begins with theirs (e.g. ks3 and ks34).
_compiled_flex = torch.compile(flex_attention)
_compiled_flex_static = torch.compile(flex_attention, dynamic=False)
_STATIC_SIZE_DEVICES = {"cpu"}


def offset_score_mod(values: torch.Tensor, grid: torch.Tensor, num_prefix_tokens: int):  # noqa: ANN201
    """FlexAttention score_mod adding a relative 2D bias looked up per offset, so no [heads, N, N] mask exists.

    ``values`` [heads, (2H-1)(2W-1) + 3] is ``with_prefix_entries`` of the per-offset bias: offset
    (dy, dx) = query - key at (dy + H - 1) * (2W - 1) + dx + W - 1, then BEiT's prefix entries (prefix ->
    patch, patch -> prefix, prefix -> prefix; zero without them). ``grid`` is (H, W) as an int tensor, so a new
    grid is new data for the compiled kernel, not a recompile. Tokens are P prefix tokens then the grid,
    row-major.
    """
    h, w = grid[0], grid[1]
    p = num_prefix_tokens  # fixed by the model: a guard that never changes
    total = (2 * h - 1) * (2 * w - 1)  # where the prefix entries begin

    def score_mod(score, b, head, q_idx, kv_idx):  # noqa: ANN001, ANN202
        qp, kp = (q_idx - p).clamp(min=0), (kv_idx - p).clamp(min=0)  # patch index (prefix: clamped, unused)
        index = (qp // w - kp // w + h - 1) * (2 * w - 1) + qp % w - kp % w + w - 1
        if p:  # prefix rows and columns read their entries: one gather from one table
            query, key = q_idx < p, kv_idx < p
            index = torch.where(query, torch.where(key, total + 2, total), torch.where(key, total + 1, index))
        return score + values[head, index].to(score.dtype)

    return score_mod


@dataclass
class FlexBias:
    """A relative bias as FlexAttention takes it: a ``score_mod`` adding each pair's bias (and, in a ragged
    batch, hiding padding and other images' tokens), the tensors it reads with the dimension of each that follows
    the input size (marked dynamic, so that a new size is new data for the compiled kernel, not a recompile),
    and an optional block mask of the caller's (vispos builds none: a block mask holds its sequence length as a
    Python int, so a new length recompiles)."""

    score_mod: Callable
    block_mask: BlockMask | None = None
    sized: tuple[tuple[torch.Tensor, int], ...] = ()


def _mark_sizes_dynamic(tensors: Iterable[tuple[torch.Tensor, int]]) -> None:
    for tensor, dim in tensors:
        if tensor.shape[dim] > 1:  # a size of 1 stays specialised, as torch.compile does
            torch._dynamo.mark_dynamic(tensor, dim)


def flex_bias_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: FlexBias, *, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale + relative bias) v through FlexAttention (compiled, fused) for q, k, v
    [B, heads, N, head_dim]; equal to ``sdpa`` with the dense mask, without building it."""
    if torch.compiler.is_compiling():  # inside the caller's compiled graph: its own dynamic shapes
        attend = flex_attention
    elif q.device.type in _STATIC_SIZE_DEVICES:
        attend = _compiled_flex_static
    else:
        _mark_sizes_dynamic([(q, 2), (k, 2), (v, 2), *bias.sized])
        attend = _compiled_flex
    return attend(q, k, v, score_mod=bias.score_mod, block_mask=bias.block_mask, scale=scale)
