"""Experiment configuration: a typed schema of dataclasses, filled strictly from YAML and CLI overrides.

Every key is checked (``train.config.schema``): an unknown key is an error that names the accepted ones, a
value of the wrong type is an error that names the expected type. ``key=value`` overrides from the
command line address fields by dotted path (``train.lr=1e-3``, ``eval.sizes=[28,56]``) and are
type-checked the same way. Scheme entries and their shorthand strings are shared with the sequence
benchmark (``train.config.entries``); the checks across fields are ``train.config.validation``'s.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Literal

import vispos

from . import schema
from .entries import RunConfig, SchemeEntry, expand_shorthand
from .schema import ConfigError  # noqa: F401  (re-exported: the trainer and its tests import it from here)

PROTOCOLS: tuple[str, ...] = ("resize", "canvas", "zoom")  # zoom: generated datasets only (grid tasks)
DEFAULT_PROTOCOLS: tuple[str, ...] = ("resize", "canvas")
SHORTHAND_WORDS: dict[str, dict[str, Any]] = {"logn": {"log_n_attention": True}}  # besides the RoPE scalings
PATCH_OPTIONS = [p.name for p in inspect.signature(vispos.patch).parameters.values() if p.kind is p.KEYWORD_ONLY]
TIMM_TABLE = "timm"  # pos name meaning: keep timm's own learned table (dynamic_img_size=True), no patch


@dataclass
class DataConfig:
    """Where the images come from and which subset is used."""

    # grid_*: generated position tasks (train.data.grid_tasks); train_per_class / val_per_class count images per class
    dataset: Literal["fashion_mnist", "folder", "grid_lookup", "grid_direction", "grid_placement", "grid_count",
                     "grid_lookup_shuffled"] = "fashion_mnist"
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
    # training augmentation; Fashion-MNIST: crop_flip shifts by up to 1/7 of the side, rrc_flip takes a random-
    # resized crop (area in crop_scale, as folder data's crop_flip, which rrc_flip equals there); both flip
    augment: Literal["none", "flip", "crop_flip", "rrc_flip"] = "none"
    # the random-resized crop's area range, fractions of the image (DeiT's ImageNet recipe: [0.08, 1.0]); the
    # smallest area 1/z^2 shows objects zoomed up to z times in training
    crop_scale: list[float] = field(default_factory=lambda: [0.35, 1.0])
    auto_augment: str | None = None  # folder: timm RandAugment string, e.g. "rand-m9-mstd0.5-inc1"
    crop_pct: float = 0.875  # folder: eval resize to floor(img_size / crop_pct), then centre crop (timm)
    mean: list[float] | None = None  # None: the dataset's own statistics (Fashion-MNIST) or ImageNet's
    std: list[float] | None = None
    # grid tasks: training scenes drawn with cells of 4 x z px for each zoom z (the images split evenly), scale
    # augmentation that shows the zoom protocol's larger cells in training; [1]: the training scale only
    zooms: list[int] = field(default_factory=lambda: [1])


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
class SchemeConfig(SchemeEntry):
    """One row of the comparison: a 2D scheme to train, or an evaluation-only variant of a trained one.

    ``pos`` is a vispos registry name or a list of them (a combination, also written ``a+b``), or
    ``timm`` (timm's own learned table). Every RoPE scaling of ``vispos.SCALING_TYPES`` applies per
    axis through ``vispos.configure`` (``longrope`` needs ``scaling_options.long_factors``). YAML
    shorthand (``train.config.entries``): ``rope2d``, ``learned2d+rope2d``, ``rope2d+yarn`` (= ``{name:
    rope2d+yarn, base: rope2d, scaling: yarn}``), ``alibi2d+logn`` (= ``log_n_attention: true``).
    """

    pos: list[str] = field(default_factory=list)  # vispos registry names ("timm": timm's own table)
    log_n_attention: bool = False  # evaluation only: logits x max(1, ln N / ln N_train) (vispos.configure)
    # a recipe's own training levers, in place of the shared ones (trained entries only)
    sizes: list[int] | None = None  # multi-resolution set (px), in place of train.sizes / size_range
    augment: Literal["none", "flip", "crop_flip", "rrc_flip"] | None = None  # in place of data.augment
    # the entry's own heads at the run's width, in place of model.num_heads: a scheme defined per head (LookHere's
    # fields of view) beside rotary rows at wide heads
    num_heads: int | None = None


@dataclass
class TrainConfig:
    """Optimisation and schedule, identical for every scheme of a run."""

    epochs: int = 3
    batch_size: int = 128  # global batch (split over DDP processes)
    lr: float = 2e-3
    min_lr: float = 0.0
    weight_decay: float = 0.05
    # the positional parameters (vispos.*: tables, biases, MLPs, learned frequencies) in a group of their own
    pos_lr_scale: float = 1.0  # their learning rate: train.lr x this, under the same schedule
    pos_weight_decay: float = 0.0  # their weight decay (by default none, as timm, Swin and RoPE-ViT leave theirs)
    warmup: float = 0.1  # fraction of all steps with a linear warm-up, then cosine to min_lr (train.engine.schedule)
    grad_clip: float | None = 1.0
    label_smoothing: float = 0.0
    mixup: float = 0.0  # mixup alpha (timm Mixup); 0: off
    cutmix: float = 0.0  # cutmix alpha; 0: off
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    compile: bool = False
    # how processes share the model (train.runtime.parallel): ddp, a full replica on each; fsdp, FSDP2 shards of each
    # block's parameters, gradients and optimiser state, with sharded checkpoints (torch.distributed.checkpoint)
    strategy: Literal["ddp", "fsdp"] = "ddp"
    activation_checkpointing: bool = False  # recompute each block's activations in the backward pass (timm's)
    checkpoint_every: int = 100  # steps between mid-epoch checkpoints (0: only at epoch ends)
    log_every: int = 50  # steps between plain progress lines when stderr is not a terminal (0: none)
    val_every_epoch: bool = True  # accuracy at the training resolution after each epoch (CSV log)
    # also every N optimiser steps within an epoch (global count; 0: epoch ends only); each point joins the
    # validation curve (checkpoint, results.json) that the convergence check reads (train.evaluation.convergence)
    val_every: int = 0
    converged_within: float = 0.5  # points: the most the last fifth of training may gain over the fifth before
    # EMA of the weights (timm.utils.ModelEmaV3), updated after every optimiser step and saved in the checkpoint
    # (a resumed run continues it exactly). Off by default: on, the run's evaluation, its per-epoch val acc and
    # fine-tune-at-target use the EMA weights instead of the last step's (results.json: train.weights "ema").
    ema: bool = False
    ema_decay: float = 0.9998  # timm train.py's default; DeiT: 0.99996
    ema_warmup: bool = True  # timm's warm-up: decay min(ema_decay, 1 - (1 + step) ** -2/3); short runs need it
    # multi-resolution training (FlexiViT / NaViT style): one size per step, the same for the whole batch,
    # drawn from (seed, epoch, step) only; every size <= data.img_size and a multiple of the patch size
    sizes: list[int] | None = None  # the set to draw from (px), e.g. [16, 20, 24, 28]
    size_range: list[int] | None = None  # or [min, max] (px): every multiple of the patch size in between


@dataclass
class FinetuneConfig:
    """Fine-tune-at-target: each trained model trained briefly on images resized to ``size``, then
    evaluated there (resize protocol).

    How practitioners use a higher resolution (FixRes, DeiT III, RoPE-ViT): the table then shows both the
    zero-shot extrapolation and how fast each scheme adapts. The weights go to ``finetuned.pt`` beside the
    zero-shot ``checkpoint.pt``, which stays as trained.
    """

    size: int | None = None  # target resolution (px); None: no fine-tune phase
    steps: int = 100
    batch_size: int | None = None  # None: train.batch_size
    lr: float = 5e-4
    warmup: float = 0.1  # fraction of the steps, then cosine to 0 (train.engine.schedule)


@dataclass
class EvalConfig:
    """Resolutions and protocols of the extrapolation evaluation."""

    sizes: list[int] | None = None  # evaluation resolutions in pixels
    scales: list[float] | None = None  # or multiples of the training resolution (rounded to the patch)
    protocols: list[Literal["resize", "canvas", "zoom"]] = field(default_factory=lambda: list(DEFAULT_PROTOCOLS))
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
class ExperimentConfig(RunConfig):
    """A whole run: several schemes trained under identical settings, then evaluated."""

    schemes: list[SchemeConfig]
    seeds: list[int] | None = None  # repeat the whole run per seed (mean +- std in the report); replaces seed
    threads: int | None = None  # torch intra-op threads on CPU
    resume: bool = True  # continue from checkpoints / results already in out_dir
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


# ----------------------------------------------------------------------------------------------------
# strict conversion from plain data


def _scheme_hook(data: Any, where: str) -> Any:
    """SchemeConfig's short forms: a string, or ``pos`` written as 'a+b'."""
    if isinstance(data, str):
        data = expand_shorthand(data, where, SHORTHAND_WORDS)
    if isinstance(data, dict) and isinstance(data.get("pos"), str):
        data = {**data, "pos": [p.strip() for p in data["pos"].split("+")]}
    return data


HOOKS = {SchemeConfig: _scheme_hook}


def to_dict(cfg: Any) -> Any:
    """Plain data (dicts, lists, primitives) of a config dataclass: YAML- and checkpoint-safe."""
    return dataclasses.asdict(cfg)


def scheme_config(cfg: ExperimentConfig, scheme: SchemeConfig) -> ExperimentConfig:
    """The settings one entry trains under: the shared ones, with the entry's own training levers
    (``sizes``, ``augment``, ``num_heads``) in place of ``train.sizes`` / ``train.size_range``, ``data.augment``
    and ``model.num_heads`` (so that its checkpoint's fingerprint holds them)."""
    if scheme.sizes is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, sizes=list(scheme.sizes), size_range=None))
    if scheme.augment is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, augment=scheme.augment))
    if scheme.num_heads is not None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_heads=scheme.num_heads))
    return cfg


# ----------------------------------------------------------------------------------------------------
# loading and overrides


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` strings to raw config data, type-checked against the schema."""
    return schema.apply_overrides(ExperimentConfig, data, overrides, HOOKS)
