"""A validated experiment configuration from YAML, CLI overrides or plain data (``load_config``,
``config_from_dict``): ``train.config.sections``'s schema and its checks, then what needs the data and the models,
checked before anything is trained: the classes asked for, the augmentation string, every entry's model
built on the meta device (``train.engine.models.preflight``) and a grid task's sizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import schema
from ..config.generation import GenerationConfig, generation_config, is_generation
from ..config.generation import apply_overrides as generation_overrides
from ..config.sections import HOOKS, ConfigError, DataConfig, ExperimentConfig, apply_overrides
from ..config.validation import validate
from ..data.datasets import DataError
from ..data.grid_tasks import CONTROLS, GRID_TASKS, grid_of, zoom_grids, zoomed_grid
from ..data.sources import FMNIST_CLASSES, select_classes
from ..data.transforms import train_transform
from ..engine.models import preflight
from ..evaluation.accuracy import eval_sizes
from .generate import preflight as generation_preflight


def config_from_dict(data: Any) -> ExperimentConfig:
    """Fill and validate the schema from plain data; the data choices are checked against the dataset
    (``check_data_choices``) and every entry's model is built once on the meta device (``models.preflight``),
    so what depends on the model (its patch size, a scheme's options) fails here too."""
    cfg = validate(schema.from_dict(ExperimentConfig, data, "", HOOKS))
    check_data_choices(cfg.data)
    _validate_grid_task(cfg, preflight(cfg))
    return cfg


def check_data_choices(d: DataConfig) -> None:
    """What can be known about the data without reading it: Fashion-MNIST's classes asked for exist, and
    ``data.auto_augment`` is a timm augmentation string."""
    if d.dataset == "fashion_mnist":
        try:
            select_classes(FMNIST_CLASSES, d)
        except DataError as err:
            raise ConfigError(f"data: {err}") from None
    if d.auto_augment is not None:
        try:
            train_transform(d.img_size, d.crop_pct, d.augment, d.auto_augment, tuple(d.mean or (0.5,)),
                            tuple(d.crop_scale))
        except (AssertionError, ValueError, KeyError, IndexError) as err:
            raise ConfigError(f"data.auto_augment {d.auto_augment!r} is not a timm augmentation string "
                              f"(e.g. rand-m9-mstd0.5-inc1): {err or type(err).__name__}") from None


def _validate_grid_task(cfg: ExperimentConfig, patch: int) -> None:
    """A grid task's training size, its training zooms and, with the canvas protocol (which draws the task
    afresh at each evaluation size), every evaluation size: whole cells, and at least the grid the task's rule
    needs; with the zoom protocol, sizes that draw the training grid's cells whole."""
    d = cfg.data
    if d.dataset not in GRID_TASKS:
        return
    try:
        grid = grid_of(d.img_size, "data.img_size", d.dataset)
        zoom_grids(d.img_size, d.zooms, CONTROLS.get(d.dataset, d.dataset))
        for size in eval_sizes(cfg.eval, d.img_size, patch):
            if "canvas" in cfg.eval.protocols:
                grid_of(size, f"eval size {size} px (the canvas protocol draws {d.dataset} at it)", d.dataset)
            if "zoom" in cfg.eval.protocols:
                zoomed_grid(size, grid, f"eval size {size} px (the zoom protocol draws {d.dataset} at it)")
    except DataError as err:
        raise ConfigError(str(err)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig | GenerationConfig:
    """Read a YAML config, apply ``key=value`` overrides, validate strictly: a classifier experiment, or a
    generation run (``task: generation``, ``train.config.generation``) whose every entry's DiT is built on the meta
    device first."""
    data = schema.read_yaml(path)
    if is_generation(data):
        cfg = generation_config(generation_overrides(data, overrides or []))
        generation_preflight(cfg)
        return cfg
    return config_from_dict(apply_overrides(data, overrides or []))
