"""STRING (Schenck et al. 2025): R(p) = exp(sum_k p_k L_k) with commuting skew-symmetric generators L_k.

Two variants of the paper, one scheme (``string2d``, option ``variant``):

- ``cayley`` (Cayley-STRING): a RoPE map (``rotary_nd.py``) in a learned orthogonal basis P per head,
  R(p) = P RoPE(p) P^T, P = (I - S)(I + S)^-1 (Cayley, S skew). q'.k' = (P^T q) . RoPE(p_k - p_q) (P^T k)
  is still relative; ``fold_string`` moves P^T into the q/k projection weights of a patched model, so that
  at inference the cost is that of RoPE.
- ``circulant`` (Circulant-STRING, the paper's choice when compute is tight): L_k = C_k - C_k^T with C_k
  circulant (first column c_k, learned per head). Circulant matrices commute and the DFT diagonalises
  them: R(p) x = irfft(rfft(x) e^{i phi(p)}), phi(p) = sum_k p_k Im(rfft(c_k - c_k reversed)), O(d log d)
  per token. In the real DFT basis this is RoPE with d/2 - 1 learned frequency vectors (bins 0 and d/2
  stay fixed).
"""

from __future__ import annotations

import torch
from torch import nn

from .._validate import check_choice, check_dim, check_float, check_int
from ..registry import register
from ._cache import InferenceCache
from .coords2d import COORDS, CoordAugment
from .rope import LAYOUTS, RFFT, Rotary, expand_angles
from .rope2d import Rope2dMixed
from .rotary_nd import _coords, axial_freqs, golden_freqs, linear_angles

FREQS: tuple[str, ...] = ("mixed", "axial", "golden")
VARIANTS: tuple[str, ...] = ("cayley", "circulant")


def cayley(skew: torch.Tensor) -> torch.Tensor:
    """Orthogonal P = (I - S)(I + S)^-1 from a skew-symmetric S [..., d, d] (fp32); S = 0 gives P = I."""
    s = skew.float()
    eye = torch.eye(s.shape[-1], device=s.device, dtype=s.dtype)
    return torch.linalg.solve(eye + s, eye - s)  # (I + S)^-1 (I - S): the two factors commute


def skew_part(raw: torch.Tensor) -> torch.Tensor:
    """The skew-symmetric matrix raw - raw^T [..., d, d]."""
    return raw - raw.transpose(-1, -2)


def reversed_circulant(c: torch.Tensor) -> torch.Tensor:
    """The first column of C^T for the circulant C with first column c [..., d]: c[-j mod d]."""
    return c.flip(-1).roll(1, dims=-1)


def circulant_spectrum(c: torch.Tensor) -> torch.Tensor:
    """Angular rates [..., d/2 + 1] of the rfft bins under L = C - C^T (C circulant, first column c [..., d]):
    the eigenvalues of L are i x these (L is real skew-symmetric: its spectrum is imaginary), fp32."""
    return torch.fft.rfft(c.float() - reversed_circulant(c.float()), dim=-1).imag


def circulant_init(rates: torch.Tensor, dim: int) -> torch.Tensor:
    """First columns c [..., dim] whose generators C - C^T turn rfft bins 1 .. dim/2 - 1 at ``rates``
    [..., dim/2 - 1] (bins 0 and dim/2 of a skew-symmetric circulant never turn)."""
    spectrum = torch.zeros(*rates.shape[:-1], dim // 2 + 1, dtype=torch.float64)
    spectrum[..., 1 : dim // 2] = rates.double()
    a = torch.fft.irfft(torch.complex(torch.zeros_like(spectrum), spectrum), n=dim, dim=-1)  # antisymmetric
    return (a / 2).float()  # c - c reversed = a when c = a / 2


@register("string2d", ndim=2, kind="rotary", trainable=True, relative=True, context=("dim", "num_heads"),
    per_layer=True,
    summary="STRING: 2D RoPE in a learned orthogonal basis per head (Cayley; fold_string moves it into q/k, "
    "outputs equal, tested) or circulant generators applied by FFT (variant='circulant')",
    extrapolation="as the RoPE inside (freqs: mixed / axial / golden); exactly relative (tested)",
    reference="Schenck et al. 2025 (STRING: Cayley-STRING, Circulant-STRING)")
class String2d(nn.Module):
    """STRING (Schenck et al. 2025), learned per head: ``variant`` ``cayley`` or ``circulant``.

    ``cayley``: R(p) = P RoPE(p) P^T, P = Cayley(S) orthogonal. ``freqs``: the RoPE inside: ``mixed``
    (learned per head, RoPE-Mixed's init), ``axial`` (``rope2d``'s map) or ``golden`` (``rope2d_golden``'s
    directions per head, magnitudes theta ** (-2j / dim)), the last two fixed. S starts at zero (P = I: the
    plain RoPE). The rotation applied to q and k is RoPE(p) P^T (the final P cancels in q . k); after
    ``fold_string(model)`` the projections produce P^T q, P^T k and the module applies RoPE(p) alone.

    ``circulant``: R(p) = exp(x L_x + y L_y), L_k = C_k - C_k^T, C_k circulant with learned first column
    c_k [d]; applied to q and k by rfft / irfft (``Rotary`` layout ``rfft``). c_k starts where the bins
    turn at RoPE-Mixed's initial frequencies (pairs 0 .. d/2 - 2); ``freqs`` and ``layout`` are Cayley's.
    """

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        variant: str = "cayley",
        freqs: str = "mixed",
        theta: float = 10.0,
        coords: str = "pixel",
        layout: str = "half",
    ) -> None:
        super().__init__()
        self.dim = check_dim(dim, 4, "string2d")
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.variant = check_choice("variant", variant, VARIANTS)
        self.freq_kind = check_choice("freqs", freqs, FREQS)
        self.theta = check_float("theta", theta, positive=True)
        self.coords = check_choice("coords", coords, COORDS)
        self.layout = check_choice("layout", layout, LAYOUTS)
        self.augment = CoordAugment()  # none: the coordinate pipeline of rope2d, unaugmented
        self.folded = False  # True once P^T lives in the q/k projections (``fold_string``)
        self.cache = InferenceCache()  # the rotations of the last grids, at inference
        if self.variant == "circulant":
            if self.freq_kind != "mixed" or self.layout != "half":
                raise ValueError("variant='circulant' learns its generators (RoPE-Mixed's init) and turns "
                                 "rfft bins: freqs and layout apply to variant='cayley'; leave them unset")  # fmt: skip
            init = Rope2dMixed.init_freqs(self.dim, self.num_heads, self.theta)[..., :-1]  # [2, heads, d/2 - 1]
            self.circulant = nn.Parameter(circulant_init(init.transpose(0, 1), self.dim))  # [heads, 2, d]
            return
        self.skew = nn.Parameter(torch.zeros(self.num_heads, self.dim, self.dim))  # S = skew - skew^T
        if self.freq_kind == "mixed":
            init = Rope2dMixed.init_freqs(self.dim, self.num_heads, self.theta)  # [2, heads, d/2]
            self.freqs = nn.Parameter(init.transpose(0, 1).contiguous())  # [heads, 2, d/2]
        else:
            self.register_buffer("freqs", self.fixed_freqs(), persistent=False)  # [2, d/2] or [heads, 2, d/2]

    def fixed_freqs(self) -> torch.Tensor:
        """The fixed frequencies of ``freqs='axial'`` [2, d/2] or ``'golden'`` [heads, 2, d/2], fp32."""
        if self.freq_kind == "axial":
            return axial_freqs(self.dim, self.theta)
        return golden_freqs(self.dim, self.num_heads, theta=self.theta)

    @torch.no_grad()
    def init_non_persistent_buffers(self) -> None:
        """timm's protocol for buffers a checkpoint does not hold (``reinit_non_persistent_buffers``, after
        ``to_empty``): fixed frequencies (``freqs='axial'`` or ``'golden'``) are computed again from the options."""
        if self.variant == "cayley" and self.freq_kind != "mixed":
            self.freqs.copy_(self.fixed_freqs())

    def basis(self) -> torch.Tensor:
        """P [heads, d, d], orthogonal, in fp32 (Cayley-STRING)."""
        if self.variant != "cayley":
            raise ValueError("basis() is Cayley-STRING's; circulant-STRING's basis is the fixed real DFT")
        return cayley(skew_part(self.skew))

    def spectrum(self) -> torch.Tensor:
        """Circulant-STRING's angular rates [heads, 2 (x, y), d/2 + 1] of the rfft bins, fp32."""
        return circulant_spectrum(self.circulant)

    def angles(
        self, grid: tuple[int, int], device: torch.device | None = None, cells: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-pair angles [(heads,) H*W or M, d/2], or per rfft bin [heads, H*W or M, d/2 + 1] (circulant)."""
        freqs = self.spectrum() if self.variant == "circulant" else self.freqs
        device = device or freqs.device
        return linear_angles(_coords(self, grid, device, cells), freqs.to(device))

    def forward(
        self, grid: tuple[int, int], device: torch.device | None = None, *, cells: torch.Tensor | None = None
    ) -> Rotary:
        """The rotations of the patches of ``grid``, or of the points ``cells`` [M, 2] of an image of that grid
        (a grid's, with the basis: computed once at inference, ``InferenceCache``)."""

        def rotation() -> Rotary:
            angles = self.angles(grid, device, cells)
            if self.variant == "circulant":
                return Rotary(angles.cos(), angles.sin(), RFFT)  # [heads, HW or M, d/2 + 1]
            angles = expand_angles(angles, self.layout)  # [(heads,) HW or M, d]
            basis = None if self.folded else self.basis()
            return Rotary(angles.cos(), angles.sin(), self.layout, basis=basis)

        if cells is not None:
            return rotation()
        return self.cache.get(self, (tuple(grid), str(device), self.folded), rotation)

    def get_extra_state(self) -> torch.Tensor:
        """Whether the basis was folded into the projections travels with the weights (they differ)."""
        return torch.tensor(self.folded)

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.folded = bool(state)

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, num_heads={self.num_heads}, variant={self.variant!r}, freqs={self.freq_kind!r}, "
            f"theta={self.theta}, coords={self.coords!r}, layout={self.layout!r}, folded={self.folded}"
        )


@torch.no_grad()
def fold_string(model: nn.Module) -> nn.Module:
    """Move every Cayley-STRING basis of a ``vispos.patch``-ed timm ViT into its q/k projections, in place.

    Layer i's q and k projections become P^T W (and P^T b) per head, and its ``string2d`` module stops
    applying P^T: the attention logits are unchanged (up to rounding) and the run-time cost is that of
    RoPE. Needs identity q/k norms (a norm between projection and rotation would see other channels)
    and as many k heads as q heads; circulant-STRING (applied by FFT) is refused. Returns the model.
    """
    positions = getattr(model, "vispos", None)
    modules = getattr(positions, "attention", None)
    if not isinstance(modules, nn.ModuleList) or not all(isinstance(m, String2d) for m in modules):
        raise ValueError("fold_string needs a model patched with pos='string2d' (vispos.patch(model, 'string2d'))")
    if any(m.variant != "cayley" for m in modules):
        raise ValueError("fold_string folds Cayley-STRING (variant='cayley'); circulant-STRING is applied by FFT "
                         "(O(d log d) per token) and stays unfolded")  # fmt: skip
    for block in model.blocks:
        attn = block.attn
        module = modules[attn.layer_idx]
        if module.folded:
            continue
        if not (isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity)):
            raise ValueError("fold_string needs identity q/k norms: a norm between projection and rotation "
                             "does not commute with the basis change; keep the unfolded model")  # fmt: skip
        if getattr(attn, "num_kv_heads", attn.num_heads) != attn.num_heads:
            raise ValueError("fold_string needs one k head per q head (no grouped-query attention)")
        pt = module.basis().transpose(-1, -2)  # P^T [heads, d, d]
        _fold_qk(attn, pt)
        module.folded = True
    return model


def _fold_qk(attn: nn.Module, pt: torch.Tensor) -> None:
    """W_q[h] <- P^T[h] W_q[h] (and biases) for q and k, fused ``qkv`` or separate ``q_proj`` / ``k_proj``."""
    heads, d, _ = pt.shape

    def fold_rows(t: torch.Tensor) -> torch.Tensor:  # [heads * d, ...] -> P^T applied per head
        rows = t.reshape(heads, d, -1).float()
        return (pt @ rows).reshape(t.shape).to(t.dtype)

    if attn.qkv is not None:
        c = heads * d
        w, b = attn.qkv.weight, attn.qkv.bias  # [3C, C], [3C]: q rows, k rows, v rows
        w[:c], w[c : 2 * c] = fold_rows(w[:c]), fold_rows(w[c : 2 * c])
        if b is not None:
            b[:c], b[c : 2 * c] = fold_rows(b[:c]), fold_rows(b[c : 2 * c])
        for bias in (attn.q_bias, attn.k_bias):  # Eva's separate biases [C]
            if bias is not None:
                bias.copy_(fold_rows(bias))
        return
    for proj in (attn.q_proj, attn.k_proj):
        proj.weight.copy_(fold_rows(proj.weight))
        if proj.bias is not None:
            proj.bias.copy_(fold_rows(proj.bias))
