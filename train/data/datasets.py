"""What every dataset of the trainer gives (``train.data.sources``, ``train.data.grid_tasks``): images in memory
(``TensorImages``) or read from files (``FolderImages``), a training and a validation set with their classes
and statistics (``DataBundle``), and the errors that name a missing or unreadable dataset."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from PIL import Image
from torch import Tensor

from ..runtime.seeds import mix_seed, seeded


class DataError(RuntimeError):
    """A dataset is missing, empty or unreadable; the message names the file and the fix."""


class CorruptImageError(DataError):
    """An image file could not be decoded (data.on_corrupt=error)."""


@dataclass
class TensorImages:
    """Images held in memory: uint8 [N, C, H, W] and int64 labels [N]."""

    images: Tensor
    labels: Tensor
    # generated datasets: the same set drawn at another image size (px), which the canvas protocol evaluates on
    at_size: Callable[[int], TensorImages] | None = None
    # generated datasets: the same scenes drawn on more pixels (an image size, px), for the zoom protocol
    at_zoom: Callable[[int], TensorImages] | None = None

    def __len__(self) -> int:
        return len(self.labels)


class FolderImages(torch.utils.data.Dataset):
    """(path, label) pairs read with PIL; an unreadable file yields None (skip) or raises (error)."""

    def __init__(self, samples: list[tuple[str, int]], *, in_chans: int, on_corrupt: str) -> None:
        self.samples = samples
        self.labels = [y for _, y in samples]
        self.mode = "L" if in_chans == 1 else "RGB"
        self.on_corrupt = on_corrupt
        self.transform: Callable[[Image.Image], Tensor] | None = None
        self.seed: int | None = None  # per-sample augmentation seed base (set per epoch by the loader)

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> Image.Image | None:
        path = self.samples[index][0]
        try:
            with Image.open(path) as img:
                return img.convert(self.mode)
        except Exception as e:  # PIL raises many types for broken files
            if self.on_corrupt == "error":
                raise CorruptImageError(
                    f"cannot read image {path}: {type(e).__name__}: {e} "
                    "(set data.on_corrupt=skip to skip and count unreadable files)"
                ) from None
            return None

    def __getitem__(self, index: int) -> tuple[Tensor, int, str] | tuple[None, int, str]:
        img = self.load(index)
        path, label = self.samples[index]
        if img is None:
            return None, label, path
        assert self.transform is not None, "FolderImages.transform is set by the loader"
        if self.seed is None:
            return self.transform(img), label, path
        # augmentation randomness is a function of (seed, epoch, index): the same in any process layout
        with seeded(mix_seed(self.seed, index)):
            return self.transform(img), label, path


@dataclass
class DataBundle:
    """Training and validation sets of one experiment, with what the model and transforms need."""

    train: TensorImages | FolderImages
    val: TensorImages | FolderImages
    classes: list[str]
    in_chans: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    background: tuple[float, ...]  # canvas fill per channel in pixel units when eval.canvas_fill is null
    canvas: str | None = None  # how the canvas protocol draws its images, when the dataset decides (grid tasks)

    @property
    def num_classes(self) -> int:
        return len(self.classes)
