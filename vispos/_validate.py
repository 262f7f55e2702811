"""Option checks shared by every scheme: each error says what was wrong and what is accepted."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_ints(name: str, values: object, *, minimum: int | None = None) -> tuple[int, ...]:
    """A sequence of ints (a list or tuple, not a str), each checked as ``check_int``."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__} {values!r}")
    return tuple(check_int(f"{name}[{i}]", v, minimum=minimum) for i, v in enumerate(values))


def check_dim(dim: object, multiple: int, scheme: str, *, what: str = "head dimension") -> int:
    """A channel count the scheme splits into ``multiple`` equal parts (rotary pairs, sin/cos per axis)."""
    dim = check_int(f"dim ({what})", dim, minimum=multiple)
    if dim % multiple:
        raise ValueError(f"{scheme} needs a {what} divisible by {multiple}, got {dim}")
    return dim


def check_float(name: str, value: object, *, minimum: float | None = None, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_choice(name: str, value: object, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; accepted: {', '.join(map(str, choices))}")
    return value  # type: ignore[return-value]


def _symbolic(value: object) -> bool:
    """A size that is only known when the program runs: torch.export / compile's SymInt, or the 0-dim
    tensor ``torch.jit.trace`` hands over for a shape. Such sizes are passed through unchecked."""
    return isinstance(value, torch.SymInt) or (isinstance(value, torch.Tensor) and torch.jit.is_tracing())


def same_size(a: Sequence[object], b: Sequence[object]) -> bool:
    """``a == b`` for sizes known now; False for sizes of a program being exported or traced, so that the
    caller takes its general path (which must give the same result) instead of baking in one size."""
    if any(_symbolic(v) for v in (*a, *b)):
        return False
    return tuple(a) == tuple(b)


def check_grid(grid: object, name: str = "grid") -> tuple[int, int]:
    """A patch grid (H, W) of positive ints (or sizes of a program being exported or traced)."""
    if isinstance(grid, torch.Size):
        grid = tuple(grid)
    if not isinstance(grid, Sequence) or len(grid) != 2:
        raise TypeError(f"{name} must be a pair (H, W) of ints, got {grid!r}")
    if _symbolic(grid[0]) or _symbolic(grid[1]):
        return grid[0], grid[1]
    h, w = (check_int(f"{name} height", grid[0]), check_int(f"{name} width", grid[1]))
    if h < 1 or w < 1:
        raise ValueError(f"{name} must have a positive size, got {(h, w)}")
    return h, w


def check_positions(positions: object, name: str = "positions", *, axes: int = 1) -> torch.Tensor:
    """1D token positions: an int length, or an integer tensor [N] / [B, N] of non-negative values.

    ``axes`` > 1 (several ids per token, e.g. mrope's t, h, w): [axes, N] or [axes, B, N], or [N] (or a
    length) for the same id on every axis."""
    if isinstance(positions, int) and not isinstance(positions, bool):
        if positions < 1:
            raise ValueError(f"sequence length must be >= 1, got {positions}")
        return torch.arange(positions)
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"{name} must be an int length or an integer tensor, got {type(positions).__name__}")
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {positions.dtype}")
    if axes == 1 and (positions.dim() not in (1, 2) or positions.shape[-1] < 1):
        raise ValueError(f"{name} must have shape [N] or [B, N] with N >= 1, got {tuple(positions.shape)}")
    several = positions.dim() in (2, 3) and positions.shape[0] == axes
    if axes > 1 and (not (positions.dim() == 1 or several) or positions.shape[-1] < 1):
        raise ValueError(
            f"{name} must have shape [{axes}, N] or [{axes}, B, N] ({axes} ids per token), or [N] for the same "
            f"id on every axis, with N >= 1; got {tuple(positions.shape)}"
        )
    if not torch.compiler.is_compiling() and bool((positions < 0).any()):
        raise ValueError(f"{name} must be non-negative")
    return positions
