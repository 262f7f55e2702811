"""Batches for training and for the evaluation protocols.

Training order is a function of (seed, epoch) only, and augmentation randomness of (seed, epoch, step)
or (seed, epoch, index): a global batch is the same whatever the number of processes, and a resumed
run replays exactly the batches it would have seen. Each DDP process takes its slice of the global
batch. Multi-resolution training draws each step's size from (seed, epoch, step) too, so every scheme
sees the same sizes in the same order, every process agrees on them without communicating, and a
resumed run draws what the uninterrupted one drew.

Evaluation protocols, for an evaluation size S and a training size T:
- ``resize``: the image resized (bicubic, antialiased) to S x S: more tokens, same content.
- ``canvas``: the image at its training scale T x T placed on an S x S background (centred or at a
  random offset): the object and its patches are unchanged, only the grid grows. For S < T the image
  is cropped to S x S instead (centre or random crop), still at training scale. With ``canvas_snap``
  the offset is a multiple of the patch size, so every patch holds exactly the pixels it held in
  training. A generated dataset (``TensorImages.at_size``, the grid tasks) is drawn afresh at S x S.
- ``zoom`` (generated datasets, ``TensorImages.at_zoom``): the same scenes drawn on S x S pixels, every cell
  S / T times larger: more pixels of the same content, as a larger photograph of the same scene is. (For
  photographs, ``resize`` below the native resolution is this protocol.)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..config.sections import ConfigError, DataConfig, EvalConfig, TrainConfig
from ..runtime.process import Dist
from ..runtime.seeds import generator, mix_seed
from .datasets import DataBundle, FolderImages, TensorImages
from .transforms import (
    augment_batch,
    canvas_offsets,
    eval_transform,
    normalize,
    place_on_canvas,
    resize,
    resized_crop_batch,
    train_transform,
)

SIZE_KEY = 2  # seed key of the per-step size draw (1: augmentation)


def train_sizes(cfg: TrainConfig, base: int, patch: int) -> list[int]:
    """The training sizes to draw from: train.sizes, every patch multiple of train.size_range, or [base]."""
    if cfg.sizes is not None:
        bad = [s for s in cfg.sizes if s % patch]
        if bad:
            raise ConfigError(f"train.sizes {bad} are not multiples of the patch size {patch}")
        return sorted(set(cfg.sizes))
    if cfg.size_range is not None:
        lo, hi = cfg.size_range
        sizes = [s for s in range(lo, hi + 1) if s % patch == 0]
        if not sizes:
            raise ConfigError(f"train.size_range {cfg.size_range} holds no multiple of the patch size {patch}")
        return sizes
    return [base]


@dataclass
class Batch:
    step: int
    x: Tensor  # [B, C, S, S] normalised; S is the step's training size
    y: Tensor  # [B]
    skipped: list[str]  # unreadable files dropped from this batch


def _collate(items: list[tuple[Tensor | None, int, str]]) -> tuple[Tensor | None, Tensor, list[str]]:
    """uint8 images from the folder transforms -> a float batch of pixels in [0, 1]."""
    kept = [(x, y) for x, y, _ in items if x is not None]
    skipped = [p for x, _, p in items if x is None]
    if not kept:
        return None, torch.empty(0, dtype=torch.long), skipped
    return torch.stack([x for x, _ in kept]).float().div_(255.0), torch.tensor([y for _, y in kept]), skipped


class TrainLoader:
    """The training batches of one epoch, from a given step on (for resuming)."""

    def __init__(self, data: DataBundle, cfg: DataConfig, *, batch_size: int, seed: int, dist: Dist,
                 sizes: Sequence[int] | None = None) -> None:
        self.data, self.cfg, self.seed, self.dist = data, cfg, seed, dist
        self.sizes = list(sizes) if sizes is not None else [cfg.img_size]  # drawn from, one per step
        self.global_batch = batch_size
        if batch_size % dist.world:
            raise ConfigError(f"batch size {batch_size} must be divisible by the {dist.world} processes")
        self.local_batch = batch_size // dist.world
        self.steps = len(data.train) // batch_size
        if self.steps < 1:
            raise ConfigError(f"batch size {batch_size} (train.batch_size / finetune.batch_size) is larger than the "
                              f"{len(data.train)} training images; lower it or use more images per class")

    def __len__(self) -> int:
        return self.steps

    def size_at(self, epoch: int, step: int) -> int:
        """The training size of ``step`` of ``epoch``: a function of (seed, epoch, step) only."""
        if len(self.sizes) == 1:
            return self.sizes[0]
        pick = torch.randint(len(self.sizes), (1,), generator=generator(self.seed, epoch, step, SIZE_KEY))
        return self.sizes[int(pick)]

    def _local(self, order: Tensor, step: int) -> Tensor:
        """This process's slice of the global batch ``step`` of ``order``."""
        glob = order[step * self.global_batch : (step + 1) * self.global_batch]
        return glob[self.dist.rank * self.local_batch : (self.dist.rank + 1) * self.local_batch]

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        order = torch.randperm(len(self.data.train), generator=generator(self.seed, epoch))
        ds, base = self.data.train, self.cfg.img_size
        if isinstance(ds, TensorImages):
            for step in range(start_step, self.steps):
                glob = order[step * self.global_batch : (step + 1) * self.global_batch]
                x, size = ds.images[glob].float().div_(255.0), self.size_at(epoch, step)
                if self.cfg.augment == "none":
                    x = resize(x, size)
                else:  # on the global batch: the same whatever the process count
                    gen = generator(self.seed, epoch, step, 1)
                    if self.cfg.augment == "rrc_flip":
                        x = resized_crop_batch(x, size, gen, tuple(self.cfg.crop_scale))
                    else:
                        x = resize(x, size)
                    x = augment_batch(x, self.cfg.augment, gen)
                lo = self.dist.rank * self.local_batch
                x, y = x[lo : lo + self.local_batch], ds.labels[glob][lo : lo + self.local_batch]
                yield Batch(step, normalize(x, self.data.mean, self.data.std), y, [])
            return
        assert isinstance(ds, FolderImages)
        ds.transform = train_transform(base, self.cfg.crop_pct, self.cfg.augment, self.cfg.auto_augment, self.data.mean,
                                       tuple(self.cfg.crop_scale))
        ds.seed = mix_seed(self.seed, epoch, modulus=2**31)
        batches = [self._local(order, s).tolist() for s in range(start_step, self.steps)]
        loader = torch.utils.data.DataLoader(ds, batch_sampler=batches, num_workers=self.cfg.workers,
                                             collate_fn=_collate, pin_memory=torch.cuda.is_available())
        for step, (x, y, skipped) in zip(range(start_step, self.steps), loader, strict=True):
            size = self.size_at(epoch, step)
            x = torch.empty(0, self.data.in_chans, size, size) if x is None else resize(x, size)
            yield Batch(step, normalize(x, self.data.mean, self.data.std), y, skipped)


class EvalLoader:
    """Validation batches for one (protocol, size), on a fixed subset sharded over processes."""

    def __init__(self, data: DataBundle, data_cfg: DataConfig, cfg: EvalConfig, *, seed: int, dist: Dist,
                 patch_size: int) -> None:
        self.data, self.cfg, self.seed, self.dist, self.patch = data, cfg, seed, dist, patch_size
        self.train_size, self.crop_pct, self.workers = data_cfg.img_size, data_cfg.crop_pct, data_cfg.workers
        n = len(data.val)
        subset = torch.arange(n)
        if cfg.max_images is not None and cfg.max_images < n:
            subset = torch.randperm(n, generator=generator(seed, 7))[: cfg.max_images].sort().values
        self.subset = subset  # positions in the validation set
        self.local = torch.arange(len(subset))[dist.rank :: dist.world]  # positions in the subset
        fill = cfg.canvas_fill
        self.fill = data.background if fill is None else tuple(fill for _ in range(data.in_chans))

    def __len__(self) -> int:
        return len(self.subset)

    @property
    def num_batches(self) -> int:
        """Batches of this process per (protocol, size)."""
        return -(-len(self.local) // self.cfg.batch_size)

    def _canvas(self, x: Tensor, pos: Tensor, size: int) -> Tensor:
        src = x.shape[-1]
        gen = generator(self.seed, size, 11) if self.cfg.canvas_position == "random" else None
        snap = self.patch if self.cfg.canvas_snap else 1
        offs = canvas_offsets(len(self.subset), src, size, position=self.cfg.canvas_position, snap=snap, gen=gen)
        return place_on_canvas(x, size, offs[pos], self.fill)

    def batches(self, protocol: str, size: int) -> Iterator[Batch]:
        bs, ds, train_size = self.cfg.batch_size, self.data.val, self.train_size
        chunks = [self.local[i : i + bs] for i in range(0, len(self.local), bs)]
        if isinstance(ds, TensorImages):
            for step, pos in enumerate(chunks):
                idx = self.subset[pos]
                drawn = {"canvas": ds.at_size, "zoom": ds.at_zoom}.get(protocol)  # a generated set, drawn anew
                if drawn is not None:
                    drawn = drawn(size)
                    x, y = drawn.images[idx].float().div_(255.0), drawn.labels[idx]
                else:
                    x, y = ds.images[idx].float().div_(255.0), ds.labels[idx]
                    x = resize(x, size) if protocol == "resize" else self._canvas(resize(x, train_size), pos, size)
                yield Batch(step, normalize(x, self.data.mean, self.data.std), y, [])
            return
        assert isinstance(ds, FolderImages)
        ds.seed = None
        ds.transform = eval_transform(size if protocol == "resize" else train_size, self.crop_pct)
        pos_batches = [p.tolist() for p in chunks]
        idx_batches = [self.subset[p].tolist() for p in chunks]
        loader = torch.utils.data.DataLoader(ds, batch_sampler=idx_batches, num_workers=self.workers,
                                             collate_fn=_collate)
        for step, ((x, y, skipped), pos) in enumerate(zip(loader, pos_batches, strict=True)):
            if x is None:
                yield Batch(step, torch.empty(0, self.data.in_chans, size, size), y, skipped)
                continue
            if protocol == "canvas":
                keep = torch.tensor([p for p, i in zip(pos, idx_batches[step], strict=True)
                                     if ds.samples[i][0] not in skipped])
                x = self._canvas(x, keep, size)
            yield Batch(step, normalize(x, self.data.mean, self.data.std), y, skipped)
