"""RIFLEx on the time axis of ``ropend`` against the paper's formula and the authors' settings: the intrinsic
component k and its period N_k as ``identify_k`` finds them, component k at 0.9 x 2 pi / T over T latent frames
beyond N_k, a no-op up to N_k, and the two mistakes published wrappers made (RIFLEx applied on every axis; the angle
reduced after the positions multiply the frequencies) each caught."""

from __future__ import annotations

import math

import pytest
import torch

import vispos
from vispos.encodings.riflex import intrinsic_frequency, periods, riflex_inv_freq


def hunyuan(**options: object) -> torch.nn.Module:
    return vispos.create_encoding("ropend", ndim=1, dim=128, preset="hunyuanvideo", **options)


def angles(rope: torch.nn.Module, frames: int, height: int = 2, width: int = 60) -> torch.Tensor:
    """Angles [T, H, W, pairs] of every pair (interleaved layout: channel 2i's cos), recovered from the rotation; the
    width (60) beyond N_k too, so that RIFLEx on a spatial axis would show."""
    t, h, w = torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij")
    ids = torch.stack((t, h, w)).reshape(3, -1)
    rotary = rope(ids)
    return torch.atan2(rotary.sin[:, 0::2], rotary.cos[:, 0::2]).reshape(frames, height, width, -1)


def test_the_intrinsic_frequency_is_the_authors() -> None:
    """HunyuanVideo's time axis (16 channels, theta 256), repeating near latent frame 50: k = 4, N_k = 50, as the
    authors set it; each period is round(2 pi / theta_j), theta_j = theta ** (-2 (j - 1) / d)."""
    assert periods(256.0, 16) == [round(2 * math.pi * 256.0 ** (2 * j / 16)) for j in range(8)]
    assert intrinsic_frequency(256.0, 16, 50) == (4, 50)
    assert intrinsic_frequency(256.0, 16, 12) == (2, 13)


def test_the_reduced_frequency_is_the_papers() -> None:
    base = 1.0 / 256.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    out = riflex_inv_freq(base, 4, 50, 66)
    want = base.clone()
    want[3] = 0.9 * 2 * math.pi / 66  # Eq. (8) with the authors' 0.9 margin
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert torch.equal(riflex_inv_freq(base, 4, 50, 50), base)  # up to N_k: untouched (training-free rule)
    tuned = riflex_inv_freq(base, 4, 50, 40, finetuned=True)  # fine-tuned with RIFLEx: reduced at any length
    assert tuned[3].item() == pytest.approx(0.9 * 2 * math.pi / 40, rel=1e-15)
    with pytest.raises(ValueError, match="beyond the 8"):
        riflex_inv_freq(base, 9, 50, 66)


def test_riflex_turns_time_only_and_through_the_frequency() -> None:
    """On ropend's hunyuanvideo preset at 66 latent frames: the time section's component 4 turns at 0.9 x 2 pi / 66
    per frame (an angle proportional to the frame, less than one period at the last frame), its other components
    and both spatial sections as without RIFLEx."""
    plain, reduced = angles(hunyuan(), 66), angles(hunyuan(riflex=(4, 50)), 66)
    time_pairs = 8  # the time section: 16 channels, 8 pairs, first
    step = 0.9 * 2 * math.pi / 66
    frames = torch.arange(66, dtype=torch.float32)
    wrapped = torch.remainder(frames * step + math.pi, 2 * math.pi) - math.pi  # atan2's range
    torch.testing.assert_close(reduced[:, 0, 0, 3], wrapped, rtol=0, atol=1e-4)  # after the outer product: constant
    assert 65 * step < 2 * math.pi
    others = [i for i in range(plain.shape[-1]) if i != 3]
    torch.testing.assert_close(reduced[..., others], plain[..., others], rtol=0, atol=0)  # every axis: spatial moved
    assert reduced.shape[-1] - time_pairs == 56  # both spatial sections compared above


def test_riflex_is_a_no_op_up_to_the_period() -> None:
    for frames in (13, 50):
        torch.testing.assert_close(angles(hunyuan(riflex=(4, 50)), frames), angles(hunyuan(), frames), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"riflex is \(k, N_k\)"):
        hunyuan(riflex=(9, 50))
