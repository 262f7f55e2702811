"""The generation experiment's schema (``task: generation``): a class-conditional diffusion transformer trained per
positional scheme, sampled at multiples of its training size and scored there.

It shares the classifier's pieces: ``RunConfig`` (name, seeds, out_dir, device), scheme entries and their shorthand
(``train.config.entries``; ``rope2d+yarn`` is an evaluation-only entry of ``rope2d``, ``rope2d+ntk+dype`` adds DyPE's
timestep schedule, ``rope2d+logn`` log-n attention), ``DataConfig`` (Fashion-MNIST, ``img_size`` the training size)
and ``TrainConfig`` (optimiser, schedule, checkpoints, EMA). What is its own: the model (``DitConfig``: diffusers'
``DiTTransformer2DModel`` in pixel space), the sampler (``SampleConfig``) and the scores (``ScoreConfig``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from . import schema
from .entries import RunConfig, SchemeEntry, check_entries, expand_shorthand
from .schema import ConfigError
from .sections import DataConfig, TrainConfig

# evaluation-only words of an entry's shorthand, besides the RoPE scaling names
GENERATION_WORDS: dict[str, dict[str, Any]] = {
    "logn": {"log_n_attention": True},
    "dype": {"scaling_options": {"schedule": "dype"}},
}
# TrainConfig fields the diffusion trainer does not read: a value other than the default is refused by name
UNUSED_TRAIN_FIELDS: tuple[str, ...] = (
    "label_smoothing", "mixup", "cutmix", "sizes", "size_range", "val_every", "pos_lr_scale", "pos_weight_decay",
    "activation_checkpointing", "compile",
)  # fmt: skip


@dataclass
class DitConfig:
    """diffusers' ``DiTTransformer2DModel`` in pixel space: adaLN-Zero blocks conditioned on the timestep and the
    class (DiT's label embedding drops the class with probability 0.1 in training, the null class of guidance)."""

    patch_size: int = 2
    num_heads: int = 4
    head_dim: int = 32
    depth: int = 6


@dataclass
class SampleConfig:
    """Sampling with diffusers' ``FlowMatchEulerDiscreteScheduler`` (the training schedule's Euler steps)."""

    scales: list[int] = field(default_factory=lambda: [1, 2, 3])  # sizes as multiples of the training size
    steps: int = 25  # Euler steps from pure noise
    images: int = 500  # per size and setting, class-balanced (images / classes of each class)
    guidance: float = 1.0  # classifier-free guidance scale (1: the conditional model alone)
    batch_size: int = 100


@dataclass
class ScoreConfig:
    """The scorer: a small CNN trained once on Fashion-MNIST at 28 px (fixed seed, cached in the run folder) whose
    penultimate features give the Frechet distances and whose predictions give the class accuracy."""

    epochs: int = 3
    train_images: int | None = None  # the first N training images (None: all 60k)
    seed: int = 0
    reference_images: int = 5000  # the test images each score compares with (the second half of the test set)


@dataclass
class GenSchemeConfig(SchemeEntry):
    """One row: a scheme trained inside the DiT (``pos``), or an evaluation-only setting of a trained one (``base``).
    ``inherit: true`` keeps DiT's own sin-cos table (``pos: sincos2d``), which spans the same coordinates at every
    size (interpolation by construction); otherwise the scheme replaces it (``vispos.patch(..., inherit=False)``)."""

    pos: list[str] = field(default_factory=list)
    inherit: bool = False
    log_n_attention: bool = False


@dataclass
class GenerationConfig(RunConfig):
    """A whole generation run: every entry trained under identical settings, sampled at every size, scored."""

    task: Literal["generation"] = "generation"
    schemes: list[GenSchemeConfig] = field(default_factory=list)
    seeds: list[int] | None = None
    threads: int | None = None
    resume: bool = True
    data: DataConfig = field(default_factory=lambda: DataConfig(img_size=14))
    model: DitConfig = field(default_factory=DitConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    scores: ScoreConfig = field(default_factory=ScoreConfig)

    @property
    def sizes(self) -> list[int]:
        return [self.data.img_size * s for s in self.sample.scales]


def _scheme_hook(data: Any, where: str) -> Any:
    if isinstance(data, str):
        data = expand_shorthand(data, where, GENERATION_WORDS)
    if isinstance(data, dict) and isinstance(data.get("pos"), str):
        data = {**data, "pos": [p.strip() for p in data["pos"].split("+")]}
    return data


HOOKS = {GenSchemeConfig: _scheme_hook}


def is_generation(data: dict[str, Any]) -> bool:
    """Whether raw config data describes a generation run (``task: generation``)."""
    return data.get("task") == "generation"


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    return schema.apply_overrides(GenerationConfig, data, overrides, HOOKS)


def generation_config(data: Any) -> GenerationConfig:
    """Fill the schema strictly and check what crosses fields."""
    cfg = schema.from_dict(GenerationConfig, data, "", HOOKS)
    check_entries(cfg.schemes)
    d, m, t, s = cfg.data, cfg.model, cfg.train, cfg.sample
    if d.dataset != "fashion_mnist":
        raise ConfigError(f"data.dataset: the generation trainer takes fashion_mnist, got {d.dataset!r}")
    if d.augment != "none":
        raise ConfigError("data.augment: the generation trainer trains on the whole images (none)")
    if not 0 < d.img_size <= 28 or d.img_size % m.patch_size:
        raise ConfigError(f"data.img_size {d.img_size}: the training size must be at most 28 px (Fashion-MNIST's "
                          f"own, downsampled to it) and a multiple of model.patch_size ({m.patch_size})")  # fmt: skip
    for name in ("patch_size", "num_heads", "head_dim", "depth"):
        if getattr(m, name) < 1:
            raise ConfigError(f"model.{name} must be >= 1, got {getattr(m, name)}")
    defaults = TrainConfig()
    changed = [f for f in UNUSED_TRAIN_FIELDS if getattr(t, f) != getattr(defaults, f)]
    if changed:
        raise ConfigError(f"train.{', train.'.join(changed)}: the diffusion trainer does not use them (the "
                          "classifier's levers); leave them out")  # fmt: skip
    if t.strategy != "ddp":
        raise ConfigError("train.strategy: the diffusion trainer runs one process or DDP (torchrun); fsdp is the "
                          "classifier's")  # fmt: skip
    if t.epochs < 1 or t.batch_size < 1 or t.lr <= 0:
        raise ConfigError("train.epochs, train.batch_size and train.lr must be positive")
    if not s.scales or any(k < 1 for k in s.scales) or s.steps < 1 or s.images < 1 or s.batch_size < 1:
        raise ConfigError("sample.scales (multiples >= 1), sample.steps, sample.images and sample.batch_size must be "
                          "positive")  # fmt: skip
    if s.guidance < 1.0:
        raise ConfigError(f"sample.guidance is a guidance scale >= 1 (1: none), got {s.guidance}")
    if cfg.scores.epochs < 1 or cfg.scores.reference_images < 2:
        raise ConfigError("scores.epochs must be >= 1 and scores.reference_images >= 2")
    for e in cfg.schemes:
        if e.trains and not e.pos:
            raise ConfigError(f"schemes: entry {e.name!r} names no scheme (pos)")
        if e.trains and (e.scaling or e.log_n_attention or e.scaling_options):
            raise ConfigError(f"schemes: entry {e.name!r} trains; give its inference settings to an evaluation-only "
                              f"entry (e.g. {e.name}+yarn)")  # fmt: skip
        if e.drope:
            raise ConfigError(f"schemes: entry {e.name!r}: DroPE is the classifier's schedule")
        if e.inherit and e.pos != ["sincos2d"]:
            raise ConfigError(f"schemes: entry {e.name!r}: inherit keeps DiT's own sin-cos table (pos: sincos2d)")
        if not e.trains and (e.pos or e.inherit):
            raise ConfigError(f"schemes: entry {e.name!r} evaluates {e.base!r}'s model; it takes no pos or inherit")
    return cfg


def with_seed(cfg: GenerationConfig, seed: int, out_dir: str) -> GenerationConfig:
    return dataclasses.replace(cfg, seed=seed, seeds=None, out_dir=out_dir)
