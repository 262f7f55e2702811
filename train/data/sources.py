"""Datasets: Fashion-MNIST from Debian's idx files, ImageNet-style folder trees with subsetting, and the
generated position tasks of ``train.data.grid_tasks``, each as a ``train.data.datasets.DataBundle``.

Both give a training set and a validation set with the same class list. Nothing is copied: a folder
subset is a list of (path, label) pairs chosen from the tree. Fashion-MNIST is held in memory as
uint8 tensors (60k + 10k images of 28 x 28).
"""

from __future__ import annotations

import functools
import gzip
import os
import struct
from pathlib import Path

import torch
from torch import Tensor
from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

from ..config.sections import DataConfig
from .datasets import DataBundle, DataError, FolderImages, TensorImages
from .grid_tasks import GRID_TASKS, build_grid_data

FMNIST_DIRS: tuple[str, ...] = ("/usr/share/datasets/fashion-mnist",)
FMNIST_FILES: dict[str, tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "val": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
FMNIST_CLASSES: list[str] = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]
FMNIST_MEAN, FMNIST_STD = (0.2860,), (0.3530,)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
INSTALL_HINT = "apt-get install dataset-fashion-mnist"


# ----------------------------------------------------------------------------------------------------
# Fashion-MNIST


def find_fashion_mnist(root: str | None) -> Path:
    """The folder holding the four idx files (``.gz`` or not): ``root``, else Debian's location."""
    candidates = [Path(root)] if root else [Path(d) for d in FMNIST_DIRS]
    for folder in candidates:
        if all(_idx_path(folder, name) is not None for pair in FMNIST_FILES.values() for name in pair):
            return folder
    looked = ", ".join(str(c) for c in candidates)
    raise DataError(
        f"Fashion-MNIST idx files not found (looked in {looked} for train-images-idx3-ubyte.gz and the "
        f"other three). Install them with: {INSTALL_HINT}  (or set data.root to a folder holding them)"
    )


def _idx_path(folder: Path, name: str) -> Path | None:
    for candidate in (folder / f"{name}.gz", folder / name):
        if candidate.is_file():
            return candidate
    return None


def read_idx(path: Path) -> Tensor:
    """An idx file (MNIST format, uint8 payload) as a uint8 tensor of its declared shape."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:
        raise DataError(f"cannot read {path}: {e}; reinstall it with: {INSTALL_HINT}") from None
    if len(raw) < 4:
        raise DataError(f"{path} is not an idx file (only {len(raw)} bytes)")
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08 or ndim not in (1, 3):
        raise DataError(f"{path} is not a uint8 idx file (header {raw[:4].hex()})")
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    payload = raw[4 + 4 * ndim :]
    expected = 1
    for s in shape:
        expected *= s
    if len(payload) != expected:
        raise DataError(f"{path} is truncated: header says {shape} ({expected} bytes), found {len(payload)}")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).reshape(shape)


@functools.lru_cache(maxsize=4)
def load_fashion_mnist(folder: Path, split: str) -> tuple[Tensor, Tensor]:
    """Images [N, 1, 28, 28] uint8 and labels [N] int64 of split ``train`` or ``val`` (the t10k set).

    Cached per process: callers index into these tensors and never modify them.
    """
    img_name, lbl_name = FMNIST_FILES[split]
    images = read_idx(_idx_path(folder, img_name))  # type: ignore[arg-type]
    labels = read_idx(_idx_path(folder, lbl_name))  # type: ignore[arg-type]
    if images.dim() != 3 or labels.dim() != 1 or len(images) != len(labels):
        raise DataError(f"Fashion-MNIST {split} files in {folder} disagree: {tuple(images.shape)} images, "
                        f"{tuple(labels.shape)} labels")
    return images.unsqueeze(1), labels.long()


# ----------------------------------------------------------------------------------------------------
# subsetting


def select_classes(available: list[str], cfg: DataConfig) -> list[str]:
    """The classes kept, in label order: an explicit list, a class file, or the first N."""
    wanted: list[str] | None = cfg.classes
    if cfg.class_file is not None:
        path = Path(cfg.class_file)
        if not path.is_file():
            raise DataError(f"data.class_file {path} does not exist")
        wanted = [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
        if not wanted:
            raise DataError(f"data.class_file {path} lists no classes (one folder name per line)")
    if wanted is not None:
        missing = [c for c in wanted if c not in available]
        if missing:
            shown = ", ".join(available[:20]) + (" ..." if len(available) > 20 else "")
            raise DataError(f"unknown class(es) {', '.join(missing)}; available: {shown}")
        if len(set(wanted)) != len(wanted):
            raise DataError("the class list names a class twice")
        chosen = list(wanted)
    else:
        chosen = list(available)
    if cfg.num_classes is not None:
        if cfg.num_classes > len(chosen):
            raise DataError(f"data.num_classes={cfg.num_classes} but only {len(chosen)} classes are available")
        chosen = chosen[: cfg.num_classes]
    return chosen


def first_per_class(labels: list[int], per_class: int | None) -> list[int]:
    """Indices of the first ``per_class`` items of each label, in their original order."""
    if per_class is None:
        return list(range(len(labels)))
    seen: dict[int, int] = {}
    keep = []
    for i, y in enumerate(labels):
        if seen.get(y, 0) < per_class:
            seen[y] = seen.get(y, 0) + 1
            keep.append(i)
    return keep


# ----------------------------------------------------------------------------------------------------
# datasets


def _folder_split(root: Path, split: str, classes: list[str], cfg: DataConfig, per_class: int | None,
                  in_chans: int) -> FolderImages:
    folder = root / split
    class_to_idx = {c: i for i, c in enumerate(classes)}
    try:
        samples = make_dataset(str(folder), class_to_idx, extensions=IMG_EXTENSIONS, allow_empty=True)
    except FileNotFoundError as e:
        raise DataError(f"{folder}: {e}") from None
    samples.sort(key=lambda s: (s[1], s[0]))
    keep = first_per_class([y for _, y in samples], per_class)
    samples = [samples[i] for i in keep]
    if not samples:
        raise DataError(f"no images ({', '.join(IMG_EXTENSIONS)}) found under {folder} for the selected classes")
    return FolderImages(samples, in_chans=in_chans, on_corrupt=cfg.on_corrupt)


def build_data(cfg: DataConfig) -> DataBundle:
    """Load and subset the configured dataset."""
    if cfg.dataset in GRID_TASKS:
        class_choice = cfg.classes is not None or cfg.class_file is not None or cfg.num_classes is not None
        return build_grid_data(dataset=cfg.dataset, img_size=cfg.img_size, train_per_class=cfg.train_per_class,
                               val_per_class=cfg.val_per_class, augment=cfg.augment, mean=cfg.mean, std=cfg.std,
                               class_choice=class_choice, zooms=cfg.zooms)
    if cfg.dataset == "fashion_mnist":
        folder = find_fashion_mnist(cfg.root)
        classes = select_classes(FMNIST_CLASSES, cfg)
        remap = torch.full((len(FMNIST_CLASSES),), -1, dtype=torch.long)
        for new, name in enumerate(classes):
            remap[FMNIST_CLASSES.index(name)] = new
        sets = []
        for split, per_class in (("train", cfg.train_per_class), ("val", cfg.val_per_class)):
            images, labels = load_fashion_mnist(folder, split)
            labels = remap[labels]
            kept = torch.nonzero(labels >= 0).flatten()
            images, labels = images[kept], labels[kept]
            keep = torch.tensor(first_per_class(labels.tolist(), per_class), dtype=torch.long)
            sets.append(TensorImages(images[keep].contiguous(), labels[keep].contiguous()))
        mean, std = tuple(cfg.mean or FMNIST_MEAN), tuple(cfg.std or FMNIST_STD)
        return DataBundle(sets[0], sets[1], classes, 1, mean, std, background=(0.0,))

    root = Path(cfg.root)  # type: ignore[arg-type]
    train_dir = root / cfg.train_split
    if not train_dir.is_dir():
        raise DataError(f"{train_dir} is not a folder; data.root must hold {cfg.train_split}/ and "
                        f"{cfg.val_split}/ with one sub-folder per class")
    available = sorted(e.name for e in os.scandir(train_dir) if e.is_dir())
    if not available:
        raise DataError(f"{train_dir} has no class sub-folders")
    classes = select_classes(available, cfg)
    mean, std = tuple(cfg.mean or IMAGENET_MEAN), tuple(cfg.std or IMAGENET_STD)
    in_chans = len(mean)
    if len(std) != in_chans or in_chans not in (1, 3):
        raise DataError(f"data.mean and data.std must both have 1 or 3 entries, got {list(mean)} and {list(std)}")
    train = _folder_split(root, cfg.train_split, classes, cfg, cfg.train_per_class, in_chans)
    val = _folder_split(root, cfg.val_split, classes, cfg, cfg.val_per_class, in_chans)
    return DataBundle(train, val, classes, in_chans, mean, std, background=mean)
