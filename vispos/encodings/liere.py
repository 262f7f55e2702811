"""LieRE (Ostmeier et al. 2025): rotations R(p) = exp(sum_k p_k A_k) of learned skew-symmetric generators.

As LieRE's code defaults (``ModelArgs``: ``generator_dim`` the head dimension, ``rotary_embedding_per_layer``
and ``_per_head`` False; its README's core): dense generators (one skew matrix of the head dimension per
axis), one set shared by every layer and head, coordinates ``linspace(0, n / n_train, n)`` per
axis (n patches now, n_train at training: the per-patch spacing is kept at another resolution, so a
larger grid reaches coordinates beyond the training span). ``block_size``, ``per_head`` and
``per_layer`` give the block-diagonal form (block m of axis k holds its own b x b skew matrix A_km, a
token at p turning block m by exp(sum_k p_k A_km)) with generators per head and per layer.
Generators of different axes need not commute, so in general R(p)^T R(p') != R(p' - p): LieRE is *not*
exactly relative (ComRoPE, ``comrope.py``, restores that by making the generators commute).
``generator_rotations`` and ``xy_coords`` are the shared maths of both.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._state import decode, encode
from .._validate import check_bool, check_choice, check_dim, check_float, check_grid, check_int
from ..registry import register
from ._cache import InferenceCache
from .coords2d import grid_coords
from .rope import Rotary
from .rope_fused import coordinate_sum

# patch coordinates of the block-rotation schemes: ``liere`` linspace(0, n / n_train, n) per axis (LieRE);
# ``unit`` patch centres (i + 0.5) / n in [0, 1] (ComRoPE); ``normalized`` centres in [-1, 1];
# ``pixel`` integer indices
COORDS: tuple[str, ...] = ("liere", "unit", "normalized", "pixel")


# elements of the exponent per ``matrix_exp`` call (4 MiB in fp32): its scratch tensors are several times its input,
# so a large grid is exponentiated in slices of tokens (the same values: each matrix is exponentiated on its own)
EXP_CHUNK = 2**20


def generator_rotations(coords: torch.Tensor, generators: torch.Tensor) -> torch.Tensor:
    """Block rotations exp(sum_k p_k A_km): coords [N, A] x generators [(heads,) A, M, b, b] (skew) ->
    [(heads,) N, M, b, b], in fp32 (``torch.linalg.matrix_exp``), ``EXP_CHUNK`` elements of exponent at a time
    in eager mode (a traced or compiled program keeps one call: its sizes may be symbolic)."""
    with torch.autocast(coords.device.type, enabled=False):  # autocast would run a product in bf16 / fp16
        summed = coordinate_sum(coords, generators, 3)  # sum_k p_k A_km: [(heads,) N, M, b, b]
        axis = generators.dim() - 4  # the token axis: 1 with heads, else 0
        n, per_token = summed.shape[axis], summed[..., 0, :, :, :].numel() if axis else summed[0].numel()
        rows = max(2, EXP_CHUNK // per_token)
        if torch.compiler.is_compiling() or torch.jit.is_tracing() or n <= rows:
            # a stack of matrices [-1, b, b]: inductor may lay a 5-D exponent out token-major, which the
            # exponential's kernel cannot view as one batch
            b = summed.shape[-1]
            return torch.linalg.matrix_exp(summed.reshape(-1, b, b)).reshape(summed.shape)
        # slices of at least two matrices: matrix_exp takes another approximation for a batch of one
        sizes = [rows] * (n // rows) + ([n % rows] if n % rows else [])
        if sizes[-1] == 1:
            sizes[-2:] = [sizes[-2] + 1]
        out = torch.empty_like(summed)
        start = 0
        for size in sizes:
            out.narrow(axis, start, size).copy_(torch.linalg.matrix_exp(summed.narrow(axis, start, size).contiguous()))
            start += size
        return out


def upper_skew(raw: torch.Tensor) -> torch.Tensor:
    """LieRE's parametrisation: U - U^T with U the strict upper triangle of raw [..., b, b]."""
    upper = torch.triu(raw, diagonal=1)
    return upper - upper.transpose(-1, -2)


def xy_coords(
    grid: tuple[int, int],
    coords: str,
    device: torch.device | None,
    cells: torch.Tensor | None = None,
    *,
    train_grid: tuple[int, int] | None = None,
) -> torch.Tensor:
    """(x, y) patch coordinates [H*W, 2] (or of ``cells`` [M, 2], (y, x) in patch units) in one of ``COORDS``;
    ``liere`` needs the ``train_grid``."""
    grid = check_grid(grid)
    if coords in ("pixel", "normalized"):
        return grid_coords(grid, coords, device, cells=cells).flip(-1)
    if cells is None:
        at = torch.cartesian_prod(*(torch.arange(n, device=device) for n in grid)).float()  # [HW, 2] (y, x)
    else:
        at = cells.to(device=device, dtype=torch.float32)
    n = torch.tensor(grid, device=at.device, dtype=torch.float32)
    if coords == "unit":
        yx = (at + 0.5) / n
    else:  # liere: i * (n / n_train) / (n - 1), the points of linspace(0, n / n_train, n); 0 for n = 1
        if train_grid is None:
            raise ValueError("coords='liere' needs train_grid, the training grid (H, W)")
        span = n / torch.tensor(train_grid, device=at.device, dtype=torch.float32)
        yx = at * span / (n - 1).clamp(min=1)
    return yx.flip(-1)


@register("liere2d", ndim=2, kind="rotary", trainable=True, relative=False, context=("dim", "num_heads", "train_grid"),
    summary="LieRE: rotations exp(x A_x + y A_y) of learned skew generators, dense and shared by all layers and "
    "heads as LieRE's code (block_size, per_head, per_layer: block form); not relative",
    extrapolation="LieRE's coords linspace(0, n / n_train): patch spacing kept, beyond the training span on "
    "larger grids; not translation invariant (tested)",
    reference="Ostmeier et al. 2025 (LieRE)")  # fmt: skip
class Liere2d(nn.Module):
    """LieRE on a patch grid: generators [(heads,) 2 (x, y), d/b, b, b].

    As LieRE's code: the raw parameters start uniform in [0, ``init_range``) (2 pi), the generators are
    their strict upper triangle minus its transpose. Defaults as LieRE's code defaults:
    ``block_size`` the head dimension (dense), one set for all heads (``per_head=False``) and all
    layers (``per_layer=False``), ``coords="liere"`` (``linspace(0, n / n_train, n)`` per axis, n_train
    from ``train_grid``). Other ``coords``: ``unit``, ``normalized`` (centres in [-1, 1]), ``pixel``.
    Prefix tokens are not rotated (LieRE gives its cls token the identity).

    n_train is ``coord_grid``: the training grid, or, once a checkpoint made at another grid is loaded, that
    checkpoint's (as cpb2d's ``offset_grid``), so the generators keep the patch spacing they learned on; it
    travels with the weights.
    """

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        train_grid: tuple[int, int] = (14, 14),
        block_size: int | None = None,
        per_head: bool = False,
        per_layer: bool = False,
        coords: str = "liere",
        init_range: float = 2 * math.pi,
    ) -> None:
        super().__init__()
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.train_grid = check_grid(train_grid, "train_grid")
        self.per_head = check_bool("per_head", per_head)
        self.per_layer = check_bool("per_layer", per_layer)  # read by the host (one module per layer)
        dim = check_int("dim (head dimension)", dim, minimum=2)
        self.block_size = dim if block_size is None else check_int("block_size", block_size, minimum=2)
        self.dim = check_dim(dim, self.block_size, "liere2d", what=f"head dimension (blocks of {self.block_size})")
        self.coords = check_choice("coords", coords, COORDS)
        self.init_range = check_float("init_range", init_range, positive=True)
        b, heads = self.block_size, ((self.num_heads,) if self.per_head else ())
        self.raw = nn.Parameter(torch.rand(*heads, 2, self.dim // b, b, b) * self.init_range)
        self.coord_grid = self.train_grid
        self.cache = InferenceCache()  # the rotations of the last grids, at inference

    def get_extra_state(self) -> torch.Tensor:
        return encode({"coord_grid": list(self.coord_grid)})

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.coord_grid = check_grid(tuple(decode(state)["coord_grid"]), "coord_grid")

    def resample_state(
        self, state: dict[str, torch.Tensor], prefix: str, old_grid: tuple[int, int], new_grid: tuple[int, int]
    ) -> None:
        """Loading a checkpoint made at ``old_grid``: a record made before liere2d kept its coordinate grid
        stands for that grid (its coordinates' n_train); the generators are kept as they are."""
        state.setdefault(f"{prefix}_extra_state", encode({"coord_grid": list(old_grid)}))

    def _load_from_state_dict(
        self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
        missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str],
    ) -> None:  # fmt: skip
        """A checkpoint without this module's record (made before liere2d kept its coordinate grid) at this
        module's grid: that grid."""
        state_dict.setdefault(f"{prefix}_extra_state", self.get_extra_state())
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)  # fmt: skip

    def generators(self) -> torch.Tensor:
        """Skew-symmetric generators [(heads,) 2 (x, y), d/b, b, b]."""
        return upper_skew(self.raw)

    def forward(
        self, grid: tuple[int, int], device: torch.device | None = None, *, cells: torch.Tensor | None = None
    ) -> Rotary:
        """The rotations of the patches of ``grid``, or of the points ``cells`` [M, 2] of an image of that grid
        (a grid's: computed once at inference, ``InferenceCache``)."""
        device = device or self.raw.device

        def rotation() -> Rotary:
            xy = xy_coords(grid, self.coords, device, cells, train_grid=self.coord_grid)  # [HW or M, 2]
            return Rotary(None, None, blocks=generator_rotations(xy, self.generators()))  # [(heads,) HW, d/b, b, b]

        if cells is not None:
            return rotation()
        return self.cache.get(self, (tuple(grid), str(device), tuple(self.coord_grid)), rotation)

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, num_heads={self.num_heads}, block_size={self.block_size}, per_head={self.per_head}, "
            f"per_layer={self.per_layer}, coords={self.coords!r}"
        )
