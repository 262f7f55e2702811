"""Batches for training and for the two evaluation protocols.

Training order is a function of (seed, epoch) only, and augmentation randomness of (seed, epoch, step)
or (seed, epoch, index): a global batch is the same whatever the number of processes, and a resumed
run replays exactly the batches it would have seen. Each DDP process takes its slice of the global
batch.

Evaluation protocols, for an evaluation size S and a training size T:
- ``resize``: the image resized (bicubic, antialiased) to S x S: more tokens, same content.
- ``canvas``: the image at its training scale T x T placed on an S x S background (centred or at a
  random offset): the object and its patches are unchanged, only the grid grows. For S < T the image
  is cropped to S x S instead (centre or random crop), still at training scale. With ``canvas_snap``
  the offset is a multiple of the patch size, so every patch holds exactly the pixels it held in
  training.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision import transforms as T

from .config import ExperimentConfig
from .data import DataBundle, FolderImages, TensorImages


@dataclass(frozen=True)
class Dist:
    """This process's place in a DDP job (rank 0 of 1 without DDP)."""

    rank: int = 0
    world: int = 1


@dataclass
class Batch:
    step: int
    x: Tensor  # [B, C, S, S] normalised
    y: Tensor  # [B]
    skipped: list[str]  # unreadable files dropped from this batch


def _generator(*keys: int) -> torch.Generator:
    seed = 0
    for k in keys:
        seed = (seed * 1_000_003 + int(k)) % (2**62)
    return torch.Generator().manual_seed(seed)


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


def _augment_tensor(x: Tensor, kind: str, gen: torch.Generator) -> Tensor:
    """Flip (and a shift of up to 1/7 of the side, padded with black) on a global batch of pixels."""
    n, _, h, _ = x.shape
    flips = torch.rand(n, generator=gen) < 0.5
    if kind == "crop_flip":
        pad = max(1, h // 7)
        offs = torch.randint(0, 2 * pad + 1, (n, 2), generator=gen)
        padded = F.pad(x, (pad, pad, pad, pad))
        x = torch.stack([padded[i, :, oy : oy + h, ox : ox + h] for i, (oy, ox) in enumerate(offs.tolist())])
    return torch.where(flips.view(-1, 1, 1, 1), x.flip(-1), x)


def _collate(items: list[tuple[Tensor | None, int, str]]) -> tuple[Tensor | None, Tensor, list[str]]:
    kept = [(x, y) for x, y, _ in items if x is not None]
    skipped = [p for x, _, p in items if x is None]
    if not kept:
        return None, torch.empty(0, dtype=torch.long), skipped
    return torch.stack([x for x, _ in kept]), torch.tensor([y for _, y in kept]), skipped


def eval_transform(size: int, crop_pct: float) -> T.Compose:
    """timm's evaluation transform at ``size``: resize to size / crop_pct (bicubic), centre crop."""
    return T.Compose([
        T.Resize(int(round(size / crop_pct)), interpolation=T.InterpolationMode.BICUBIC, antialias=True),
        T.CenterCrop(size),
        T.ToTensor(),
    ])


def train_transform(size: int, crop_pct: float, augment: str, auto_augment: str | None = None,
                    mean: tuple[float, ...] = (0.5,)) -> T.Compose:
    """Training transform of a folder dataset: eval crop, + flip, or random-resized crop + flip; + RandAugment."""
    if augment == "crop_flip":
        steps: list = [
            T.RandomResizedCrop(size, scale=(0.35, 1.0), interpolation=T.InterpolationMode.BICUBIC, antialias=True),
            T.RandomHorizontalFlip(),
        ]
    else:
        steps = list(eval_transform(size, crop_pct).transforms[:-1])
        if augment == "flip":
            steps.append(T.RandomHorizontalFlip())
    if auto_augment:
        from timm.data.auto_augment import rand_augment_transform

        fill = tuple(min(255, round(255 * m)) for m in mean)
        steps.append(rand_augment_transform(auto_augment, {"translate_const": int(size * 0.45), "img_mean": fill}))
    return T.Compose([*steps, T.ToTensor()])


class TrainLoader:
    """The training batches of one epoch, from a given step on (for resuming)."""

    def __init__(self, data: DataBundle, cfg: ExperimentConfig, dist: Dist) -> None:
        self.data, self.cfg, self.dist = data, cfg, dist
        self.global_batch = cfg.train.batch_size
        if self.global_batch % dist.world:
            raise ValueError(f"train.batch_size={self.global_batch} must be divisible by the {dist.world} processes")
        self.local_batch = self.global_batch // dist.world
        self.steps = len(data.train) // self.global_batch
        if self.steps < 1:
            raise ValueError(f"train.batch_size={self.global_batch} is larger than the {len(data.train)} "
                             "training images; lower it or use more images per class")

    def __len__(self) -> int:
        return self.steps

    def _local(self, order: Tensor, step: int) -> Tensor:
        g = order[step * self.global_batch : (step + 1) * self.global_batch]
        return g[self.dist.rank * self.local_batch : (self.dist.rank + 1) * self.local_batch]

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        seed = self.cfg.seed
        order = torch.randperm(len(self.data.train), generator=_generator(seed, epoch))
        ds = self.data.train
        if isinstance(ds, TensorImages):
            size = self.cfg.data.img_size
            for step in range(start_step, self.steps):
                glob = order[step * self.global_batch : (step + 1) * self.global_batch]
                x = resize(ds.images[glob].float().div_(255.0), size)
                if self.cfg.data.augment != "none":
                    x = _augment_tensor(x, self.cfg.data.augment, _generator(seed, epoch, step, 1))
                lo = self.dist.rank * self.local_batch
                x, y = x[lo : lo + self.local_batch], ds.labels[glob][lo : lo + self.local_batch]
                yield Batch(step, normalize(x, self.data.mean, self.data.std), y, [])
            return
        assert isinstance(ds, FolderImages)
        d = self.cfg.data
        ds.transform = train_transform(d.img_size, d.crop_pct, d.augment, d.auto_augment, self.data.mean)
        ds.seed = (seed * 1_000_003 + epoch) % (2**31)
        batches = [self._local(order, s).tolist() for s in range(start_step, self.steps)]
        loader = torch.utils.data.DataLoader(ds, batch_sampler=batches, num_workers=self.cfg.data.workers,
                                             collate_fn=_collate, pin_memory=torch.cuda.is_available())
        for step, (x, y, skipped) in zip(range(start_step, self.steps), loader, strict=True):
            if x is None:
                x = torch.empty(0, self.data.in_chans, self.cfg.data.img_size, self.cfg.data.img_size)
            yield Batch(step, normalize(x, self.data.mean, self.data.std), y, skipped)


class EvalLoader:
    """Validation batches for one (protocol, size), on a fixed subset sharded over processes."""

    def __init__(self, data: DataBundle, cfg: ExperimentConfig, dist: Dist, patch_size: int) -> None:
        self.data, self.cfg, self.dist, self.patch = data, cfg, dist, patch_size
        n = len(data.val)
        subset = torch.arange(n)
        if cfg.eval.max_images is not None and cfg.eval.max_images < n:
            subset = torch.randperm(n, generator=_generator(cfg.seed, 7))[: cfg.eval.max_images].sort().values
        self.subset = subset  # positions in the validation set
        self.local = torch.arange(len(subset))[dist.rank :: dist.world]  # positions in the subset
        fill = cfg.eval.canvas_fill
        self.fill = data.background if fill is None else tuple(fill for _ in range(data.in_chans))

    def __len__(self) -> int:
        return len(self.subset)

    def _canvas(self, x: Tensor, pos: Tensor, size: int) -> Tensor:
        src = x.shape[-1]
        gen = _generator(self.cfg.seed, size, 11) if self.cfg.eval.canvas_position == "random" else None
        snap = self.patch if self.cfg.eval.canvas_snap else 1
        offs = canvas_offsets(len(self.subset), src, size, position=self.cfg.eval.canvas_position, snap=snap,
                              gen=gen)[pos]
        return place_on_canvas(x, size, offs, self.fill)

    def batches(self, protocol: str, size: int) -> Iterator[Batch]:
        bs, ds, train_size = self.cfg.eval.batch_size, self.data.val, self.cfg.data.img_size
        chunks = [self.local[i : i + bs] for i in range(0, len(self.local), bs)]
        if isinstance(ds, TensorImages):
            for step, pos in enumerate(chunks):
                idx = self.subset[pos]
                x = ds.images[idx].float().div_(255.0)
                x = resize(x, size) if protocol == "resize" else self._canvas(resize(x, train_size), pos, size)
                yield Batch(step, normalize(x, self.data.mean, self.data.std), ds.labels[idx], [])
            return
        assert isinstance(ds, FolderImages)
        ds.seed = None
        ds.transform = eval_transform(size if protocol == "resize" else train_size, self.cfg.data.crop_pct)
        pos_batches = [p.tolist() for p in chunks]
        idx_batches = [self.subset[p].tolist() for p in chunks]
        loader = torch.utils.data.DataLoader(ds, batch_sampler=idx_batches, num_workers=self.cfg.data.workers,
                                             collate_fn=_collate)
        for step, ((x, y, skipped), pos) in enumerate(zip(loader, pos_batches, strict=True)):
            if x is None:
                continue_batch = torch.empty(0, self.data.in_chans, size, size)
                yield Batch(step, continue_batch, y, skipped)
                continue
            if protocol == "canvas":
                keep = torch.tensor([p for p, i in zip(pos, idx_batches[step], strict=True)
                                     if ds.samples[i][0] not in skipped])
                x = self._canvas(x, keep, size)
            yield Batch(step, normalize(x, self.data.mean, self.data.std), y, skipped)
