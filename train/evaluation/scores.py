"""Scores of generated Fashion-MNIST images, computed by the project (no downloaded network).

- ``Scorer``: a small CNN trained once on Fashion-MNIST at 28 px (fixed seed; ``train_scorer``), half of its
  training images passed through a down-and-up resampling at a random size from 7 to 28 px, so that blurred
  (upsampled) and sharp images both lie within what it saw. Its 128 penultimate features serve the Frechet
  distances (FID on a domain classifier, as the MNIST literature uses in place of Inception), its predictions the
  class accuracy of conditional samples.
- ``frechet``: the Frechet distance between Gaussians fitted to two feature sets (Heusel et al. 2017),
  ||mu_a - mu_b||^2 + tr(S_a + S_b - 2 (S_a S_b)^(1/2)), the trace of the square root from the eigenvalues of
  S_a^(1/2) S_b S_a^(1/2) (symmetric, float64).
- ``score_images``: FID on the whole images resized to the scorer's 28 px (global structure: a garment repeated or
  duplicated at a larger size moves it), patch FID on crops of the training size at native resolution, resized
  likewise (detail), and class accuracy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..runtime.seeds import generator, seeded

SCORER_SIZE = 28  # the scorer's input (Fashion-MNIST's native size)


class ScorerNet(nn.Module):
    """Three conv blocks (32, 64, 128 channels, batch norm, 2x2 pooling after the first two), global average pooling
    to 128 features, a linear classifier."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

        self.features = nn.Sequential(*block(1, 32), nn.MaxPool2d(2), *block(32, 64), nn.MaxPool2d(2), *block(64, 128),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())  # fmt: skip
        self.head = nn.Linear(128, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def to_scorer(images: Tensor) -> Tensor:
    """Images in [0, 1], [N, 1, H, W], resized to the scorer's input (antialiased bilinear), normalised to [-1, 1]."""
    if images.shape[-2:] != (SCORER_SIZE, SCORER_SIZE):
        images = F.interpolate(images, size=(SCORER_SIZE, SCORER_SIZE), mode="bilinear", antialias=True,
                               align_corners=False)  # fmt: skip
    return images.clamp(0, 1) * 2 - 1


def resample(images: Tensor, size: int) -> Tensor:
    """Images [N, 1, H, W] in [0, 1] at ``size`` px: antialiased bilinear down, bicubic up (clamped)."""
    if images.shape[-1] == size:
        return images
    down = size < images.shape[-1]
    mode = "bilinear" if down else "bicubic"
    return F.interpolate(images, size=(size, size), mode=mode, antialias=down, align_corners=False).clamp(0, 1)


def train_scorer(images: Tensor, labels: Tensor, *, epochs: int, seed: int, batch_size: int = 128) -> ScorerNet:
    """The scorer trained on uint8 images [N, 1, 28, 28] with AdamW (lr 2e-3, cosine), each batch drawn and
    augmented from ``seed`` alone."""
    with seeded(seed):
        net = ScorerNet(int(labels.max()) + 1)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=0.01)
    steps = epochs * math.ceil(len(labels) / batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    net.train()
    for epoch in range(epochs):
        order = torch.randperm(len(labels), generator=generator(seed, epoch))
        for i, start in enumerate(range(0, len(labels), batch_size)):
            index = order[start : start + batch_size]
            x = images[index].float() / 255
            rng = generator(seed, epoch, i)
            blurred = torch.rand(len(index), generator=rng) < 0.5
            size = int(torch.randint(7, 28, (), generator=rng))
            x = torch.where(blurred[:, None, None, None], resample(resample(x, size), SCORER_SIZE), x)
            loss = F.cross_entropy(net(to_scorer(x)), labels[index])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    return net.eval()


@torch.no_grad()
def features_and_predictions(net: ScorerNet, images: Tensor, batch_size: int = 500) -> tuple[Tensor, Tensor]:
    """Penultimate features [N, 128] (float64) and predicted classes [N] of images in [0, 1] at any size."""
    feats, preds = [], []
    for start in range(0, len(images), batch_size):
        f = net.features(to_scorer(images[start : start + batch_size]))
        feats.append(f.double())
        preds.append(net.head(f).argmax(-1))
    return torch.cat(feats), torch.cat(preds)


def _sqrt_psd(matrix: Tensor) -> Tensor:
    values, vectors = torch.linalg.eigh(matrix)
    return (vectors * values.clamp(min=0).sqrt()) @ vectors.T


def frechet(a: Tensor, b: Tensor) -> float:
    """Frechet distance between Gaussians fitted to features a [N, D] and b [M, D]."""
    a, b = a.double(), b.double()
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = torch.cov(a.T), torch.cov(b.T)
    root = _sqrt_psd(cov_a)
    cross = torch.linalg.eigvalsh(root @ cov_b @ root).clamp(min=0).sqrt().sum()
    return float((mu_a - mu_b).square().sum() + cov_a.trace() + cov_b.trace() - 2 * cross)


def crops(images: Tensor, size: int, seed: int) -> Tensor:
    """One crop of ``size`` px per image, at a position drawn from ``seed`` (the whole image when it is that size)."""
    n, _, h, w = images.shape
    if (h, w) == (size, size):
        return images
    rng = generator(seed, h, w)
    top = torch.randint(0, h - size + 1, (n,), generator=rng)
    left = torch.randint(0, w - size + 1, (n,), generator=rng)
    rows = top[:, None] + torch.arange(size)  # [N, size]
    cols = left[:, None] + torch.arange(size)
    return images[torch.arange(n)[:, None, None], :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)


@dataclass
class Scores:
    """One set of images scored against the reference at its size: FID (whole images), patch FID (crops of the
    training size), class accuracy (%; conditional samples against their classes)."""

    fid: float
    patch_fid: float
    accuracy: float

    def to_json(self) -> dict[str, float]:
        return {"fid": round(self.fid, 4), "patch_fid": round(self.patch_fid, 4), "accuracy": round(self.accuracy, 3)}


SCORE_NAMES: tuple[str, ...] = ("fid", "patch_fid", "accuracy")


def score_images(net: ScorerNet, images: Tensor, labels: Tensor, reference: Tensor, *, crop: int,
                 seed: int) -> Scores:  # fmt: skip
    """Scores of ``images`` [N, 1, S, S] in [0, 1] generated for ``labels`` [N], against ``reference`` images at the
    same size; crops of ``crop`` px (the training size) drawn from ``seed``."""
    feats, preds = features_and_predictions(net, images)
    ref_feats, _ = features_and_predictions(net, reference)
    patch, _ = features_and_predictions(net, crops(images, crop, seed))
    ref_patch, _ = features_and_predictions(net, crops(reference, crop, seed + 1))
    accuracy = float((preds == labels).double().mean() * 100)
    return Scores(frechet(feats, ref_feats), frechet(patch, ref_patch), accuracy)
