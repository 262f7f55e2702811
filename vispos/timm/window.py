"""Shifted-window attention with vispos positions: the windowed machinery of the Swin host (``swin.py``).

A Swin stage attends inside windows of ``window = (wh, ww)`` tokens; every other block first rolls the
feature map by ``shift`` so that windows straddle the previous ones, and a mask (``shift_mask``) keeps tokens
that the roll brought together from different image regions from attending to each other. Positions act on
window-local coordinates: every window is the same ``wh x ww`` grid, so one ``PositionContext`` at that grid
(built once per stage and forward) serves every window and every block of the stage; its bias is added to
the shift mask.

Pure functions (``partition``, ``reverse``, ``shift_mask``, ``window_mask``) and one thin module,
``PatchedWindowAttention``, which adopts the weights of timm's Swin / Swin V2 ``WindowAttention``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from timm.models.swin_transformer import WindowAttention as SwinWindowAttention
from timm.models.swin_transformer_v2 import WindowAttention as SwinV2WindowAttention
from timm.models.swin_transformer_v2_cr import WindowMultiHeadAttention as SwinV2CrWindowAttention
from torch import nn

from ..attention import query_mask, sdpa
from ..positions import PositionContext
from .attention import require_context

WINDOW_ATTENTION: tuple[type, ...] = (SwinWindowAttention, SwinV2WindowAttention, SwinV2CrWindowAttention)
COSINE_ATTENTION: tuple[type, ...] = (SwinV2WindowAttention, SwinV2CrWindowAttention)
SHIFT_MASK_VALUE = -100.0  # Swin's value for pairs from different regions (not -inf: a fully masked row stays finite)


def partition(x: torch.Tensor, window: tuple[int, int]) -> torch.Tensor:
    """x [B, H, W, C] (H, W multiples of the window) -> windows [B * nW, wh * ww, C], windows row-major per image."""
    b, h, w, c = x.shape
    wh, ww = window
    x = x.view(b, h // wh, wh, w // ww, ww, c).permute(0, 1, 3, 2, 4, 5)  # [B, H/wh, W/ww, wh, ww, C]
    return x.reshape(-1, wh * ww, c)


def reverse(windows: torch.Tensor, window: tuple[int, int], size: tuple[int, int]) -> torch.Tensor:
    """``partition``'s inverse: windows [B * nW, wh * ww, C] -> [B, H, W, C] for the padded size (H, W)."""
    (wh, ww), (h, w) = window, size
    c = windows.shape[-1]
    x = windows.view(-1, h // wh, w // ww, wh, ww, c).permute(0, 1, 3, 2, 4, 5)  # [B, H/wh, wh, W/ww, ww, C]
    return x.reshape(-1, h, w, c)


def shift_mask(
    size: tuple[int, int], window: tuple[int, int], shift: tuple[int, int], device: torch.device | None = None
) -> torch.Tensor | None:
    """The mask of shifted windows on a padded map of ``size`` (H, W): [nW, N, N], 0 within a region and -100
    between regions (Swin's rule: after a roll by -shift the map is cut into 3 x 3 regions, the last window
    row and column mixing the image's far side with its near side); None when nothing is shifted."""
    if not any(shift):
        return None
    (h, w), (wh, ww), (sh, sw) = size, window, shift
    rows, cols = _regions(h, wh, sh, device), _regions(w, ww, sw, device)  # [H], [W]
    region = (rows[:, None] * 3 + cols[None, :])[None, :, :, None]  # [1, H, W, 1]
    labels = partition(region, window)[..., 0]  # [nW, N]
    different = labels[:, :, None] != labels[:, None, :]  # [nW, N, N]
    return torch.zeros(different.shape, device=device).masked_fill(different, SHIFT_MASK_VALUE)


def _regions(length: int, window: int, shift: int, device: torch.device | None) -> torch.Tensor:
    """The region of each row (or column) [length]: 0 before the last window, 1 in it before the shift, 2 after;
    one region when this axis is not shifted (timm's slices then cover the whole axis with one label)."""
    out = torch.zeros(length, dtype=torch.int64, device=device)
    if shift:
        out[length - window : length - shift] = 1
        out[length - shift :] = 2
    return out


def window_mask(bias: torch.Tensor | None, shift: torch.Tensor | None, num_windows_total: int) -> torch.Tensor | None:
    """A window bias [1, heads, N, N] (or one per window, [B * nW, heads, N, N]: a query-dependent bias) plus
    the shift mask [nW, N, N] -> the additive mask of every window of the batch, [B * nW, heads or 1, N, N]
    (windows ordered as ``partition`` orders them); the bias alone when nothing is shifted."""
    if shift is None:
        return bias
    nw, n, _ = shift.shape
    if bias is not None and bias.shape[0] == num_windows_total:  # one bias per window already
        return bias + shift.repeat(num_windows_total // nw, 1, 1)[:, None].to(bias.dtype)
    mask = shift[:, None] if bias is None else bias + shift[:, None].to(bias.dtype)  # [nW, heads or 1, N, N]
    b = num_windows_total // nw
    return mask[None].expand(b, *mask.shape).reshape(b * nw, mask.shape[1], n, n)


class PatchedWindowAttention(nn.Module):
    """Drop-in for timm's Swin and Swin V2 ``WindowAttention`` and Swin V2-CR's ``WindowMultiHeadAttention``:
    timm's projections, vispos's positions.

    It adopts the original's projections under their names (``qkv``, ``proj``; Swin V2's ``q_bias`` /
    ``v_bias``, ``k_bias`` buffer and ``logit_scale``), so their state dict keys are timm's; the position
    tables (``relative_position_bias_table``, ``cpb_mlp``, ``meta_mlp``) are not adopted: they live in ``model.vispos``.
    Swin V2's cosine attention stays: q and k are normalised and the logits multiplied by
    ``exp(min(logit_scale, ln 100))`` per head (a rotation keeps norms, so rotating before or after is the same).
    Called as timm's blocks call it, ``attn(windows, mask=shift_mask)``, plus the stage's context ``ctx``.
    """

    def __init__(self, original: nn.Module, layer_idx: int) -> None:
        super().__init__()
        if not isinstance(original, WINDOW_ATTENTION):
            names = ", ".join(f"{c.__module__}.{c.__name__}" for c in WINDOW_ATTENTION)
            raise TypeError(f"attention {type(original).__name__} is not supported; supported: {names}")
        self.cosine = isinstance(original, COSINE_ATTENTION)
        self.qkv, self.proj = original.qkv, original.proj
        self.attn_drop, self.proj_drop = original.attn_drop, original.proj_drop
        self.num_heads: int = original.num_heads
        self.head_dim: int = original.qkv.out_features // (3 * original.num_heads)
        self.scale: float = self.head_dim**-0.5
        self.fused_attn: bool = getattr(original, "fused_attn", True)
        self.window_size: tuple[int, int] = tuple(original.window_size)
        self.layer_idx = layer_idx  # within its stage
        if self.cosine:
            self.logit_scale = original.logit_scale  # [heads, 1, 1] (Swin V2), [heads] (Swin V2-CR)
        if isinstance(original, SwinV2WindowAttention):  # Swin V2-CR's qkv holds its own bias
            self.qkv_bias_separate: bool = original.qkv_bias_separate
            self.q_bias, self.v_bias = original.q_bias, original.v_bias
            self.register_buffer("k_bias", original.k_bias, persistent=False)
        else:
            self.qkv_bias_separate = False
            self.q_bias = self.v_bias = self.k_bias = None

    def init_non_persistent_buffers(self) -> None:
        """timm's protocol for buffers a checkpoint does not hold (``reinit_non_persistent_buffers``, after
        ``to_empty``): Swin V2's ``k_bias`` is zeros, as timm's attention sets it."""
        if self.k_bias is not None:
            with torch.no_grad():
                self.k_bias.zero_()

    def set_window_size(self, window_size: tuple[int, int]) -> None:
        """What timm's ``block.set_input_size`` calls: the window is the positions' grid (``swin.py`` resizes
        the position tables once per stage, as Swin resizes its own)."""
        self.window_size = (int(window_size[0]), int(window_size[1]))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B * nW, N, C] -> q, k, v [B * nW, heads, N, head_dim], as timm computes them."""
        b, n, _ = x.shape
        if self.q_bias is None:
            qkv = self.qkv(x)
        else:
            bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
            qkv = self.qkv(x) + bias if self.qkv_bias_separate else F.linear(x, self.qkv.weight, bias)
        return qkv.reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, ctx: PositionContext | None = None
    ) -> torch.Tensor:
        """x [B * nW, N, C] windows, ``mask`` [nW, N, N] the shift mask (or None) -> [B * nW, N, C]."""
        require_context(ctx)
        ctx.check_tokens(x)
        b, n, _ = x.shape
        q, k, v = self.project(x)
        rotary, bias = ctx.layer(self.layer_idx, inputs=x)
        if rotary is not None:
            q, k = rotary.rotate(q, k)
        bias = query_mask(bias, q)  # decomposed2d: from each window's queries, before cosine attention's norm
        scale = self.scale
        if self.cosine:  # cosine attention: unit q and k, a learned temperature per head
            temperature = torch.clamp(self.logit_scale.view(-1, 1, 1), max=math.log(100.0)).exp()  # [heads, 1, 1]
            q, k, scale = F.normalize(q, dim=-1) * temperature, F.normalize(k, dim=-1), 1.0
        dropout_p = self.attn_drop.p if self.training else 0.0
        attn_mask = window_mask(bias, mask, b)
        out = sdpa(q, k, v, mask=attn_mask, fused=self.fused_attn, scale=scale * ctx.logit_scale, dropout_p=dropout_p)
        out = out.transpose(1, 2)  # [B * nW, N, heads, head_dim]
        if torch.compiler.is_exporting():  # with symbolic sizes, export would lower the reshape to an invalid view
            out = out.clone(memory_format=torch.contiguous_format)
        out = out.reshape(b, n, self.num_heads * self.head_dim)  # [B * nW, N, C]
        return self.proj_drop(self.proj(out))
