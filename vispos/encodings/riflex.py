"""RIFLEx (Zhao et al., ICML 2025, "RIFLEx: A Free Lunch for Length Extrapolation in Video Diffusion Transformers";
the authors' code, repository ``thu-ml/RIFLEx``): a video longer than the training length repeats its content when
one temporal RoPE component, the *intrinsic frequency*, completes a period inside it. RIFLEx lowers that one
frequency so that the whole test length stays within 90 % of its period, leaving every other frequency and every
spatial axis as they are.

- ``intrinsic_frequency(theta, dim, repeats_at)``: the index k (1-based) of the component whose period
  N_j = round(2 pi / theta ** (-2 (j - 1) / dim)) is closest to the frame (latent) at which a video first repeats,
  and that period N_k, as the authors' ``identify_k`` (the first on a tie). HunyuanVideo's time axis (16 channels,
  theta 256) repeating near 50 latent frames gives k = 4, N_k = 50, the authors' setting.
- ``riflex_inv_freq(inv_freq, k, period, frames)``: the time axis's inverse frequencies with component k set to
  0.9 x 2 pi / frames, before the positions multiply them (the reduced frequency, not a reduced angle), where the
  latent frame count exceeds the period N_k (the authors' training-free rule), or always once the model was
  fine-tuned with it (``finetuned``). At or below N_k frames it changes nothing.
"""

from __future__ import annotations

import math

import torch

from .._validate import check_int

FRACTION = 0.9  # the authors' margin: the test length stays below 90 % of the reduced component's period


def periods(theta: float, dim: int) -> list[int]:
    """The period in positions of each rotary component j = 1 .. dim / 2, rounded: round(2 pi / theta_j)."""
    return [round(2 * math.pi / theta ** (-2 * (j - 1) / dim)) for j in range(1, dim // 2 + 1)]


def intrinsic_frequency(theta: float, dim: int, repeats_at: int) -> tuple[int, int]:
    """(k, N_k): the 1-based index of the component whose period is closest to ``repeats_at`` (the latent frame at
    which an unmodified video first repeats), and that period."""
    spans = periods(theta, dim)
    k = min(range(len(spans)), key=lambda j: abs(spans[j] - repeats_at)) + 1
    return k, spans[k - 1]


def riflex_inv_freq(inv_freq: torch.Tensor, k: int, period: int, frames: int, *,
                    finetuned: bool = False) -> torch.Tensor:  # fmt: skip
    """The time axis's inverse frequencies [dim / 2] with component ``k`` (1-based) reduced to 0.9 x 2 pi / ``frames``
    where ``frames`` exceeds its ``period`` N_k (or always, ``finetuned``); a copy, the input untouched."""
    check_int("k", k, minimum=1)
    if k > inv_freq.shape[-1]:
        raise ValueError(f"k={k} names a component beyond the {inv_freq.shape[-1]} of this axis")
    check_int("period", period, minimum=1)
    check_int("frames", frames, minimum=1)
    out = inv_freq.clone()
    if finetuned or frames > period:
        out[..., k - 1] = FRACTION * 2 * math.pi / frames
    return out
