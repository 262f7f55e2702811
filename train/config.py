"""Experiment configuration: a typed schema of dataclasses, filled strictly from YAML and CLI overrides.

Every key is checked: an unknown key is an error that names the accepted ones, a value of the wrong
type is an error that names the expected type. ``key=value`` overrides from the command line address
fields by dotted path (``train.lr=1e-3``, ``eval.sizes=[28,56]``) and are type-checked the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from . import schema
from .schema import ConfigError

SCALINGS: tuple[str, ...] = ("linear", "ntk", "yarn")
PROTOCOLS: tuple[str, ...] = ("resize", "canvas")
EVAL_SUFFIXES: tuple[str, ...] = (*SCALINGS, "logn")  # scheme-string suffixes that make an evaluation variant


@dataclass
class DataConfig:
    """Where the images come from and which subset is used."""

    dataset: Literal["fashion_mnist", "folder"] = "fashion_mnist"
    root: str | None = None  # fashion_mnist: folder of the idx .gz files (found automatically if None)
    train_split: str = "train"  # folder: sub-folder of root with one folder per class
    val_split: str = "val"
    img_size: int = 28  # training resolution in pixels (square)
    classes: list[str] | None = None  # folder: keep these class folders, in this order
    class_file: str | None = None  # folder: a text file with one class folder name per line
    num_classes: int | None = None  # keep the first N classes (sorted names / label order)
    train_per_class: int | None = None  # keep the first N training images of each class
    val_per_class: int | None = None
    on_corrupt: Literal["skip", "error"] = "skip"  # unreadable image: skip and count, or stop naming it
    workers: int = 0  # DataLoader workers for folder datasets
    augment: Literal["none", "flip", "crop_flip"] = "none"  # training augmentation
    auto_augment: str | None = None  # folder: timm RandAugment string, e.g. "rand-m9-mstd0.5-inc1"
    crop_pct: float = 0.875  # folder: eval transform resizes to img_size / crop_pct then centre-crops
    mean: list[float] | None = None  # None: the dataset's own statistics (Fashion-MNIST) or ImageNet's
    std: list[float] | None = None


@dataclass
class ModelConfig:
    """A timm ViT; None fields keep the timm architecture's own value."""

    name: str = "vit_tiny_patch16_224"
    patch_size: int | None = None
    embed_dim: int | None = None
    depth: int | None = None
    num_heads: int | None = None
    mlp_ratio: float | None = None
    class_token: bool | None = None
    global_pool: Literal["token", "avg", "max", "avgmax", "map"] | None = None
    drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to timm.create_model as they are


@dataclass
class SchemeConfig:
    """One row of the comparison: a positional scheme to train, or an evaluation-only variant of one.

    In YAML a plain string is accepted: ``rope2d`` (one scheme), ``learned2d+rope2d`` (a combination),
    ``rope2d+yarn`` (the trained ``rope2d`` model evaluated with RoPE scaling ``yarn``) or
    ``alibi2d+logn`` (the trained ``alibi2d`` model evaluated with log-n attention scaling).
    """

    name: str
    pos: list[str] = field(default_factory=list)  # vispos registry names ("timm": timm's own table)
    options: dict[str, Any] = field(default_factory=dict)  # forwarded to vispos.patch
    base: str | None = None  # evaluation-only: reuse the trained model of this scheme entry
    scaling: Literal["linear", "ntk", "yarn"] | None = None  # RoPE scaling applied at evaluation only
    scaling_options: dict[str, Any] = field(default_factory=dict)
    log_n_attention: bool = False  # evaluation only: logits x max(1, ln N / ln N_train) (vispos.configure)
    drope: float = 0.0  # DroPE: positions switched off for this final fraction of the training steps

    @property
    def trains(self) -> bool:
        return self.base is None


@dataclass
class TrainConfig:
    """Optimisation and schedule, identical for every scheme of a run."""

    epochs: int = 3
    batch_size: int = 128  # global batch (split over DDP processes)
    lr: float = 2e-3
    min_lr: float = 0.0
    weight_decay: float = 0.05
    warmup: float = 0.1  # fraction of all steps with a linear warm-up, then cosine decay to min_lr
    grad_clip: float | None = 1.0
    label_smoothing: float = 0.0
    mixup: float = 0.0  # mixup alpha (timm Mixup); 0: off
    cutmix: float = 0.0  # cutmix alpha; 0: off
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    compile: bool = False
    checkpoint_every: int = 100  # steps between mid-epoch checkpoints (0: only at epoch ends)
    val_every_epoch: bool = True  # accuracy at the training resolution after each epoch (CSV log)


@dataclass
class EvalConfig:
    """Resolutions and protocols of the extrapolation evaluation."""

    sizes: list[int] | None = None  # evaluation resolutions in pixels
    scales: list[float] | None = None  # or multiples of the training resolution (rounded to the patch)
    protocols: list[Literal["resize", "canvas"]] = field(default_factory=lambda: list(PROTOCOLS))
    canvas_position: Literal["center", "random"] = "center"
    canvas_snap: bool = True  # canvas offsets are multiples of the patch size (patches keep their content)
    canvas_fill: float | None = None  # background in pixel units [0, 1]; None: black (Fashion-MNIST), mean
    max_images: int | None = None  # evaluate on a fixed subset of the validation set
    batch_size: int = 256
    precision: Literal["auto", "fp32", "bf16"] = "auto"


@dataclass
class DebugConfig:
    """Test hooks: interrupt a run after a number of optimiser steps, or inject a non-finite loss."""

    stop_after_steps: int | None = None
    nan_at_step: int | None = None


@dataclass
class ExperimentConfig:
    """A whole run: several schemes trained under identical settings, then evaluated."""

    name: str
    schemes: list[SchemeConfig]
    seed: int = 0
    out_dir: str | None = None  # default runs/<name>
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | None = None  # torch intra-op threads on CPU
    progress: bool = True  # tqdm bars (always off when stderr is not a terminal)
    resume: bool = True  # continue from checkpoints / results already in out_dir
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) if self.out_dir else Path("runs") / self.name

    def scheme(self, name: str) -> SchemeConfig:
        for s in self.schemes:
            if s.name == name:
                return s
        raise ConfigError(f"no scheme named {name!r}; schemes: {', '.join(s.name for s in self.schemes)}")


# ----------------------------------------------------------------------------------------------------
# strict conversion from plain data


def _scheme_from_string(text: str, where: str) -> dict[str, Any]:
    """'rope2d', 'learned2d+rope2d', 'rope2d+yarn', 'alibi2d+logn', 'rope2d+yarn+logn'."""
    parts = [p.strip() for p in text.split("+")]
    if not all(parts):
        raise ConfigError(f"{where}: bad scheme {text!r}; write 'name', 'a+b' or 'name+{'|'.join(EVAL_SUFFIXES)}'")
    scaling, log_n = None, False
    while len(parts) > 1 and parts[-1] in EVAL_SUFFIXES:
        suffix = parts.pop()
        if suffix == "logn":
            log_n = True
        elif scaling is None:
            scaling = suffix
        else:
            raise ConfigError(f"{where}: {text!r} names two RoPE scalings; use one of {', '.join(SCALINGS)}")
    if scaling is None and not log_n:
        return {"name": text, "pos": parts}
    return {"name": text, "base": "+".join(parts), "scaling": scaling, "log_n_attention": log_n}


def _scheme_hook(data: Any, where: str) -> Any:
    """SchemeConfig's short forms: a string, or ``pos`` written as 'a+b'."""
    if isinstance(data, str):
        data = _scheme_from_string(data, where)
    if isinstance(data, dict) and isinstance(data.get("pos"), str):
        data = {**data, "pos": [p.strip() for p in data["pos"].split("+")]}
    return data


HOOKS = {SchemeConfig: _scheme_hook}


def to_dict(cfg: Any) -> Any:
    """Plain data (dicts, lists, primitives) of a config dataclass: YAML- and checkpoint-safe."""
    return dataclasses.asdict(cfg)


# ----------------------------------------------------------------------------------------------------
# cross-field checks


def validate(cfg: ExperimentConfig) -> ExperimentConfig:
    """Checks across fields; raises ConfigError naming the problem and what is accepted."""
    if not cfg.schemes:
        raise ConfigError("schemes: list at least one scheme")
    names = [s.name for s in cfg.schemes]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"schemes: names must be unique; repeated: {', '.join(dupes)}")
    trained = {s.name for s in cfg.schemes if s.trains}
    for s in cfg.schemes:
        where = f"schemes[{s.name}]"
        if s.trains and not s.pos:
            raise ConfigError(f"{where}: give pos (a registry name or a list) or base (a trained scheme)")
        if not s.trains:
            if s.base not in trained:
                raise ConfigError(
                    f"{where}: base {s.base!r} is not a trained scheme of this config; "
                    f"trained: {', '.join(sorted(trained))}"
                )
            if s.pos or s.options or s.drope:
                raise ConfigError(f"{where}: an evaluation-only entry (base) takes no pos, options or drope")
        if not 0.0 <= s.drope < 1.0:
            raise ConfigError(f"{where}: drope is a fraction of training in [0, 1), got {s.drope}")
        if s.scaling_options and s.scaling is None:
            raise ConfigError(f"{where}: scaling_options given without scaling ({', '.join(SCALINGS)})")
    t, d, e = cfg.train, cfg.data, cfg.eval
    for key, val in (
        ("train.epochs", t.epochs),
        ("train.batch_size", t.batch_size),
        ("data.img_size", d.img_size),
        ("eval.batch_size", e.batch_size),
    ):
        if val < 1:
            raise ConfigError(f"{key} must be >= 1, got {val}")
    if t.checkpoint_every < 0:
        raise ConfigError(f"train.checkpoint_every must be >= 0 (0: epoch ends only), got {t.checkpoint_every}")
    if not 0.0 <= t.warmup < 1.0:
        raise ConfigError(f"train.warmup is a fraction of all steps in [0, 1), got {t.warmup}")
    if (e.sizes is None) == (e.scales is None):
        raise ConfigError("eval: give exactly one of sizes (pixels) or scales (multiples of data.img_size)")
    if not e.protocols or len(set(e.protocols)) != len(e.protocols):
        raise ConfigError(f"eval.protocols: list each of {', '.join(PROTOCOLS)} at most once, at least one")
    if d.dataset == "folder" and d.root is None:
        raise ConfigError("data.root: a folder dataset needs the folder holding train/ and val/")
    if d.classes is not None and d.class_file is not None:
        raise ConfigError("data: give classes or class_file, not both")
    for key, val in (
        ("data.num_classes", d.num_classes),
        ("data.train_per_class", d.train_per_class),
        ("data.val_per_class", d.val_per_class),
        ("eval.max_images", e.max_images),
    ):
        if val is not None and val < 1:
            raise ConfigError(f"{key} must be >= 1 or null, got {val}")
    if d.auto_augment is not None and d.dataset != "folder":
        raise ConfigError("data.auto_augment (RandAugment on PIL images) applies to folder datasets only")
    if t.mixup < 0 or t.cutmix < 0:
        raise ConfigError(f"train.mixup and train.cutmix are alphas >= 0 (0: off), got {t.mixup}, {t.cutmix}")
    if (d.mean is None) != (d.std is None):
        raise ConfigError("data: give both mean and std, or neither")
    return cfg


# ----------------------------------------------------------------------------------------------------
# loading and overrides


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` strings to raw config data, type-checked against the schema."""
    return schema.apply_overrides(ExperimentConfig, data, overrides, HOOKS)


def config_from_dict(data: Any) -> ExperimentConfig:
    """Fill and validate the schema from plain data."""
    return validate(schema.from_dict(ExperimentConfig, data, "", HOOKS))


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read a YAML config, apply ``key=value`` overrides, validate strictly."""
    return config_from_dict(apply_overrides(schema.read_yaml(path), overrides or []))
