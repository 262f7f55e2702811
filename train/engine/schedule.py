"""The learning-rate schedule of the trainer and the benchmarks: linear warm-up, then cosine decay.

    step:   0   1  ...  w-1 | w   w+1  ...  total-1
    value:  1/w 2/w ... 1   | 1   cos ...   -> floor      (times peak)

The warm-up reaches the peak on its last step and the cosine starts from the peak on the next one.
From step ``w`` on this is exactly timm's ``CosineLRScheduler(t_initial=total - w, warmup_t=w,
warmup_prefix=True, lr_min=floor)``; timm's warm-up, ``warmup_lr_init + t * (peak - warmup_lr_init) / w``,
never reaches the peak, so no setting of it gives these values. Kept, rather than timm's, because every
published number of the trainer (README, docs/fmnist_extrapolation) and of the sequence benchmark
(docs/seq1d) was trained with it; tests/test_train_config.py pins both the formula and the part that
equals timm's.
"""

from __future__ import annotations

import math


def warmup_cosine(step: int, total: int, warmup_steps: int, *, peak: float = 1.0, floor: float = 0.0) -> float:
    """The value at ``step`` (0-based) of ``total``: ``peak * (step + 1) / warmup_steps`` during the
    warm-up, then cosine from ``peak`` down to ``floor``; steps past ``total`` stay at ``floor``."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    t = (step - warmup_steps) / max(1, total - warmup_steps)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * min(t, 1.0)))


def warmup_steps(fraction: float, total: int) -> int:
    """The number of warm-up steps for a fraction of ``total`` (rounded to the nearest step)."""
    return int(round(fraction * total))
