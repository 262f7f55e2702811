"""Rotary schemes whose angles are a linear map of N-D coordinates, and STRING (that map in a learned basis).

Every scheme here turns rotary pair j of a head by the angle <omega_j, p> for a token at coordinates p
[A] (A axes; 2 for images), with a frequency matrix omega [A, d/2] (per head: [heads, A, d/2]):

- axial (``rope2d``): omega_j points along one axis; no pair mixes x and y, so logits split as
  f(dx) + g(dy) (no cross term).
- directional (``rope2d_golden``): fixed directions spread over the plane, pair j along the angle
  j x the golden angle pi (3 - sqrt 5), with RoPE's magnitudes theta ** (-2j / d): pairs see diagonal
  offsets (Xiong 2025, "golden gate RoPE").
- learned (``rope2d_mixed``, RoPE-Mixed): omega trained per head and layer.

All are exactly relative: R(p)^T R(p') = R(p' - p). STRING (Schenck et al. 2025) expresses q and k in a
learned orthogonal basis P first: R(p) = P RoPE(p) P^T with P = (I - S)(I + S)^-1 (Cayley, S skew), so
q'.k' = (P^T q) . RoPE(p_k - p_q) (P^T k) is still relative. ``fold_string`` moves P^T into the q/k
projection weights of a patched model: at inference the cost is that of RoPE.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._validate import check_choice, check_dim, check_float, check_grid, check_int
from ..registry import register
from .rope import LAYOUTS, Rotary, expand_angles
from .rope2d import COORDS, CoordAugment, Rope2dMixed, frame_coords, grid_coords
from .rope_scaling import rope_inv_freq

GOLDEN_ANGLE: float = math.pi * (3.0 - math.sqrt(5.0))  # 2 pi / phi^2, about 137.5 degrees
FREQS: tuple[str, ...] = ("mixed", "axial", "golden")


def linear_angles(coords: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """coords [N, A] x freqs [(heads,) A, F] -> per-pair angles [(heads,) N, F] in fp32: <omega_j, p>."""
    return coords.float() @ freqs.float()


def golden_freqs(dim: int, theta: float) -> torch.Tensor:
    """Directional frequencies [2 (x, y), dim / 2]: pair j along the angle j x golden angle, magnitude
    theta ** (-2j / dim) (1D RoPE's range)."""
    mag = rope_inv_freq(dim, theta)  # [d/2]
    phase = torch.arange(dim // 2, dtype=torch.float64) * GOLDEN_ANGLE
    return torch.stack((mag * phase.cos(), mag * phase.sin())).float()


def axial_freqs(dim: int, theta: float) -> torch.Tensor:
    """``rope2d``'s frequencies as a map [2 (x, y), dim / 2]: the first half of the pairs turn with x at
    theta ** (-4j / dim), the second half with y."""
    mag = rope_inv_freq(dim // 2, theta)  # [d/4]
    zero = torch.zeros_like(mag)
    return torch.stack((torch.cat((mag, zero)), torch.cat((zero, mag))))


def cayley(skew: torch.Tensor) -> torch.Tensor:
    """Orthogonal P = (I - S)(I + S)^-1 from a skew-symmetric S [..., d, d] (fp32); S = 0 gives P = I."""
    s = skew.float()
    eye = torch.eye(s.shape[-1], device=s.device, dtype=s.dtype)
    return torch.linalg.solve(eye + s, eye - s)  # (I + S)^-1 (I - S): the two factors commute


def skew_part(raw: torch.Tensor) -> torch.Tensor:
    """The skew-symmetric matrix raw - raw^T [..., d, d]."""
    return raw - raw.transpose(-1, -2)


def _coords(
    module: nn.Module, grid: tuple[int, int], device: torch.device | None, cells: torch.Tensor | None = None
) -> torch.Tensor:
    """(x, y) coordinates [H*W, 2] of a patch grid (or of ``cells`` [M, 2] on it): indices or DINOv3's
    normalized frame (x 2 pi)."""
    yx = grid_coords(check_grid(grid), module.coords, device, cells=cells)
    return frame_coords(yx, "xy", module.augment, module.training, module.coords == "normalized")


@register("rope2d_golden", ndim=2, kind="rotary", trainable=False, relative=True, context=("dim",),
    summary="directional 2D RoPE: fixed frequency directions at multiples of the golden angle (x and y mixed)",
    extrapolation="unseen angles at pixel coords (as rope2d); normalized coords",
    reference="Xiong 2025 (golden gate RoPE); Heo et al. 2024 (RoPE-Mixed, learned directions)")
class Rope2dGolden(nn.Module):
    """Directional 2D RoPE: every rotary pair turns with its own direction of the plane (fixed).

    Pair j turns by <omega_j, (x, y)> with omega_j = theta ** (-2j / dim) (cos j g, sin j g), g the golden
    angle, so consecutive frequencies point in well-spread directions and diagonal offsets are seen
    directly. The fixed counterpart of ``rope2d_mixed``'s learned directions; relative, with cross terms.
    """

    def __init__(self, *, dim: int, theta: float = 100.0, coords: str = "pixel", layout: str = "half") -> None:
        super().__init__()
        self.dim = check_dim(dim, 2, "rope2d_golden")
        self.theta = check_float("theta", theta, positive=True)
        self.coords = check_choice("coords", coords, COORDS)
        self.layout = check_choice("layout", layout, LAYOUTS)
        self.augment = CoordAugment()  # none: the coordinate pipeline of rope2d, unaugmented
        self.register_buffer("freqs", golden_freqs(self.dim, self.theta), persistent=False)  # [2, d/2]

    def forward(
        self, grid: tuple[int, int], device: torch.device | None = None, *, cells: torch.Tensor | None = None
    ) -> Rotary:
        """The rotations of the patches of ``grid``, or of the points ``cells`` [M, 2] of an image of that grid."""
        device = device or self.freqs.device
        angles = linear_angles(_coords(self, grid, device, cells), self.freqs.to(device))  # [HW or M, d/2]
        angles = expand_angles(angles, self.layout)  # [HW, d]
        return Rotary(angles.cos(), angles.sin(), self.layout)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, theta={self.theta}, coords={self.coords!r}, layout={self.layout!r}"


@register("string2d", ndim=2, kind="rotary", trainable=True, relative=True, context=("dim", "num_heads"),
    per_layer=True,
    summary="STRING: 2D RoPE in a learned orthogonal basis per head (Cayley); fold_string moves it into q/k "
    "(outputs equal, tested)",
    extrapolation="as the RoPE inside (freqs: mixed / axial / golden); exactly relative (tested)",
    reference="Schenck et al. 2025 (STRING, Cayley-STRING)")
class String2d(nn.Module):
    """STRING (Schenck et al. 2025): R(p) = P RoPE(p) P^T, P = Cayley(S) orthogonal and learned per head.

    ``freqs``: the RoPE inside: ``mixed`` (learned per head, RoPE-Mixed's init), ``axial`` (``rope2d``'s
    map) or ``golden`` (``rope2d_golden``'s), the last two fixed. S starts at zero (P = I: the plain
    RoPE). The rotation applied to q and k is RoPE(p) P^T (the final P cancels in q . k); after
    ``fold_string(model)`` the projections produce P^T q, P^T k and the module applies RoPE(p) alone.
    """

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        freqs: str = "mixed",
        theta: float = 10.0,
        coords: str = "pixel",
        layout: str = "half",
    ) -> None:
        super().__init__()
        self.dim = check_dim(dim, 4, "string2d")
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.freq_kind = check_choice("freqs", freqs, FREQS)
        self.theta = check_float("theta", theta, positive=True)
        self.coords = check_choice("coords", coords, COORDS)
        self.layout = check_choice("layout", layout, LAYOUTS)
        self.augment = CoordAugment()  # none: the coordinate pipeline of rope2d, unaugmented
        self.skew = nn.Parameter(torch.zeros(self.num_heads, self.dim, self.dim))  # S = skew - skew^T
        if self.freq_kind == "mixed":
            init = Rope2dMixed.init_freqs(self.dim, self.num_heads, self.theta)  # [2, heads, d/2]
            self.freqs = nn.Parameter(init.transpose(0, 1).contiguous())  # [heads, 2, d/2]
        else:
            fixed = axial_freqs if self.freq_kind == "axial" else golden_freqs
            self.register_buffer("freqs", fixed(self.dim, self.theta), persistent=False)  # [2, d/2]
        self.folded = False  # True once P^T lives in the q/k projections (``fold_string``)

    def basis(self) -> torch.Tensor:
        """P [heads, d, d], orthogonal, in fp32."""
        return cayley(skew_part(self.skew))

    def angles(
        self, grid: tuple[int, int], device: torch.device | None = None, cells: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-pair angles [(heads,) H*W or M, d/2]."""
        device = device or self.skew.device
        return linear_angles(_coords(self, grid, device, cells), self.freqs.to(device))

    def forward(
        self, grid: tuple[int, int], device: torch.device | None = None, *, cells: torch.Tensor | None = None
    ) -> Rotary:
        """The rotations of the patches of ``grid``, or of the points ``cells`` [M, 2] of an image of that grid."""
        angles = expand_angles(self.angles(grid, device, cells), self.layout)  # [(heads,) HW or M, d]
        basis = None if self.folded else self.basis()
        return Rotary(angles.cos(), angles.sin(), self.layout, basis=basis)

    def get_extra_state(self) -> torch.Tensor:
        """Whether the basis was folded into the projections travels with the weights (they differ)."""
        return torch.tensor(self.folded)

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.folded = bool(state)

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, num_heads={self.num_heads}, freqs={self.freq_kind!r}, theta={self.theta}, "
            f"coords={self.coords!r}, layout={self.layout!r}, folded={self.folded}"
        )


@torch.no_grad()
def fold_string(model: nn.Module) -> nn.Module:
    """Move every STRING basis of a ``vispos.patch``-ed timm ViT into its q/k projections, in place.

    Layer i's q and k projections become P^T W (and P^T b) per head, and its ``string2d`` module stops
    applying P^T: the attention logits are unchanged (up to rounding) and the run-time cost is that of
    RoPE. Needs identity q/k norms (a norm between projection and rotation would see other channels)
    and as many k heads as q heads. Returns the model.
    """
    positions = getattr(model, "vispos", None)
    modules = getattr(positions, "attention", None)
    if not isinstance(modules, nn.ModuleList) or not all(isinstance(m, String2d) for m in modules):
        raise ValueError("fold_string needs a model patched with pos='string2d' (vispos.patch(model, 'string2d'))")
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
