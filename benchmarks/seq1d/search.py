"""LongRoPE's factor search, small: structured candidates, then mutations of the best (an evolution-lite).

Factors lambda_i >= 1 divide RoPE's inverse frequencies (i = 0 is the fastest). As in LongRoPE, they do
not decrease towards low frequencies, and the fastest ones may stay at 1. The structured family
``lambda_i = top ** (r_i ** p)`` (r_i rising from 0 to 1 over the frequencies from ``start`` on) contains
position interpolation (all equal), NTK-like (geometric) and YaRN-like (a ramp) shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def structured_factors(num_freqs: int, *, start: int, top: float, power: float) -> list[float]:
    """1 below ``start``, then ``top ** (r ** power)`` with r from 0 to 1 up to the slowest frequency."""
    span = max(1, num_freqs - 1 - start)
    return [1.0 if i < start else float(top ** (((i - start) / span) ** power)) for i in range(num_freqs)]


def monotone(factors: torch.Tensor) -> list[float]:
    """Clamp to >= 1 and make non-decreasing towards the slow frequencies."""
    return torch.cummax(factors.clamp(min=1.0), dim=0).values.tolist()


def search_longrope(
    objective: Callable[[list[float]], float],
    num_freqs: int,
    *,
    scale: float,
    generator: torch.Generator,
    mutations: int = 12,
    rounds: int = 1,
    keep: int = 4,
    sigma: float = 0.3,
) -> tuple[list[float], float, int]:
    """Minimise ``objective(factors)``; returns (best factors, best value, candidates tried).

    ``scale`` is the length ratio the factors are for (the largest held-out length / training length).
    """
    candidates = [[float(scale)] * num_freqs]  # plain position interpolation
    for start in sorted({0, num_freqs // 4, num_freqs // 2}):
        for top in (scale / 2, scale, 2 * scale):
            for power in (0.5, 1.0, 2.0):
                candidates.append(structured_factors(num_freqs, start=start, top=max(1.0, top), power=power))
    scored: dict[tuple[float, ...], float] = {}
    for c in candidates:
        key = tuple(round(v, 6) for v in c)
        if key not in scored:
            scored[key] = objective(list(key))
    for _ in range(rounds):
        parents = sorted(scored, key=scored.get)[:keep]
        for j in range(mutations):
            parent = torch.tensor(parents[j % len(parents)])
            noise = torch.randn(num_freqs, generator=generator) * sigma
            child = tuple(round(v, 6) for v in monotone(parent * noise.exp()))
            if child not in scored:
                scored[child] = objective(list(child))
    best = min(scored, key=scored.get)
    return list(best), scored[best], len(scored)
