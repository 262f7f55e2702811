"""Rotary position embedding (RoPE): the rotation maths every rotary scheme shares, and 1D RoPE.

The 2D schemes (axial ``rope2d``, ``rope2d_mixed``) are in ``rope2d.py``, multimodal RoPE in ``mrope.py``.

Layouts of the rotary pairs inside a head of ``dim`` channels:

- ``half`` (default, GPT-NeoX / timm ``RotaryEmbeddingCat`` style): channel i pairs with i + dim/2.
  x: [x0 x1 .. x(d/2-1) | x(d/2) .. x(d-1)]  rotate_half(x): [-x(d/2) .. -x(d-1) | x0 .. x(d/2-1)]
- ``interleaved`` (the original RoFormer / GPT-J form): channel 2i pairs with 2i + 1.
  x: [x0 x1 x2 x3 ...]  rotate_interleaved(x): [-x1 x0 -x3 x2 ...]

Angles are computed in fp32 and the rotated result is cast back to the input dtype.

Beyond cos/sin pairs, a ``Rotary`` may carry a learned orthogonal ``basis`` P (STRING: the rotation is
P R(p) P^T) or general ``blocks``: one b x b rotation per block of b channels (ComRoPE, LieRE). The
``rfft`` layout (Circulant-STRING) turns the frequency bins of the channels instead of channel pairs: cos/sin
[..., N, d/2 + 1] of one angle per bin, applied as irfft(rfft(x) e^{i angle}) in O(d log d).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
from einops import rearrange
from torch import nn
from torch.autograd import forward_ad

from .._state import decode, encode
from .._validate import check_choice, check_dim, check_float, check_positions
from ..registry import register
from .rope_eager import RotateHalf, at_least_fp32, rotate_half_in_place
from .rope_fused import fused_basis, fused_blocks
from .rope_scaling import RopeScaling, as_scaling, check_scaling_dim, scaled_inv_freq

LAYOUTS: tuple[str, ...] = ("half", "interleaved")
RFFT = "rfft"  # the layout of a circulant rotation: one angle per rfft bin (not a user option)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    pairs = rearrange(x, "... (d r) -> ... d r", r=2)
    x1, x2 = pairs.unbind(-1)
    return rearrange(torch.stack((-x2, x1), dim=-1), "... d r -> ... (d r)")


def expand_angles(angles: torch.Tensor, layout: str) -> torch.Tensor:
    """Per-pair angles [..., d/2] -> per-channel angles [..., d] in the given layout."""
    if layout == "half":
        return torch.cat((angles, angles), dim=-1)
    return angles.repeat_interleave(2, dim=-1)


PROMOTING = (torch.float32, torch.bfloat16, torch.float16)  # x rotated as it is, its products fp32
TABLES = (torch.float32,)  # cos/sin as they are built


def _promoting(x: torch.Tensor) -> torch.Tensor:
    """x as the rotation reads it: a float of at most fp32's precision as it is (multiplied by fp32 cos/sin it
    gives fp32, exactly as x.float() would, without a pass that writes an fp32 copy of q or k), else x.float()."""
    return x if x.dtype in PROMOTING else x.float()


def _traced() -> bool:
    """Inside a trace or a compile: the rotation stays the formula, which the compiler fuses. Likewise under
    functorch's transforms (``torch.func.grad``, ``vmap``, ``jacrev``, ``jvp``) and forward-mode AD, which the
    formula's ops support and the eager Function does not."""
    return (torch.compiler.is_compiling() or torch.jit.is_tracing() or torch._C._are_functorch_transforms_active()
            or forward_ad._current_level >= 0)  # fmt: skip


def _eager_inference(*tensors: torch.Tensor) -> bool:
    """No autograd graph to record and no trace or compile: the rotation may write into its output in place."""
    return not _traced() and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """Rotate x [..., N, d] by per-channel cos/sin [..., N, d] (broadcast); fp32 maths, x's dtype out.
    The channel shuffle (negation and concatenation, exact) runs in x's dtype; the products promote to fp32.
    In eager mode the ``half`` layout takes three passes instead of about ten (``rope_eager``): in place at
    inference, with gradients through ``RotateHalf`` (its backward the inverse rotation); a trace or compile
    keeps this formula."""
    if layout == RFFT:
        return apply_rfft(x, cos, sin)
    if layout == "half" and x.dtype in PROMOTING and cos.dtype in TABLES and sin.dtype in TABLES and not _traced():
        if _eager_inference(x, cos, sin):
            return rotate_half_in_place(x, cos, sin)
        return RotateHalf.apply(x, cos, sin)
    rot = rotate_half if layout == "half" else rotate_interleaved
    xp = _promoting(x)
    return (xp * at_least_fp32(cos) + rot(xp) * at_least_fp32(sin)).to(x.dtype)


def apply_rope_sections(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sections: tuple[int, ...]
) -> torch.Tensor:
    """``apply_rope`` in the ``half`` layout inside each of the contiguous channel ``sections`` (N-D RoPE:
    one section per axis, [t | h | w]); channels past their sum form one more section."""
    sizes = [s for s in (*sections, x.shape[-1] - sum(sections)) if s]  # an empty section turns nothing
    xp = _promoting(x)
    turned = torch.cat([rotate_half(part) for part in xp.split(sizes, dim=-1)], dim=-1)
    return (xp * at_least_fp32(cos) + turned * at_least_fp32(sin)).to(x.dtype)


def apply_rfft(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Circulant rotation of x [..., N, d]: bin m of rfft(x) is turned by the angle whose cos/sin
    [..., N, d/2 + 1] are given (broadcast), then irfft. fp32 maths (also under autocast), x's dtype out."""
    with torch.autocast(x.device.type, enabled=False):
        re, im = torch.view_as_real(torch.fft.rfft(x.float(), dim=-1)).unbind(-1)  # [..., N, d/2 + 1] each
        turned = torch.complex(re * cos - im * sin, re * sin + im * cos)  # X_m e^{i angle_m}
        return torch.fft.irfft(turned, n=x.shape[-1], dim=-1).to(x.dtype)


def change_basis(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """x [B, heads, N, d] -> P^T x per token (row form: x @ P) with P = ``basis`` [(heads,) d, d], fp32 out."""
    with torch.autocast(x.device.type, enabled=False):  # fp32 under autocast too
        return x.float() @ basis.float()  # [B, heads, N, d] @ [(heads,) d, d]: one matrix per head


def apply_blocks(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., N, d] by block rotations [..., N, d/b, b, b] (broadcast): channel block m of x is
    multiplied by its b x b matrix. fp32 maths, x's dtype out. In eager mode an einsum, not a broadcast matmul:
    the matmul would copy the blocks for every batch row and head (a dense LieRE rotation 50x slower). Under
    ``torch.compile``: ``rope_fused.fused_blocks``, one generated kernel."""
    b = blocks.shape[-1]
    with torch.autocast(x.device.type, enabled=False):  # fp32 under autocast too
        if torch.compiler.is_compiling() and x.dim() == 4:
            return fused_blocks(x, blocks)
        xb = rearrange(x.float(), "... n (m b) -> ... n m b", b=b)  # [..., N, d/b, b]
        out = torch.einsum("...nmij,...nmj->...nmi", blocks.float(), xb)
    return rearrange(out, "... n m b -> ... n (m b)").to(x.dtype)


def stacked_views(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q and k as one view [2, ...] of the buffer they share, when k is q shifted by a fixed offset (timm's and
    transformers' fused qkv projection: q, k, v of one [B, N, 3, heads, d] output); None otherwise."""
    if q.shape != k.shape or q.stride() != k.stride() or q.dtype != k.dtype or not torch._C._is_alias_of(q, k):
        return None
    shift = k.storage_offset() - q.storage_offset()
    if shift <= 0:
        return None
    return q.as_strided((2, *q.shape), (shift, *q.stride()), q.storage_offset())


@dataclass
class Rotary:
    """Angles ready to apply to q and k: cos/sin [..., N, head_dim] in fp32, in ``layout``.

    xPos adds per-channel scales: q is multiplied by ``q_scale`` and k by ``k_scale`` (same shape).
    ``basis`` [(heads,) d, d], orthogonal (STRING): q and k are first expressed in that basis (P^T x),
    then turned by cos/sin; the final multiplication by P is left out, as it cancels in q . k.
    ``blocks`` [(heads,) N, d/b, b, b] (ComRoPE, LieRE): general block rotations, used instead of cos/sin,
    which are then None. ``layout`` ``rfft`` (Circulant-STRING): cos/sin [(heads,) N, d/2 + 1] turn the
    rfft bins of q and k (``apply_rfft``).
    """

    cos: torch.Tensor | None
    sin: torch.Tensor | None
    layout: str = "half"
    q_scale: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    temperature: float = 1.0  # the scaling method's attention factor, already folded into cos and sin
    basis: torch.Tensor | None = None
    blocks: torch.Tensor | None = None
    sections: tuple[int, ...] = ()  # half layout paired inside these contiguous channel sections (N-D RoPE)

    @property
    def heads(self) -> int:
        """Heads the rotation is given for; 1 when every head shares it."""
        if self.blocks is not None:
            return self.blocks.shape[0] if self.blocks.dim() == 5 else 1
        heads = self.cos.shape[0] if self.cos.dim() == 3 else 1
        return self.basis.shape[0] if self.basis is not None and self.basis.dim() == 3 else heads

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: [B, heads, N, head_dim] -> rotated (and, for xPos, scaled) q, k."""
        if self.blocks is not None:
            return apply_blocks(q, self.blocks), apply_blocks(k, self.blocks)
        if self.basis is not None:
            if torch.compiler.is_compiling() and self.layout in LAYOUTS and q.dim() == 4:  # one kernel each
                rot = rotate_half if self.layout == "half" else rotate_interleaved
                with torch.autocast(q.device.type, enabled=False):  # fp32 under autocast too
                    return fused_basis(q, self.basis, self.cos, self.sin, rot), fused_basis(
                        k, self.basis, self.cos, self.sin, rot)  # fmt: skip
            qb, kb = change_basis(q, self.basis), change_basis(k, self.basis)
            rq, rk = apply_rope(qb, self.cos, self.sin, self.layout), apply_rope(kb, self.cos, self.sin, self.layout)
            return rq.to(q.dtype), rk.to(k.dtype)
        if self.sections and self.layout == "half":  # interleaved pairs never cross a section
            return apply_rope_sections(q, self.cos, self.sin, self.sections), apply_rope_sections(
                k, self.cos, self.sin, self.sections
            )
        if self.q_scale is None:
            joint = stacked_views(q, k) if self.layout == "half" and _eager_inference(q, k, self.cos) else None
            if joint is not None:  # q and k, two views of one qkv buffer: rotated in one call
                return apply_rope(joint, self.cos, self.sin, self.layout).unbind(0)
            return apply_rope(q, self.cos, self.sin, self.layout), apply_rope(k, self.cos, self.sin, self.layout)
        qc, qs = self.cos * self.q_scale, self.sin * self.q_scale
        kc, ks = self.cos * self.k_scale, self.sin * self.k_scale
        return apply_rope(q, qc, qs, self.layout), apply_rope(k, kc, ks, self.layout)

    def with_prefix(self, num_prefix_tokens: int) -> Rotary:
        """Prepend identity rotations for prefix tokens (cls, registers): they stay unrotated, but take the
        scaling's attention factor (``temperature``) as every token does, as transformers' token at position 0
        (angle 0) does: every logit, prefix rows included, gets the same factor^2 (tests/test_yarn_prefix.py)."""
        if num_prefix_tokens == 0:
            return self

        def pad(t: torch.Tensor | None, value: float) -> torch.Tensor | None:
            if t is None:
                return None
            shape = (*t.shape[:-2], num_prefix_tokens, t.shape[-1])
            return torch.cat((t.new_full(shape, value), t), dim=-2)

        if self.blocks is not None:  # identity matrices for the prefix tokens: [..., P, d/b, b, b]
            blocks = self.blocks
            eye = torch.eye(blocks.shape[-1], device=blocks.device, dtype=blocks.dtype)
            ident = eye.expand(*blocks.shape[:-4], num_prefix_tokens, *blocks.shape[-3:])
            return replace(self, blocks=torch.cat((ident, blocks), dim=-4))
        # identity rotation, at the same temperature (scaling attention factor) as the patch tokens
        cos, sin = pad(self.cos, self.temperature), pad(self.sin, 0.0)
        return replace(self, cos=cos, sin=sin, q_scale=pad(self.q_scale, 1.0), k_scale=pad(self.k_scale, 1.0))

    def layers(self) -> list[Rotary]:
        """Every layer of rotations stacked over layers (cos/sin [layers, ...], ``Rope2dMixed.stacked``). Taken
        apart in one op (``unbind``), so that in training their gradients come back in one stack: indexing each
        layer would write a zero-filled gradient of the whole stack per layer, summed: L^2 passes."""
        return [replace(self, cos=c, sin=s) for c, s in zip(self.cos.unbind(0), self.sin.unbind(0), strict=True)]

    def take(self, index: torch.Tensor) -> Rotary:
        """The rotations of a token subset per sample: ``index`` [B, M] into the token axis -> tensors with
        a batch axis first, [B, heads or 1, M, ...], ready for q, k [B, heads, M, head_dim] (patch dropout,
        MAE-style masking: each kept token keeps the rotation of its place in the grid)."""

        def pick(t: torch.Tensor | None, token_axis: int, dims: int) -> torch.Tensor | None:
            if t is None:
                return None
            out = t.movedim(token_axis, 0)[index]  # [B, M, (heads,) ...]
            return out.movedim(2, 1) if t.dim() > dims else out.unsqueeze(1)  # [B, heads | 1, M, ...]

        return replace(
            self,
            cos=pick(self.cos, -2, 2),
            sin=pick(self.sin, -2, 2),
            q_scale=pick(self.q_scale, -2, 2),
            k_scale=pick(self.k_scale, -2, 2),
            blocks=pick(self.blocks, -4, 4),
        )

def saved_scaling(record: dict[str, object] | None) -> dict[str, object] | None:
    """A scaling record from a checkpoint, as ``as_scaling`` reads it: vispos 0.1 wrote YaRN's defaults
    (beta_fast 32, beta_slow 1) into the record of every type; they are dropped where the type has no use
    for them, and fields left unset (None) are left out."""
    if record is None:
        return None
    kept = {k: v for k, v in record.items() if v is not None}
    if kept.get("type") != "yarn" and (kept.get("beta_fast"), kept.get("beta_slow")) == (32.0, 1.0):
        kept = {k: v for k, v in kept.items() if k not in ("beta_fast", "beta_slow")}
    return kept

def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """positions [..., N] x inv_freq [F] -> angles [..., N, F] in fp32."""
    return positions.float()[..., None] * inv_freq.to(positions.device)


@register("rope", ndim=1, kind="rotary", trainable=False, relative=True, context=("dim",), scalable=True,
    summary="rotary, rotate-half or interleaved layout",
    extrapolation="degrades past the training length unscaled (docs/seq1d.md); "
    "linear/ntk/dynamic_ntk/yarn/longrope/llama3 scaling",
    reference="Su et al. 2021 (RoFormer)")
class Rope(nn.Module):
    """1D RoPE (Su et al. 2021) with optional scaling for sequences longer than training.

    ``scaling`` is read-only; switch it with ``set_scaling`` or, on a whole model, ``vispos.configure``.
    """

    def __init__(
        self,
        *,
        dim: int,
        theta: float = 10000.0,
        layout: str = "half",
        scaling: RopeScaling | dict | str | None = None,
    ) -> None:
        super().__init__()
        self.dim = check_dim(dim, 2, "rope")
        self.theta = check_float("theta", theta, positive=True)
        self.layout = check_choice("layout", layout, LAYOUTS)
        self._scaling: RopeScaling | None = None
        self.set_scaling(scaling)

    @property
    def scaling(self) -> RopeScaling | None:
        """RoPE scaling in use (None: plain RoPE)."""
        return self._scaling

    def set_scaling(self, scaling: RopeScaling | dict | str | None, **options: object) -> None:
        """Switch scaling (e.g. for evaluation beyond the training length) or off (``None``).

        ``scaling``: a ``RopeScaling``, a type name with its fields as keywords, or a dict of fields.
        """
        scaling = as_scaling(scaling, **options)
        check_scaling_dim(scaling, self.dim)
        self._scaling = scaling

    def get_extra_state(self) -> torch.Tensor:
        """The scaling in use travels with the weights (a tensor record, ``vispos._state``)."""
        return encode({"scaling": None if self.scaling is None else asdict(self.scaling)})

    def set_extra_state(self, state: torch.Tensor | dict[str, object]) -> None:
        self.set_scaling(saved_scaling(decode(state)["scaling"]))

    def inv_freq(self, length: int) -> tuple[torch.Tensor, float]:
        return scaled_inv_freq(self.dim, self.theta, self.scaling, length)

    def forward(self, positions: torch.Tensor | int) -> Rotary:
        """positions: length or integer positions [N] / [B, N] -> Rotary with cos/sin [(B,) N, dim]."""
        positions = check_positions(positions)
        length = int(positions.max()) + 1 if self.scaling is not None else positions.shape[-1]
        inv_freq, temperature = self.inv_freq(length)
        angles = expand_angles(rope_angles(positions, inv_freq), self.layout)
        if positions.dim() == 2:
            angles = angles[:, None]  # [B, 1, N, d]: broadcast over heads
        return Rotary(angles.cos() * temperature, angles.sin() * temperature, self.layout, temperature=temperature)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, theta={self.theta}, layout={self.layout!r}, scaling={self.scaling}"
