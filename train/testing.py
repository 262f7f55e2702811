"""Small fixtures for tests and quick checks: a tiny experiment config and a generated image folder."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from PIL import Image

from .config.sections import ExperimentConfig
from .experiment.loading import config_from_dict

TINY: dict[str, Any] = {
    "name": "tiny",
    "seed": 0,
    "threads": 1,
    "progress": False,
    "schemes": ["rope2d"],
    "data": {"dataset": "fashion_mnist", "train_per_class": 20, "val_per_class": 10},
    "model": {"patch_size": 4, "embed_dim": 32, "depth": 2, "num_heads": 2, "class_token": False,
              "global_pool": "avg"},
    "train": {"epochs": 2, "batch_size": 40, "lr": 2e-3, "checkpoint_every": 2, "val_every_epoch": True},
    "eval": {"sizes": [20, 28, 40], "batch_size": 100},
}


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def tiny_config(out_dir: str | Path, **sections: Any) -> ExperimentConfig:
    """A config that trains in seconds on 200 Fashion-MNIST images; ``sections`` are merged in."""
    return config_from_dict(_merge(TINY, {"out_dir": str(out_dir), **sections}))


def write_tiny_config(tmp_path: Path, **sections: Any) -> Path:
    """``tiny_config``'s settings as ``tmp_path/config.yaml`` (run folder ``tmp_path/run``), for the command line."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_merge(TINY, {"out_dir": str(tmp_path / "run"), **sections})))
    return path


def make_image_folder(root: Path, *, classes: int = 3, per_class: int = 4, size: int = 12,
                      splits: tuple[str, ...] = ("train", "val")) -> Path:
    """An ImageNet-style tree root/{train,val}/class_k/img_i.png of small RGB images (class = a bright band)."""
    rng = np.random.default_rng(0)
    for split in splits:
        for c in range(classes):
            folder = root / split / f"class_{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                img = (rng.random((size, size, 3)) * 60).astype(np.uint8)
                band = slice(c * size // classes, (c + 1) * size // classes)
                img[band, :, c % 3] = 255
                Image.fromarray(img).save(folder / f"img_{i}.png")
    return root
