"""Pixels in, pixels out: normalisation, the resize and canvas protocols' geometry, augmentation.

Batches are float pixels in [0, 1], [B, C, H, W], until ``normalize``. Folder images go through timm's
transform factory (``timm.data.create_transform``) without its normalisation, so that the canvas
protocol can pad in pixel units before normalising.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from timm.data import create_transform
from timm.data.auto_augment import rand_augment_transform
from torch import Tensor
from torchvision import transforms as T


def normalize(x: Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> Tensor:
    """[B, C, H, W] pixels in [0, 1] -> normalised."""
    m = torch.tensor(mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return (x - m) / s


def resize(x: Tensor, size: int) -> Tensor:
    """Bicubic (antialiased when shrinking) resize of pixels in [0, 1], clamped back into range."""
    if x.shape[-1] == size and x.shape[-2] == size:
        return x
    out = F.interpolate(x, size=(size, size), mode="bicubic", align_corners=False, antialias=True)
    return out.clamp_(0.0, 1.0)


def canvas_offsets(n: int, src: int, size: int, *, position: str, snap: int, gen: torch.Generator | None) -> Tensor:
    """Offsets [n, 2] (y, x): of the image on the canvas (size >= src), or of the crop in the image."""
    room = abs(size - src)
    if position == "center":
        off = torch.full((n, 2), room // 2, dtype=torch.long)
    else:
        off = torch.randint(0, room + 1, (n, 2), generator=gen)
    if snap > 1:
        off = (off // snap) * snap
    return off


def place_on_canvas(x: Tensor, size: int, offsets: Tensor, fill: tuple[float, ...]) -> Tensor:
    """[B, C, h, h] pixels -> [B, C, size, size]: pasted at ``offsets`` on ``fill``, or cropped there."""
    b, c, h, w = x.shape
    if size >= h:
        out = torch.tensor(fill, dtype=x.dtype).view(1, -1, 1, 1).expand(b, c, size, size).clone()
        for i, (oy, ox) in enumerate(offsets.tolist()):
            out[i, :, oy : oy + h, ox : ox + w] = x[i]
        return out
    return torch.stack([x[i, :, oy : oy + size, ox : ox + size] for i, (oy, ox) in enumerate(offsets.tolist())])


def resized_crop_boxes(n: int, h: int, w: int, gen: torch.Generator,
                       scale: tuple[float, float]) -> list[tuple[int, int, int, int]]:
    """Random-resized-crop boxes (top, left, height, width), one per image: area a fraction in ``scale`` of
    the image, aspect ratio log-uniform in [3/4, 4/3], clipped to the image (torchvision's ranges)."""
    area = torch.empty(n).uniform_(*scale, generator=gen) * h * w
    ratio = torch.empty(n).uniform_(math.log(3 / 4), math.log(4 / 3), generator=gen).exp()
    place = torch.rand(n, 2, generator=gen)
    boxes = []
    for a, r, (py, px) in zip(area.tolist(), ratio.tolist(), place.tolist(), strict=True):
        bw = min(w, max(1, round(math.sqrt(a * r))))
        bh = min(h, max(1, round(math.sqrt(a / r))))
        boxes.append((int(py * (h - bh + 1)), int(px * (w - bw + 1)), bh, bw))
    return boxes


def resized_crop_batch(x: Tensor, size: int, gen: torch.Generator,
                       scale: tuple[float, float]) -> Tensor:
    """[B, C, H, W] pixels -> [B, C, size, size]: each image's random-resized crop, resized (``rrc_flip``).

    The crop enlarges the object in the frame, as ImageNet's training crop does; the output is never
    larger than ``size``; ``scale`` is the crop's area range (fractions of the image)."""
    boxes = resized_crop_boxes(len(x), x.shape[-2], x.shape[-1], gen, scale)
    return torch.cat([resize(x[i : i + 1, :, t : t + bh, l : l + bw], size) for i, (t, l, bh, bw) in enumerate(boxes)])


def augment_batch(x: Tensor, kind: str, gen: torch.Generator) -> Tensor:
    """Flip (and for ``crop_flip`` a shift of up to 1/7 of the side, padded with black) on a global batch of
    pixels; ``rrc_flip``'s crop is drawn before, from the same generator (``resized_crop_batch``)."""
    n, _, h, _ = x.shape
    flips = torch.rand(n, generator=gen) < 0.5
    if kind == "crop_flip":
        pad = max(1, h // 7)
        offs = torch.randint(0, 2 * pad + 1, (n, 2), generator=gen)
        padded = F.pad(x, (pad, pad, pad, pad))
        x = torch.stack([padded[i, :, oy : oy + h, ox : ox + h] for i, (oy, ox) in enumerate(offs.tolist())])
    return torch.where(flips.view(-1, 1, 1, 1), x.flip(-1), x)


def eval_transform(size: int, crop_pct: float) -> T.Compose:
    """timm's evaluation transform: resize to floor(size / crop_pct) (bicubic), centre crop; uint8 [C, S, S]."""
    return create_transform(size, is_training=False, interpolation="bicubic", crop_pct=crop_pct, normalize=False)


def train_transform(size: int, crop_pct: float, augment: str, auto_augment: str | None,
                    mean: tuple[float, ...], crop_scale: tuple[float, float]) -> T.Compose:
    """Training transform of a folder image, uint8 [C, S, S] out.

    ``crop_flip`` / ``rrc_flip``: timm's training transform (random-resized crop of area ``crop_scale``, flip,
    RandAugment when given, no colour jitter). ``none`` / ``flip``: the evaluation crop, + flip, + RandAugment
    when given.
    """
    if augment in ("crop_flip", "rrc_flip"):
        return create_transform(size, is_training=True, scale=crop_scale, hflip=0.5, color_jitter=None,
                                auto_augment=auto_augment, interpolation="bicubic", mean=mean, normalize=False)
    *crop, to_tensor = eval_transform(size, crop_pct).transforms
    steps = [*crop, *([T.RandomHorizontalFlip()] if augment == "flip" else [])]
    if auto_augment:  # the parameters timm's training transform gives RandAugment
        fill = tuple(min(255, round(255 * m)) for m in mean)
        steps.append(rand_augment_transform(auto_augment, {"translate_const": int(size * 0.45), "img_mean": fill}))
    return T.Compose([*steps, to_tensor])
