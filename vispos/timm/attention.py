"""The attention of a patched timm block: timm's projections, vispos's positions, SDPA."""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F
from timm.layers import AttentionRope
from timm.models.eva import EvaAttention
from timm.models.vision_transformer import Attention as TimmAttention

from ..attention import FlexBias, flex_bias_attention, query_mask, sdpa
from ..positions import PositionContext

SUPPORTED_ATTENTION: tuple[type, ...] = (TimmAttention, AttentionRope, EvaAttention)

# Projection submodules and parameters a timm attention family may have; None where it has not:
# a fused ``qkv`` (all), Eva's separate ``q_bias``/``k_bias``/``v_bias``, separate ``q_proj``/``k_proj``/
# ``v_proj`` (Eva and AttentionRope without fused qkv), an output ``gate``.
_OPTIONAL = ("qkv", "q_proj", "k_proj", "v_proj", "q_bias", "k_bias", "v_bias", "gate")


class PatchedAttention(torch.nn.Module):
    """Drop-in for timm's ``Attention``, ``AttentionRope`` and ``EvaAttention`` that applies vispos's positions.

    It adopts the original module's submodules, parameters and buffers under their original names, so
    the state dict keys and tensors (``qkv``, ``q_norm``, ``k_norm``, ``proj``, Eva's ``q_bias``...) are
    the same objects as before. Blocks hand it a ``PositionContext`` through their ``attn_mask`` argument.
    """

    accepts: tuple[type, ...] = SUPPORTED_ATTENTION  # the timm attentions it replaces (a subclass: its own)

    def __init__(self, original: torch.nn.Module, layer_idx: int) -> None:
        super().__init__()
        if not isinstance(original, self.accepts):
            names = ", ".join(c.__name__ for c in self.accepts)
            raise TypeError(f"attention {type(original).__name__} is not supported; supported: {names}")
        persistent = set(original.state_dict(keep_vars=True))
        for name, child in original.named_children():
            self.add_module(name, child)
        for name, param in original.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in original.named_buffers(recurse=False):
            self.register_buffer(name, buf, persistent=name in persistent)
        for name in _OPTIONAL:
            if not hasattr(self, name):
                setattr(self, name, None)
        self.num_heads: int = original.num_heads
        self.num_kv_heads: int = getattr(original, "num_kv_heads", original.num_heads)  # AttentionRope (GQA)
        self.head_dim: int = original.head_dim
        self.scale: float = original.scale
        self.fused_attn: bool = original.fused_attn
        self.qkv_bias_separate: bool = getattr(original, "qkv_bias_separate", False)  # EvaAttention
        self.layer_idx = layer_idx

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, N, C] -> q, k, v [B, heads, N, head_dim], exactly as timm computes them."""
        b, n, _ = x.shape
        if self.qkv is not None:
            if self.q_bias is None:
                qkv = self.qkv(x)
            else:
                bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
                qkv = self.qkv(x) + bias if self.qkv_bias_separate else F.linear(x, self.qkv.weight, bias)
            return qkv.reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q = self.q_proj(x).reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = (
            p(x).reshape(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2) for p in (self.k_proj, self.v_proj)
        )
        if self.num_kv_heads != self.num_heads:  # grouped-query attention: share each k/v head
            groups = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return q, k, v

    def project_normed(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``project`` followed by timm's q/k norms: q, k, v before positions are applied."""
        q, k, v = self.project(x)
        return self.q_norm(q), self.k_norm(k), v

    def positioned(
        self, x: torch.Tensor, attn_mask: PositionContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor | None]:
        """What this layer feeds to SDPA for tokens x [B, N, C]: q and k with positions applied, v
        (each [B, heads, N, head_dim]), the logit scale and the additive mask. ``forward`` and the
        diagnostics (``vispos.diagnostics.layer_logits``) both call it, so they cannot disagree."""
        require_context(attn_mask)
        attn_mask.check_tokens(x)
        q, k, v = self.project_normed(x)
        rotary, mask = attn_mask.layer(self.layer_idx, q.dtype, x)  # a mask in q's dtype: SDPA casts it to that
        if rotary is not None:
            q, k = rotary.rotate(q, k)
        return q, k, v, self.scale * attn_mask.logit_scale, query_mask(mask, q)

    def flex_attend(self, x: torch.Tensor, ctx: PositionContext, bias: FlexBias) -> torch.Tensor:
        """The same attention through FlexAttention: the relative bias looked up per offset, no mask built.
        A log-n scale multiplies q (per token in a ragged batch): the kernel's ``scale`` stays the model's,
        since a float that follows the input size would be a guard of the compiled kernel (a recompile)."""
        q, k, v = self.project_normed(x)
        if ctx.query_scale is not None:
            q = (q.float() * ctx.query_scale).to(q.dtype)
        elif ctx.logit_scale != 1.0:
            q = q * ctx.logit_scale
        # q in one layout whether it was scaled or not: the compiled kernel guards on the strides
        return flex_bias_attention(q.contiguous(), k, v, bias, scale=self.scale)

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: object = None,
        is_causal: bool = False,
        rope: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if rope is not None:
            raise ValueError("a vispos-patched attention takes its positions from vispos, not from rope=")
        return positioned_attention(self, x, attn_mask, is_causal)


def require_context(attn_mask: object) -> None:
    """A patched attention takes its positions from the context the model builds once per forward; called
    without it (``model.blocks(tokens)``, a loop of one's own) it would run with no positions at all."""
    if not isinstance(attn_mask, PositionContext):
        got = "no attn_mask" if attn_mask is None else f"attn_mask of type {type(attn_mask).__name__}"
        raise ValueError(
            f"a vispos-patched attention needs the positional context of the forward pass, got {got}: call the "
            "model (forward, forward_features, forward_intermediates), or build the context with ctx = "
            "model.vispos_context(images, attn_mask=your_mask) and call each block as block(tokens, attn_mask=ctx)"
        )


def flex_supported(x: torch.Tensor) -> bool:
    """Where FlexAttention runs in torch 2.14: GPUs; on CPU only eager inference (no backward on CPU, and
    inductor cannot lower it inside a compiled ViT there). Elsewhere the layer uses SDPA with the mask."""
    if x.device.type != "cpu":
        return True
    return not torch.is_grad_enabled() and not torch.compiler.is_compiling()


def positioned_attention(
    attn: PatchedAttention, x: torch.Tensor, attn_mask: PositionContext, is_causal: bool
) -> torch.Tensor:
    """The patched attention's forward; a torch.fx leaf (the context is a Python object, not a tensor)."""
    require_context(attn_mask)
    attn_mask.check_tokens(x)  # a context of other tokens: refused by name, not a size error (or a broadcast)
    b, n, _ = x.shape
    gate = attn.gate(x).sigmoid() if attn.gate is not None else None
    dropout_p = attn.attn_drop.p if attn.training else 0.0
    flex = None if is_causal else attn_mask.flex(attn.layer_idx)
    if flex is not None and dropout_p == 0.0 and flex_supported(x):  # FlexAttention has no dropout
        out = attn.flex_attend(x, attn_mask, flex)
    else:
        q, k, v, scale, mask = attn.positioned(x, attn_mask)
        out = sdpa(q, k, v, mask=mask, is_causal=is_causal, fused=attn.fused_attn, scale=scale, dropout_p=dropout_p)
    out = out.transpose(1, 2)  # [B, N, heads, head_dim]
    if torch.compiler.is_exporting():  # a real copy: the ONNX decomposition's strides differ from the kernel's
        out = out.clone(memory_format=torch.contiguous_format)
    out = attn.norm(out.reshape(b, n, attn.num_heads * attn.head_dim))
    if gate is not None:
        out = out * gate
    return attn.proj_drop(attn.proj(out))


torch.fx.wrap("positioned_attention")
