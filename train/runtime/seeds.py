"""Seeds as a function of what they are for: one mixing rule for the trainer and the benchmarks.

A seed is folded from keys (the run's seed, then e.g. epoch, step, rank, sample index):
``s = (s * 1_000_003 + key) mod modulus``. The same keys give the same seed in any process layout, so
data order and augmentation do not depend on how many processes or workers share the job, and a
resumed run replays exactly what it would have drawn.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch

MULTIPLIER = 1_000_003  # a prime: consecutive keys land far apart


def mix_seed(*keys: int, modulus: int = 2**62) -> int:
    """Fold ``keys`` into one seed in [0, modulus)."""
    seed = 0
    for key in keys:
        seed = (seed * MULTIPLIER + int(key)) % modulus
    return seed


def generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded with ``mix_seed(*keys)``: draws that touch no global RNG."""
    return torch.Generator().manual_seed(mix_seed(*keys))


def seed_everything(seed: int) -> None:
    """Seed every global RNG the training step may use (torch, numpy, python), e.g. for dropout."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with every global RNG seeded by ``seed``, then restore their previous states."""
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        seed_everything(seed)
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
