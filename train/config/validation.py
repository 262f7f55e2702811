"""Checks across the fields of an experiment config: ranges, exclusive choices, each entry against the registry.

``train.config.sections`` declares the fields and their types (checked as the schema is filled); what only holds
between fields, or against vispos's registry, is checked here, each error naming what is accepted.
"""

from __future__ import annotations

from typing import Any

import vispos

from .entries import check_entries, check_scaling
from .sections import (
    PATCH_OPTIONS,
    PROTOCOLS,
    TIMM_TABLE,
    ConfigError,
    DataConfig,
    ExperimentConfig,
    SchemeConfig,
    TrainConfig,
)


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
    if t.val_every < 0:
        raise ConfigError(f"train.val_every must be >= 0 (0: validation at epoch ends only), got {t.val_every}")
    if not 0.0 <= t.warmup < 1.0:
        raise ConfigError(f"train.warmup is a fraction of all steps in [0, 1), got {t.warmup}")
    if (e.sizes is None) == (e.scales is None):
        raise ConfigError("eval: give exactly one of sizes (pixels) or scales (multiples of data.img_size)")
    if not e.protocols or len(set(e.protocols)) != len(e.protocols):
        raise ConfigError(f"eval.protocols: list each of {', '.join(PROTOCOLS)} at most once, at least one")
    if not d.dataset.startswith("grid_"):
        if d.zooms != [1]:
            raise ConfigError(f"data.zooms draws generated scenes larger (grid tasks); {d.dataset} images are "
                              "scale-augmented with data.augment=rrc_flip")
        if "zoom" in e.protocols:
            raise ConfigError(f"eval.protocols: zoom draws the same scenes on more pixels, which only a generated "
                              f"dataset (grid_*) can; for {d.dataset}, train below the native resolution "
                              "(data.img_size) and evaluate up to it with resize, which is the same protocol")
    elif not d.zooms or len(set(d.zooms)) != len(d.zooms) or min(d.zooms) < 1:
        raise ConfigError(f"data.zooms: distinct positive integers (cells of 4 x z px), got {d.zooms}")
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
        if not s.trains and (s.sizes is not None or s.augment is not None or s.num_heads is not None):
            raise ConfigError(f"schemes[{s.name}]: sizes, augment and num_heads (training levers) need a trained "
                              "entry, not an evaluation-only one (base)")
        if s.num_heads is not None and (isinstance(s.num_heads, bool) or s.num_heads < 1):
            raise ConfigError(f"schemes[{s.name}].num_heads must be >= 1, or null (model.num_heads), got {s.num_heads}")
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
        ("train.pos_lr_scale", t.pos_lr_scale, t.pos_lr_scale > 0, "> 0"),
        ("train.pos_weight_decay", t.pos_weight_decay, t.pos_weight_decay >= 0, ">= 0"),
        ("train.grad_clip", t.grad_clip, positive_or_null(t.grad_clip), "> 0, or null (no clipping)"),
        ("train.label_smoothing", t.label_smoothing, 0 <= t.label_smoothing < 1, "in [0, 1)"),
        ("train.ema_decay", t.ema_decay, 0 < t.ema_decay < 1, "in (0, 1)"),
        ("train.converged_within", t.converged_within, t.converged_within > 0, "> 0 (points)"),
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
    """The statistics: positive, one per channel of the dataset (the classes and augmentation:
    ``train.experiment.loading``)."""
    if d.std is not None and not all(s > 0 for s in d.std):
        raise ConfigError(f"data.std must be > 0 per channel, got {d.std}")
    if d.mean is not None and d.std is not None and len(d.mean) != len(d.std):
        raise ConfigError(f"data.mean and data.std need one value per channel each, got {d.mean} and {d.std}")
    if len(d.crop_scale) != 2 or not 0 < d.crop_scale[0] <= d.crop_scale[1] <= 1:
        raise ConfigError(f"data.crop_scale: [smallest, largest] crop area as fractions of the image, "
                          f"0 < smallest <= largest <= 1 (e.g. [0.08, 1.0]), got {d.crop_scale}")
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
