"""Experiment configuration: a typed schema of dataclasses, filled strictly from YAML and CLI overrides.

Every key is checked (``train.schema``): an unknown key is an error that names the accepted ones, a
value of the wrong type is an error that names the expected type. ``key=value`` overrides from the
command line address fields by dotted path (``train.lr=1e-3``, ``eval.sizes=[28,56]``) and are
type-checked the same way. Scheme entries and their shorthand strings are shared with the sequence
benchmark (``train.entries``).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Literal

import vispos

from . import schema
from .entries import RunConfig, SchemeEntry, check_entries, check_scaling, expand_shorthand
from .schema import ConfigError

PROTOCOLS: tuple[str, ...] = ("resize", "canvas")
SHORTHAND_WORDS: dict[str, dict[str, Any]] = {"logn": {"log_n_attention": True}}  # besides the RoPE scalings
PATCH_OPTIONS = [p.name for p in inspect.signature(vispos.patch).parameters.values() if p.kind is p.KEYWORD_ONLY]
TIMM_TABLE = "timm"  # pos name meaning: keep timm's own learned table (dynamic_img_size=True), no patch


@dataclass
class DataConfig:
    """Where the images come from and which subset is used."""

    # grid_*: generated position tasks (train.grid_tasks); train_per_class / val_per_class count images per class
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
    # resized crop (area 0.35-1, as folder data's crop_flip, which rrc_flip equals there); both flip
    augment: Literal["none", "flip", "crop_flip", "rrc_flip"] = "none"
    auto_augment: str | None = None  # folder: timm RandAugment string, e.g. "rand-m9-mstd0.5-inc1"
    crop_pct: float = 0.875  # folder: eval resize to floor(img_size / crop_pct), then centre crop (timm)
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
class SchemeConfig(SchemeEntry):
    """One row of the comparison: a 2D scheme to train, or an evaluation-only variant of a trained one.

    ``pos`` is a vispos registry name or a list of them (a combination, also written ``a+b``), or
    ``timm`` (timm's own learned table). Every RoPE scaling of ``vispos.SCALING_TYPES`` applies per
    axis through ``vispos.configure`` (``longrope`` needs ``scaling_options.long_factors``). YAML
    shorthand (``train.entries``): ``rope2d``, ``learned2d+rope2d``, ``rope2d+yarn`` (= ``{name:
    rope2d+yarn, base: rope2d, scaling: yarn}``), ``alibi2d+logn`` (= ``log_n_attention: true``).
    """

    pos: list[str] = field(default_factory=list)  # vispos registry names ("timm": timm's own table)
    log_n_attention: bool = False  # evaluation only: logits x max(1, ln N / ln N_train) (vispos.configure)
    # a recipe's own training levers, in place of the shared ones (trained entries only)
    sizes: list[int] | None = None  # multi-resolution set (px), in place of train.sizes / size_range
    augment: Literal["none", "flip", "crop_flip", "rrc_flip"] | None = None  # in place of data.augment


@dataclass
class TrainConfig:
    """Optimisation and schedule, identical for every scheme of a run."""

    epochs: int = 3
    batch_size: int = 128  # global batch (split over DDP processes)
    lr: float = 2e-3
    min_lr: float = 0.0
    weight_decay: float = 0.05
    warmup: float = 0.1  # fraction of all steps with a linear warm-up, then cosine to min_lr (train.schedule)
    grad_clip: float | None = 1.0
    label_smoothing: float = 0.0
    mixup: float = 0.0  # mixup alpha (timm Mixup); 0: off
    cutmix: float = 0.0  # cutmix alpha; 0: off
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    compile: bool = False
    # how processes share the model (train.parallel): ddp, a full replica on each; fsdp, FSDP2 shards of each
    # block's parameters, gradients and optimiser state, with sharded checkpoints (torch.distributed.checkpoint)
    strategy: Literal["ddp", "fsdp"] = "ddp"
    activation_checkpointing: bool = False  # recompute each block's activations in the backward pass (timm's)
    checkpoint_every: int = 100  # steps between mid-epoch checkpoints (0: only at epoch ends)
    log_every: int = 50  # steps between plain progress lines when stderr is not a terminal (0: none)
    val_every_epoch: bool = True  # accuracy at the training resolution after each epoch (CSV log)
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
    warmup: float = 0.1  # fraction of the steps, then cosine to 0 (train.schedule)


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

    def scheme(self, name: str) -> SchemeConfig:
        for s in self.schemes:
            if s.name == name:
                return s
        raise ConfigError(f"no scheme named {name!r}; schemes: {', '.join(s.name for s in self.schemes)}")


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


# ----------------------------------------------------------------------------------------------------
# cross-field checks


def scheme_config(cfg: ExperimentConfig, scheme: SchemeConfig) -> ExperimentConfig:
    """The settings one entry trains under: the shared ones, with the entry's own training levers
    (``sizes``, ``augment``) in place of ``train.sizes`` / ``train.size_range`` and ``data.augment``."""
    if scheme.sizes is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, sizes=list(scheme.sizes), size_range=None))
    if scheme.augment is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, augment=scheme.augment))
    return cfg


def validate(cfg: ExperimentConfig) -> ExperimentConfig:
    """Checks across fields; raises ConfigError naming the problem and what is accepted."""
    check_entries(cfg.schemes)
    for s in cfg.schemes:
        check_scaling(s, original_length=1)  # the real per-axis lengths are set by vispos.configure
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
    if t.log_every < 0:
        raise ConfigError(f"train.log_every must be >= 0 (0: no progress lines), got {t.log_every}")
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
    if t.strategy == "fsdp" and (t.ema or cfg.finetune.size is not None):
        raise ConfigError("train.strategy=fsdp shards the model; train.ema (a full copy on every process) and "
                          "finetune (a full copy trained after the run) need train.strategy=ddp")
    if t.mixup < 0 or t.cutmix < 0:
        raise ConfigError(f"train.mixup and train.cutmix are alphas >= 0 (0: off), got {t.mixup}, {t.cutmix}")
    if (d.mean is None) != (d.std is None):
        raise ConfigError("data: give both mean and std, or neither")
    _validate_multires(t, d.img_size)
    for s in cfg.schemes:
        if not s.trains and (s.sizes is not None or s.augment is not None):
            raise ConfigError(f"schemes[{s.name}]: sizes and augment (training levers) need a trained entry, "
                              "not an evaluation-only one (base)")
        if s.sizes is not None:
            _validate_multires(TrainConfig(sizes=s.sizes), d.img_size, f"schemes[{s.name}].sizes")
    f = cfg.finetune
    if f.size is not None and (f.size < 1 or f.steps < 1 or (f.batch_size is not None and f.batch_size < 1)):
        raise ConfigError(f"finetune: size, steps and batch_size must be >= 1, got {f.size}, {f.steps}, {f.batch_size}")
    if not 0.0 <= f.warmup < 1.0:
        raise ConfigError(f"finetune.warmup is a fraction of the fine-tune steps in [0, 1), got {f.warmup}")
    if cfg.seeds is not None and (not cfg.seeds or len(set(cfg.seeds)) != len(cfg.seeds)):
        raise ConfigError(f"seeds: a non-empty list of distinct seeds (or null: the single seed), got {cfg.seeds}")
    _validate_ranges(cfg)
    _validate_data(d)
    check_entry_schemes(cfg.schemes)
    return cfg


# timm ViT / Eva rates passed through model.kwargs, each a probability in [0, 1) (timm asserts some without a message)
TIMM_RATES: tuple[str, ...] = ("patch_drop_rate", "pos_drop_rate", "proj_drop_rate", "attn_drop_rate")


def _rate(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1


def _validate_ranges(cfg: ExperimentConfig) -> None:
    """Every number that has a meaningful range, checked against it (NaN fails every check)."""
    t, m, d, e, f, dbg = cfg.train, cfg.model, cfg.data, cfg.eval, cfg.finetune, cfg.debug

    def positive_or_null(v: float | None) -> bool:
        return v is None or v > 0

    checks: tuple[tuple[str, Any, bool, str], ...] = (
        ("train.lr", t.lr, t.lr > 0, "> 0"),
        ("train.min_lr", t.min_lr, 0 <= t.min_lr <= t.lr, f"in [0, train.lr={t.lr}]"),
        ("train.weight_decay", t.weight_decay, t.weight_decay >= 0, ">= 0"),
        ("train.grad_clip", t.grad_clip, positive_or_null(t.grad_clip), "> 0, or null (no clipping)"),
        ("train.label_smoothing", t.label_smoothing, 0 <= t.label_smoothing < 1, "in [0, 1)"),
        ("train.ema_decay", t.ema_decay, 0 < t.ema_decay < 1, "in (0, 1)"),
        ("model.patch_size", m.patch_size, positive_or_null(m.patch_size), ">= 1, or null (the model's own)"),
        ("model.embed_dim", m.embed_dim, positive_or_null(m.embed_dim), ">= 1, or null (the model's own)"),
        ("model.depth", m.depth, positive_or_null(m.depth), ">= 1, or null (the model's own)"),
        ("model.num_heads", m.num_heads, positive_or_null(m.num_heads), ">= 1, or null (the model's own)"),
        ("model.mlp_ratio", m.mlp_ratio, positive_or_null(m.mlp_ratio), "> 0, or null (the model's own)"),
        ("model.drop_rate", m.drop_rate, 0 <= m.drop_rate < 1, "in [0, 1)"),
        ("model.drop_path_rate", m.drop_path_rate, 0 <= m.drop_path_rate < 1, "in [0, 1)"),
        *((f"model.kwargs.{k}", m.kwargs[k], _rate(m.kwargs[k]), "a number in [0, 1)") for k in TIMM_RATES
          if m.kwargs.get(k) is not None),
        ("data.crop_pct", d.crop_pct, 0 < d.crop_pct <= 1, "in (0, 1]"),
        ("data.workers", d.workers, d.workers >= 0, ">= 0"),
        ("eval.scales", e.scales, e.scales is None or all(s > 0 for s in e.scales), "numbers > 0"),
        ("eval.canvas_fill", e.canvas_fill, e.canvas_fill is None or 0 <= e.canvas_fill <= 1,
         "in [0, 1] (pixel units), or null"),
        ("finetune.lr", f.lr, f.lr > 0, "> 0"),
        ("threads", cfg.threads, positive_or_null(cfg.threads), ">= 1, or null (torch's default)"),
        ("debug.stop_after_steps", dbg.stop_after_steps, positive_or_null(dbg.stop_after_steps), ">= 1, or null"),
        ("debug.nan_at_step", dbg.nan_at_step, dbg.nan_at_step is None or dbg.nan_at_step >= 0, ">= 0, or null"),
    )
    for key, value, ok, accepted in checks:
        if not ok:
            raise ConfigError(f"{key} must be {accepted}, got {value}")
    if not cfg.name.strip():
        raise ConfigError("name: a non-empty run name (the run folder is runs/<name> unless out_dir is set)")
    if (t.mixup > 0 or t.cutmix > 0) and t.batch_size % 2:
        raise ConfigError(f"train.batch_size must be even with mixup / cutmix (timm's Mixup pairs images), "
                          f"got {t.batch_size}")


def _validate_data(d: DataConfig) -> None:
    """The statistics: positive, one per channel of the dataset (the classes and augmentation: ``train.loading``)."""
    if d.std is not None and not all(s > 0 for s in d.std):
        raise ConfigError(f"data.std must be > 0 per channel, got {d.std}")
    if d.mean is not None and d.std is not None and len(d.mean) != len(d.std):
        raise ConfigError(f"data.mean and data.std need one value per channel each, got {d.mean} and {d.std}")
    channels = {"fashion_mnist": (1,), "folder": (1, 3)}.get(d.dataset)
    if channels is not None and d.mean is not None and len(d.mean) not in channels:
        raise ConfigError(f"data.mean / data.std: {d.dataset} images have {' or '.join(map(str, channels))} "
                          f"channel(s), got {len(d.mean)} values")


def check_entry_schemes(schemes: list[SchemeConfig]) -> None:
    """Each entry against the registry: its 2D schemes exist, its options are ones they accept, and an
    evaluation setting (scaling) has a scheme it applies to."""
    known = vispos.list_encodings(ndim=2)
    by_name = {s.name: s for s in schemes}
    for s in schemes:
        where = f"schemes[{s.name}]"
        if not s.name.strip():
            raise ConfigError("schemes: every entry needs a non-empty name")
        for p in s.pos:
            if p != TIMM_TABLE and p not in known:
                raise ConfigError(f"{where}: unknown 2D scheme {p!r}; known: {', '.join(known)}, "
                                  f"or {TIMM_TABLE!r} (timm's own table)")
        if TIMM_TABLE in s.pos and (len(s.pos) > 1 or s.options or s.drope):
            raise ConfigError(f"{where}: {TIMM_TABLE!r} stands alone (no combination, options or drope)")
        infos = [vispos.get_info(p, 2) for p in s.pos if p != TIMM_TABLE]
        accepted = sorted({o for i in infos for o in i.options} | set(PATCH_OPTIONS)) if infos else []
        unknown = sorted(set(s.options) - set(accepted))
        if unknown:
            raise ConfigError(f"{where}: option(s) {', '.join(unknown)} not accepted by {'+'.join(s.pos)}; "
                              f"accepted: {', '.join(accepted) or 'none'}")
        trained = s if s.trains else by_name[s.base]  # type: ignore[index]  (check_entries: base exists)
        if s.scaling is not None:
            scalable = [n for n in known if vispos.get_info(n, 2).scalable]
            if not any(p in scalable for p in trained.pos):
                raise ConfigError(f"{where}: scaling {s.scaling!r} stretches RoPE frequencies; "
                                  f"{'+'.join(trained.pos)} has none to stretch (scalable: {', '.join(scalable)})")


def _validate_multires(t: TrainConfig, img_size: int, where: str = "train.sizes / size_range") -> None:
    """train.sizes / train.size_range: at most one, every size in [1, data.img_size] (no image larger than it)."""
    if t.sizes is not None and t.size_range is not None:
        raise ConfigError("train: give sizes (a set) or size_range ([min, max]), not both")
    if t.size_range is not None and (len(t.size_range) != 2 or t.size_range[0] > t.size_range[1]):
        raise ConfigError(f"train.size_range is [min, max] with min <= max, got {t.size_range}")
    drawn = t.sizes if t.sizes is not None else t.size_range
    if drawn is not None and (not drawn or not all(1 <= s <= img_size for s in drawn)):
        raise ConfigError(f"{where}: sizes in [1, data.img_size={img_size}] (multi-resolution "
                          f"training draws at or below the base size), got {drawn}")


# ----------------------------------------------------------------------------------------------------
# loading and overrides


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` strings to raw config data, type-checked against the schema."""
    return schema.apply_overrides(ExperimentConfig, data, overrides, HOOKS)
