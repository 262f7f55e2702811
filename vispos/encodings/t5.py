"""T5's relative attention bias (Raffel et al. 2020): one learned scalar per head and log-spaced bucket."""

from __future__ import annotations

import math

import torch
from torch import nn

from .._validate import check_bool, check_int, check_positions
from ..registry import register
from .alibi import causal_mask


def t5_bucket(
    relative_position: torch.Tensor, *, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> torch.Tensor:
    """T5's bucketing of ``key - query``. Bidirectional: half the buckets per direction (later keys in
    the upper half). Within a direction, distances below half its buckets are exact, larger ones
    log-spaced up to ``max_distance``, then clamped to the last bucket. Causal: later keys -> bucket 0."""
    n = -relative_position  # query - key: positive for keys in the past
    if bidirectional:
        num_buckets //= 2
        bucket = (n < 0).long() * num_buckets
        n = n.abs()
    else:
        bucket = torch.zeros_like(n)
        n = n.clamp(min=0)
    max_exact = num_buckets // 2
    far = n.float().clamp(min=max_exact) / max_exact
    log_bucket = max_exact + (torch.log(far) / math.log(max_distance / max_exact) * (num_buckets - max_exact)).long()
    log_bucket = log_bucket.clamp(max=num_buckets - 1)
    return bucket + torch.where(n < max_exact, n, log_bucket)


@register("t5", ndim=1, kind="bias", trainable=True, relative=True, context=("num_heads", "causal"),
    summary="T5 log-bucket scalar bias", extrapolation="far offsets share the last bucket",
    reference="Raffel et al. 2020 (T5)")
class T5Bias(nn.Module):
    def __init__(
        self, *, num_heads: int, num_buckets: int = 32, max_distance: int = 128, causal: bool = False
    ) -> None:
        super().__init__()
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.num_buckets = check_int("num_buckets", num_buckets, minimum=4)
        self.max_distance = check_int("max_distance", max_distance, minimum=2)
        self.bidirectional = not check_bool("causal", causal)  # T5's name for the two bucketings
        if self.max_distance <= self.num_buckets // (4 if self.bidirectional else 2):
            raise ValueError("max_distance must exceed the exact-bucket range (num_buckets / 4, or / 2 causal)")
        self.embedding = nn.Embedding(self.num_buckets, self.num_heads)

    def forward(self, positions: torch.Tensor | int) -> torch.Tensor:
        """-> [(B,) heads, N, N]; the causal form also masks later keys."""
        positions = check_positions(positions).to(self.embedding.weight.device)
        relative = positions[..., None, :] - positions[..., :, None]  # key - query, [(B,) N, N]
        buckets = t5_bucket(
            relative, bidirectional=self.bidirectional, num_buckets=self.num_buckets, max_distance=self.max_distance
        )
        bias = self.embedding(buckets).movedim(-1, -3).float()  # [(B,) heads, N, N]
        if not self.bidirectional:
            bias = bias + causal_mask(positions.shape[-1], positions.device)
        return bias
