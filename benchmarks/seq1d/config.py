"""The benchmark's configuration: dataclasses (the schema) filled strictly from YAML and ``key=value`` overrides.

An unknown key or a value of the wrong type is an error that names what is accepted (``train.config.schema``).
Scheme entries are the trainer's (``train.config.entries``): ``{name: rope+ntk, base: rope, scaling: ntk,
scaling_options: {factor: 4.0}}`` evaluates the trained ``rope`` model with NTK scaling. Shorthand strings:
``rope`` (train this 1D scheme), ``rope+yarn`` (= ``{name: rope+yarn, base: rope, scaling: yarn}``),
``learned1d+clamp`` (= ``{name: learned1d+clamp, base: learned1d, out_of_range: clamp}``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import vispos
import vispos.registry
from train.config import schema
from train.config.entries import RunConfig, SchemeEntry, check_entries, check_scaling, expand_shorthand
from train.config.schema import ConfigError

TASKS: tuple[str, ...] = ("passkey", "copy", "reverse", "recall")
OUT_OF_RANGE: tuple[str, ...] = ("error", "clamp", "interpolate")
SHORTHAND_WORDS = {rule: {"out_of_range": rule} for rule in OUT_OF_RANGE}  # besides the RoPE scalings


@dataclass
class PasskeyConfig:
    """A key of ``key_len`` symbols after a marker, hidden at a depth in filler drawn from the same symbols."""

    values: int = 16  # alphabet of the key and the filler: the marker is the only cue
    key_len: int = 1
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])  # evaluation depths


@dataclass
class CopyConfig:
    """Copy (or reverse) the symbols before the separator; scored per output token."""

    values: int = 64


@dataclass
class RecallConfig:
    """Associative recall: ``pairs`` key-value pairs scattered in filler, then ``queries`` of their keys."""

    keys: int = 32  # key alphabet (keys are distinct within a sequence)
    values: int = 16  # value alphabet, also the filler's
    pairs: int = 8
    queries: int = 4


@dataclass
class ModelConfig:
    """A pre-norm causal transformer: token embedding, blocks of vispos.layers.Attention + MLP, LM head."""

    dim: int = 64
    depth: int = 2
    heads: int = 4
    mlp_ratio: float = 4.0


@dataclass
class TrainConfig:
    """Identical for every scheme: same seed, data, steps and schedule."""

    length: int = 64  # training length L (tokens per sequence)
    min_length: int | None = None  # each batch's length drawn from [min_length, length]; None: always L
    steps: int = 1500
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup: float = 0.1  # fraction of steps with linear warm-up, then cosine decay to 0
    grad_clip: float | None = 1.0
    drope_schedule: Literal["restart", "continue"] = "restart"  # at the drop: warm-up + cosine again, or go on
    log_every: int = 250


@dataclass
class EvalConfig:
    multiples: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # evaluated lengths, in units of L
    samples: int = 320  # sequences per length (passkey: split evenly over the depths)
    batch_size: int = 64


@dataclass
class LongRopeConfig:
    """LongRoPE's per-frequency factors: given, or found by a small search on held-out data and lengths."""

    long_factors: list[float] | None = None  # one per rotary frequency (head_dim / 2); None: search
    search_multiples: list[float] = field(default_factory=lambda: [3.0, 6.0])  # held-out lengths, units of L
    search_samples: int = 64  # held-out sequences per search length
    candidates: int = 24  # structured candidates, then mutations of the best ones
    rounds: int = 1
    factor: float | None = 4.0  # LongRoPE's scale s (attention factor); None: length / L


@dataclass
class SchemeConfig(SchemeEntry):
    """A row of the tables: a 1D scheme to train (``pos``) or an evaluation-only variant of one (``base``).

    ``scaling`` (any of ``vispos.SCALING_TYPES``) needs a ``rope`` base; ``longrope`` factors come from
    ``longrope.long_factors`` or a search when ``scaling_options`` does not give them.
    """

    pos: str | None = None  # vispos 1D registry name
    out_of_range: Literal["error", "clamp", "interpolate"] | None = None  # learned1d rule at evaluation


@dataclass
class BenchConfig(RunConfig):
    schemes: list[SchemeConfig]
    device: Literal["auto", "cpu", "cuda"] = "cpu"
    tasks: list[Literal["passkey", "copy", "reverse", "recall"]] = field(default_factory=lambda: ["passkey"])
    threads: int = 1  # torch threads per worker process
    workers: int = 1  # processes training schemes in parallel (CPU); 1 runs in this process
    passkey: PasskeyConfig = field(default_factory=PasskeyConfig)
    copy: CopyConfig = field(default_factory=CopyConfig)
    reverse: CopyConfig = field(default_factory=CopyConfig)
    recall: RecallConfig = field(default_factory=RecallConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    longrope: LongRopeConfig = field(default_factory=LongRopeConfig)

    def lengths(self) -> list[int]:
        return [m * self.train.length for m in self.eval.multiples]


# ---------------------------------------------------------------------------------------------------
# strict conversion from plain data


def _scheme_hook(data: Any, where: str) -> Any:
    """A shorthand string (``train.config.entries``); the old ``scaling: {type: ...}`` mapping is refused with
    the new form."""
    if isinstance(data, str):
        data = expand_shorthand(data, where, SHORTHAND_WORDS)
        if "+" in (data.get("pos") or ""):
            raise ConfigError(
                f"scheme {data['name']!r}: after '+' write a RoPE scaling ({', '.join(vispos.SCALING_TYPES)}) or "
                f"an out-of-range rule ({', '.join(OUT_OF_RANGE)})"
            )
    if isinstance(data, dict) and isinstance(data.get("scaling"), dict):
        options = {k: v for k, v in data["scaling"].items() if k != "type"}
        raise ConfigError(
            f"{where}: scaling is a name now, its options sit beside it; write scaling: "
            f"{data['scaling'].get('type')}" + (f", scaling_options: {options}" if options else "")
        )
    return data


def validate(cfg: BenchConfig) -> BenchConfig:
    """Checks across fields."""
    trained = check_entries(cfg.schemes)
    for s in cfg.schemes:
        where = f"schemes[{s.name}]"
        if s.trains:
            if s.scaling is not None or s.out_of_range is not None:
                raise ConfigError(f"{where}: scaling / out_of_range are evaluation-only; give base as well")
            try:
                accepted = vispos.registry.accepted_options(s.pos, 1)  # type: ignore[arg-type]
            except ValueError as e:
                raise ConfigError(f"{where}: {e}") from None
            unknown = sorted(set(s.options) - set(accepted))
            if unknown:
                raise ConfigError(f"{where}: unknown option(s) {', '.join(unknown)}; accepted: {', '.join(accepted)}")
            continue
        if (s.scaling is None) == (s.out_of_range is None):
            raise ConfigError(f"{where}: an evaluation-only row needs exactly one of scaling or out_of_range")
        base_pos = trained[s.base].pos  # type: ignore[index]
        if s.scaling is not None and base_pos != "rope":
            raise ConfigError(f"{where}: scaling needs a rope base, not {base_pos!r}")
        if s.out_of_range is not None and base_pos != "learned1d":
            raise ConfigError(f"{where}: out_of_range applies to a learned1d base, not {base_pos!r}")
        later = {"long_factors": (1.0,)} if s.scaling == "longrope" else {}  # from the search or longrope:
        check_scaling(s, original_length=cfg.train.length, **later)
    if not cfg.tasks or len(set(cfg.tasks)) != len(cfg.tasks):
        raise ConfigError(f"tasks: list each of {', '.join(TASKS)} at most once, at least one")
    t, e = cfg.train, cfg.eval
    for key, val in (
        ("train.length", t.length),
        ("train.steps", t.steps),
        ("train.batch_size", t.batch_size),
        ("eval.samples", e.samples),
        ("eval.batch_size", e.batch_size),
        ("workers", cfg.workers),
        ("threads", cfg.threads),
        ("model.depth", cfg.model.depth),
        ("passkey.key_len", cfg.passkey.key_len),
    ):
        if val < 1:
            raise ConfigError(f"{key} must be >= 1, got {val}")
    if not e.multiples or min(e.multiples) < 1:
        raise ConfigError(f"eval.multiples: positive multiples of train.length, got {e.multiples}")
    if t.min_length is not None and not 1 <= t.min_length <= t.length:
        raise ConfigError(f"train.min_length must be in [1, train.length], got {t.min_length}")
    if not 0.0 <= t.warmup < 1.0:
        raise ConfigError(f"train.warmup is a fraction of the steps in [0, 1), got {t.warmup}")
    if not cfg.passkey.depths or not all(0.0 <= d <= 1.0 for d in cfg.passkey.depths):
        raise ConfigError(f"passkey.depths: fractions in [0, 1], got {cfg.passkey.depths}")
    return cfg


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``a.b=value`` strings onto raw config data, type-checked against the schema."""
    return schema.apply_overrides(BenchConfig, data, overrides, {SchemeConfig: _scheme_hook})


def config_from_dict(data: Any) -> BenchConfig:
    return validate(schema.from_dict(BenchConfig, data, "", {SchemeConfig: _scheme_hook}))


def load_config(path: str | Path, overrides: list[str] | None = None) -> BenchConfig:
    """Read a YAML config, apply overrides, validate."""
    return config_from_dict(apply_overrides(schema.read_yaml(path), overrides or []))


def to_dict(cfg: BenchConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
