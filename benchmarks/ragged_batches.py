"""The ragged batches of ``benchmarks.token_subsets`` (b): image sizes drawn per batch, pixel patches cut in the
data pipeline, images laid one per row or packed first-fit decreasing with segment ids, the ragged forward
of a model's blocks, and the zero-padded dense baseline."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

PATCH = 16


def draw_sizes(count: int, seed: int, low: int = 112, high: int = 224) -> list[tuple[int, int]]:
    """Image sizes (H, W) in px, each side a multiple of 16 in [low, high], drawn independently."""
    g = torch.Generator().manual_seed(seed)
    sides = torch.randint(low // PATCH, high // PATCH + 1, (count, 2), generator=g) * PATCH
    return [(int(h), int(w)) for h, w in sides]


@dataclass
class RaggedBatch:
    """Pixel patches of several images in rows: patches [R, N, 3*16*16], coords [R, N, 2] (y, x), valid
    [R, N], sizes [R, 2] (one image per row) or [R, S, 2] with segments [R, N]; image [R, N]: which image."""

    patches: torch.Tensor
    coords: torch.Tensor
    valid: torch.Tensor
    sizes: torch.Tensor
    segments: torch.Tensor | None
    image: torch.Tensor
    count: int

    def to(self, device: torch.device) -> RaggedBatch:
        move = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()}
        return RaggedBatch(**move)


def patchify(image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[3, H, W] -> patches [h*w, 3*16*16] (the order of a Conv2d weight's flattened kernel) and (y, x) [h*w, 2]."""
    c, height, width = image.shape
    h, w = height // PATCH, width // PATCH
    cut = image.unfold(1, PATCH, PATCH).unfold(2, PATCH, PATCH)  # [3, h, w, 16, 16]
    patches = cut.permute(1, 2, 0, 3, 4).reshape(h * w, c * PATCH * PATCH)
    yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return patches, torch.stack((yy.flatten(), xx.flatten()), dim=-1)


def ragged_batch(images: list[torch.Tensor], *, packed: bool) -> RaggedBatch:
    """One image per row (rows as long as the largest image's tokens), or images packed first-fit decreasing
    into rows as long as an image padded to the largest height and width (the baseline's rows)."""
    cut = [patchify(x) for x in images]
    counts = [p.shape[0] for p, _ in cut]
    height, width = max(x.shape[1] for x in images), max(x.shape[2] for x in images)
    capacity = (height // PATCH) * (width // PATCH) if packed else max(counts)
    rows: list[list[int]] = []
    if packed:
        room: list[int] = []
        for i in sorted(range(len(cut)), key=lambda i: -counts[i]):
            fit = next((r for r, free in enumerate(room) if free >= counts[i]), None)
            if fit is None:
                rows.append([i])
                room.append(capacity - counts[i])
            else:
                rows[fit].append(i)
                room[fit] -= counts[i]
    else:
        rows = [[i] for i in range(len(cut))]
    r, n, s, dim = len(rows), capacity, max(map(len, rows)), cut[0][0].shape[1]
    patches, coords = torch.zeros(r, n, dim), torch.zeros(r, n, 2, dtype=torch.long)
    image, segments = torch.full((r, n), -1), torch.zeros(r, n, dtype=torch.long)
    sizes = torch.ones(r, s, 2, dtype=torch.long)
    for row, members in enumerate(rows):
        at = 0
        for seg, i in enumerate(members):
            p, c = cut[i]
            k = p.shape[0]
            patches[row, at : at + k], coords[row, at : at + k] = p, c
            image[row, at : at + k], segments[row, at : at + k] = i, seg
            sizes[row, seg] = torch.tensor(images[i].shape[1:]) // PATCH
            at += k
    valid = image >= 0
    if packed:
        return RaggedBatch(patches, coords, valid, sizes, segments, image, len(images))
    return RaggedBatch(patches, coords, valid, sizes[:, 0], None, image, len(images))


def ragged_logits(model: nn.Module, batch: RaggedBatch) -> torch.Tensor:
    """A patched, average-pooled ViT on a ragged batch -> logits [images, classes]: patch embedding as a
    linear map of the pixel patches, positions from the ragged context, the model's own blocks, each
    image's tokens pooled."""
    proj = model.patch_embed.proj
    x = F.linear(batch.patches, proj.weight.flatten(1), proj.bias)  # [R, N, C]
    ctx = model.vispos.ragged_context(batch.coords, batch.sizes, valid=batch.valid, segments=batch.segments)
    x = model.norm_pre(model.vispos.add_to_ragged(x, ctx))
    for blk in model.blocks:
        x = blk(x, attn_mask=ctx)
    x = model.norm(x)
    index = batch.image.clamp(min=0).flatten()
    weight = batch.valid.flatten().to(x.dtype)[:, None]
    total = x.new_zeros(batch.count, x.shape[-1]).index_add(0, index, x.flatten(0, 1) * weight)
    count = x.new_zeros(batch.count).index_add(0, index, weight[:, 0])
    return model.head(model.fc_norm(total / count[:, None]))


def padded_images(images: list[torch.Tensor]) -> torch.Tensor:
    """Every image zero-padded (bottom, right) to the largest height and width: [B, 3, H, W]."""
    height, width = max(x.shape[1] for x in images), max(x.shape[2] for x in images)
    return torch.stack([F.pad(x, (0, width - x.shape[2], 0, height - x.shape[1])) for x in images])
