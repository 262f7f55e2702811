"""Position part of attention logits: for a scheme alone, and for one layer of a patched timm ViT.

Every function returns a logit map [heads, N, N] (query index, key index) for tokens that carry the
same content at every position, so only position varies across the map. 2D grids are row-major
(index = y * W + x); 1D positions are 0 .. N-1 unless given.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._validate import check_grid, check_int, check_positions
from ..positions import Positions
from ..timm import PatchedAttention

Where = tuple[int, int] | int | torch.Tensor  # a 2D grid (H, W), or 1D positions (length or [N] tensor)


def _device(*tensors: torch.Tensor | None, module: nn.Module) -> torch.device:
    for t in (*tensors, *module.parameters()):
        if t is not None:
            return t.device
    return torch.device("cpu")


def _heads(vec: torch.Tensor, name: str) -> torch.Tensor:
    """Content vector [head_dim] or [heads, head_dim] -> [heads, head_dim]."""
    if vec.dim() == 1:
        return vec[None]
    if vec.dim() != 2:
        raise ValueError(f"{name} must be [head_dim] or [heads, head_dim], got {tuple(vec.shape)}")
    return vec


def _content_logits(q: torch.Tensor, k: torch.Tensor, n: int, scale: float) -> torch.Tensor:
    """q . k * scale per head, the same for every pair: [heads, N, N]."""
    return ((q * k).sum(-1) * scale)[:, None, None].expand(-1, n, n)


def scheme_logits(
    encoding: nn.Module,
    where: Where,
    *,
    q: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    wq: torch.Tensor | None = None,
    wk: torch.Tensor | None = None,
    content: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Logits between every pair of positions for a scheme built by ``vispos.create_encoding``. [heads, N, N].

    ``where``: the grid (H, W) of a 2D scheme, or the positions (length, or integer tensor [N]) of a 1D one.
    What the scheme needs, by kind (``scale`` defaults to 1 / sqrt(head_dim)):

    - rotary: content ``q``, ``k`` [head_dim] or [heads, head_dim], the same at every position; the
      logit is R(p) q . R(q') k * scale.
    - bias: the bias itself (the position part); with ``q``, ``k`` also the content logit q . k * scale.
    - relative_kv (Shaw): ``q`` required; q . a(q' - p) * scale, plus q . k * scale when ``k`` is given.
    - query_bias (decomposed2d): ``q`` required; its bias at q (unscaled), plus q . k * scale when ``k`` is given.
    - channels (pape2d): its bias for the attention's input ``content`` [C] at every position (default zero),
      times ``scale`` (default 1 / sqrt of the scheme's head width), plus q . k * scale when ``q``, ``k`` are given.
    - additive: projections ``wq``, ``wk`` [heads, C, head_dim]; tokens x_p = content + PE_p
      (``content`` [C], default zero: the position-only part PE_p W_q . PE_q' W_k), logits x_p W_q . x_q' W_k * scale.
    - conditional (2D): as additive, with tokens x_p = the scheme applied to ``content`` at every position
      (PEG: content + conv; positions show where the kernel meets the border).
    - none: the content logit q . k * scale (constant), or zeros [1, N, N].
    """
    info = getattr(encoding, "scheme_info", None)
    if info is None:
        raise TypeError(f"{type(encoding).__name__} carries no scheme_info; build it with vispos.create_encoding")
    device = _device(q, wq, module=encoding)
    if info.ndim == 2 and info.kind == "conditional":
        where = check_grid(where)
        n = where[0] * where[1]
        if wq is None or wk is None:
            raise ValueError(f"{info.name} (conditional) needs projections wq= and wk= [heads, C, head_dim]")
        tokens = wq.new_zeros(wq.shape[1]) if content is None else content.to(wq)
        out, content = encoding(tokens.expand(1, n, -1), where)[0], None  # [N, C]: the transformed tokens
    elif info.ndim == 2:
        where = check_grid(where)
        out = encoding(where, device)
        n = where[0] * where[1]
    else:
        positions = check_positions(where).to(device)
        if positions.dim() != 1:
            raise ValueError(f"1D positions must be a length or a tensor [N], got {tuple(positions.shape)}")
        out, n = encoding(positions), positions.shape[0]
    if info.kind in ("rotary", "relative_kv", "query_bias") and q is None:
        raise ValueError(f"{info.name} ({info.kind}) needs content vectors q= (and k=) [head_dim] or [heads, head_dim]")
    if info.kind == "rotary" and k is None:
        raise ValueError(f"{info.name} (rotary) needs content vectors q= and k=")
    if info.kind in ("additive", "conditional"):
        if wq is None or wk is None:
            raise ValueError(f"{info.name} (additive) needs projections wq= and wk= [heads, C, head_dim]")
        x = out if content is None else out + content  # [N, C]
        qs = torch.einsum("nc,hcd->hnd", x.to(wq.dtype), wq)  # [heads, N, head_dim]
        ks = torch.einsum("nc,hcd->hnd", x.to(wk.dtype), wk)
        scale = 1.0 / math.sqrt(wq.shape[-1]) if scale is None else scale
        return qs @ ks.transpose(-2, -1) * scale
    if q is not None:
        q = _heads(q, "q")
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if k is not None:
        k = _heads(k, "k")
    if info.kind == "rotary":
        heads = max(q.shape[0], k.shape[0], out.heads)
        qs = q[None, :, None, :].expand(1, heads, n, -1)  # [1, heads, N, head_dim]
        ks = k[None, :, None, :].expand(1, heads, n, -1)
        qr, kr = out.rotate(qs, ks)
        return (qr @ kr.transpose(-2, -1))[0] * scale
    content_part = _content_logits(q, k, n, scale) if q is not None and k is not None else None
    if info.kind == "channels":  # the inputs: ``content`` [C] at every position (default zero)
        x = out.points.new_zeros(1, n, out.width) if content is None else content.to(device).expand(1, n, -1)
        scale = encoding.dim**-0.5 if scale is None else scale
        logits = out.bind(x.float()).bias()[0] * scale
        return logits if content_part is None else logits + content_part
    if info.kind == "bias":
        return out.float() if content_part is None else out.float() + content_part
    if info.kind == "query_bias":  # q at every position, before the logit scale (as the model adds it)
        logits = out.logits(q[None, :, None, :].expand(1, -1, n, -1).float())[0]  # [heads, N, N]
        return logits if content_part is None else logits + content_part
    if info.kind == "relative_kv":
        q_rel = q @ out.key_table.T.to(q.dtype)  # [heads, 2k+1]
        logits = q_rel[:, out.index] * scale  # [heads, N, N]
        return logits if content_part is None else logits + content_part
    return torch.zeros(1, n, n, device=device) if content_part is None else content_part


def layer_logits(
    model: nn.Module,
    grid: tuple[int, int],
    *,
    layer: int = 0,
    content: torch.Tensor | None = None,
    norm: bool = False,
) -> torch.Tensor:
    """Logits of layer ``layer`` of a vispos-patched timm ViT between every pair of patches. [heads, HW, HW].

    The tokens are ``content`` [C] (default zero) at every patch, passed through the model's own
    ``_pos_embed`` (additive table, prefix tokens), then, with ``norm=True``, ``norm_pre`` and the
    block's ``norm1`` (the exact input of the first layer), then the layer's own ``positioned`` path
    (the one its forward feeds to SDPA): qkv projection, q/k norms, rotation, logit scale and bias
    mask. A conditional scheme (peg2d) placed before the layer (``after < layer``) transforms the tokens
    before ``norm1`` (the blocks in between are left out, as for any layer past the first). Prefix tokens
    take part (RoPE leaves them unrotated) and are dropped from the result.
    ``content=None`` gives the position-only part where position alone makes logits: an additive table
    (its PE_p W_q . PE_q' W_k) and a bias (the bias itself); a rotary scheme without an additive table
    has nothing to rotate then (zero tokens: q and k are the qkv biases alone, all-zero logits on a
    fresh layer), so it needs ``content`` and refuses None. Call it on a model in eval mode.
    """
    pos = getattr(model, "vispos", None)
    if not isinstance(pos, Positions):
        raise ValueError("this model is not patched by vispos; call vispos.patch(model, ...) first")
    layer = check_int("layer", layer, minimum=0)
    if layer >= len(model.blocks):
        raise ValueError(f"layer {layer} out of range; the model has {len(model.blocks)} blocks")
    h, w = check_grid(grid)
    if content is not None and (not isinstance(content, torch.Tensor) or content.shape != (model.embed_dim,)):
        got = tuple(content.shape) if isinstance(content, torch.Tensor) else type(content).__name__
        raise ValueError(f"content must be a tensor [{model.embed_dim}] (one token's content), got {got}")
    if content is None and pos.attention_kind == "rotary" and pos.additive is None:
        schemes = ", ".join(pos.settings["pos"])
        raise ValueError(
            f"layer_logits on {schemes} (rotary) needs content= [{model.embed_dim}], the token content the rotation "
            f"acts on (zero tokens give all-zero logits); e.g. content=torch.randn({model.embed_dim})"
        )
    block = model.blocks[layer]
    attn = block.attn
    if not isinstance(attn, PatchedAttention):
        raise TypeError(f"block {layer} attention is {type(attn).__name__}, not a vispos PatchedAttention")
    weight = next(model.parameters())
    x = weight.new_zeros(1, h, w, model.embed_dim)  # NHWC, as patch_embed hands it over
    if content is not None:
        x = x + content.to(x)
    x = model._pos_embed(x)
    x = x[0] if isinstance(x, tuple) else x  # Eva returns (x, rope)
    ctx = pos.context((h, w), x.device)
    if norm:
        x = model.norm_pre(x)
    if pos.conditional is not None and pos.conditional.after < layer:
        x = pos.apply_conditional(x, ctx)
    if norm:
        x = block.norm1(x)
    q, k, _, scale, mask = attn.positioned(x, ctx)  # [1, heads, P + HW, head_dim]
    logits = (q @ k.transpose(-2, -1)) * scale  # [1, heads, P + HW, P + HW]
    if mask is not None:
        logits = logits + mask.to(logits.dtype)  # [1, heads, P + HW, P + HW]
    p = pos.num_prefix_tokens
    return logits[0, :, p:, p:]
