"""What an experiment produces, typed: per scheme its training summary and accuracies, per run the table.

In memory, sizes and seeds are ints; in results.json (``to_json`` / ``from_json``) they are strings, as
JSON keys must be. The file keeps one flat object per scheme: the entry's fields, ``train``,
``accuracy`` (zero-shot), ``finetuned`` (after fine-tune-at-target), ``skipped_images``; a run over
several seeds (``combine_seeds``) holds their means there, the sample standard deviations in
``accuracy_std`` / ``finetuned_std`` and every seed's own values in ``per_seed`` (with its convergence verdict).
``train`` holds the validation curve the convergence check reads (``train.evaluation.convergence``); files
written before it load with an empty curve.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any

from ..config.sections import SchemeConfig, TrainConfig
from .convergence import Convergence, lr_window, plateau

Accuracy = dict[str, dict[int, float]]  # protocol -> evaluation size (px) -> top-1 accuracy (%)
DEFAULT_WITHIN = TrainConfig.converged_within  # the tolerance of a results.json made before it was a setting


def within_of_config(config: dict[str, Any]) -> float:
    """The convergence tolerance (points) a run's config (as plain data) was made with."""
    return float(config.get("train", {}).get("converged_within", DEFAULT_WITHIN))


def lr_window_of_config(config: dict[str, Any]) -> tuple[float, float]:
    """The learning rate over the plateau test's fifth before the last, as fractions of its peak (``lr_window``),
    under the schedule a run's config (as plain data) trained with."""
    train = config.get("train", {})
    lr = float(train.get("lr", TrainConfig.lr))
    return lr_window(float(train.get("warmup", TrainConfig.warmup)),
                     float(train.get("min_lr", TrainConfig.min_lr)) / lr if lr else 0.0)


def accuracy_to_json(acc: Accuracy) -> dict[str, dict[str, float]]:
    return {protocol: {str(size): v for size, v in by_size.items()} for protocol, by_size in acc.items()}


def accuracy_from_json(data: dict[str, dict[str, float]]) -> Accuracy:
    return {protocol: {int(size): v for size, v in by_size.items()} for protocol, by_size in data.items()}


@dataclass
class TrainSummary:
    """How training one scheme went; ``history`` holds one row per epoch (train.engine.log.LOG_FIELDS), ``curve``
    every validation at the training size (epoch ends and every train.val_every steps)."""

    seconds: float
    epochs: int
    train_loss: float | None
    train_acc: float | None
    val_acc: float | None  # at the training size after the last epoch (train.val_every_epoch)
    skipped_images: int
    history: list[dict[str, Any]]
    weights: str = "final"  # what was evaluated: "final" (the last step's weights) or "ema" (their EMA, train.ema)
    curve: list[list[float]] = field(default_factory=list)  # [global step, val acc (%)], in order
    total_steps: int | None = None  # the run's optimiser steps (None: a results.json made before the curve)

    def convergence(self, within: float) -> Convergence | None:
        """The plateau test on the curve (``train.evaluation.convergence``); None when it cannot be checked."""
        return plateau(self.curve, self.total_steps, within)


@dataclass
class SeedResult:
    """One seed's numbers of an entry, kept beside the means of a run over several seeds."""

    accuracy: Accuracy
    finetuned: Accuracy
    train_seconds: float | None
    finetune_seconds: float | None
    convergence: dict[str, Any] | None = None  # the seed's plateau test (Convergence as a dict); None: not checked

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "accuracy": accuracy_to_json(self.accuracy),
                "finetuned": accuracy_to_json(self.finetuned)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SeedResult:
        return cls(**{**data, "accuracy": accuracy_from_json(data["accuracy"]),
                      "finetuned": accuracy_from_json(data["finetuned"])})


@dataclass
class SchemeResult:
    """One row of the comparison: the entry, its training (None for evaluation-only entries), its accuracies.

    Over several seeds: ``accuracy`` and ``finetuned`` are means; ``train`` and ``finetune_seconds`` are the
    first seed's.
    """

    scheme: SchemeConfig
    train: TrainSummary | None
    accuracy: Accuracy  # zero-shot
    skipped_images: int  # unreadable validation images
    finetuned: Accuracy = field(default_factory=dict)  # after fine-tune-at-target (empty: no phase)
    finetune_seconds: float | None = None
    accuracy_std: Accuracy = field(default_factory=dict)  # sample std over seeds (empty: one seed)
    finetuned_std: Accuracy = field(default_factory=dict)
    per_seed: dict[int, SeedResult] = field(default_factory=dict)  # several seeds: each one's numbers

    def to_json(self) -> dict[str, Any]:
        entry = {k: v for k, v in dataclasses.asdict(self.scheme).items() if k != "name"}
        train = None if self.train is None else dataclasses.asdict(self.train)
        return {**entry, "train": train, "accuracy": accuracy_to_json(self.accuracy),
                "skipped_images": self.skipped_images, "finetuned": accuracy_to_json(self.finetuned),
                "finetune_seconds": self.finetune_seconds, "accuracy_std": accuracy_to_json(self.accuracy_std),
                "finetuned_std": accuracy_to_json(self.finetuned_std),
                "per_seed": {str(seed): r.to_json() for seed, r in self.per_seed.items()}}

    @classmethod
    def from_json(cls, name: str, data: dict[str, Any]) -> SchemeResult:
        entry_keys = {f.name for f in dataclasses.fields(SchemeConfig)}
        scheme = SchemeConfig(name=name, **{k: v for k, v in data.items() if k in entry_keys})
        train = None if data["train"] is None else TrainSummary(**data["train"])
        return cls(scheme, train, accuracy_from_json(data["accuracy"]), data["skipped_images"],
                   accuracy_from_json(data.get("finetuned", {})), data.get("finetune_seconds"),
                   accuracy_from_json(data.get("accuracy_std", {})), accuracy_from_json(data.get("finetuned_std", {})),
                   {int(seed): SeedResult.from_json(r) for seed, r in data.get("per_seed", {}).items()})


@dataclass
class RunResult:
    """A whole experiment: every scheme evaluated at ``sizes`` under ``protocols``."""

    name: str
    train_size: int  # px
    sizes: list[int]  # evaluation sizes, px
    protocols: list[str]
    eval_images: int
    canvas: str  # how the canvas protocol placed the images, in words
    device: str
    processes: int
    command: str | None  # the command line that made the run
    schemes: dict[str, SchemeResult]
    config: dict[str, Any]  # the experiment config as plain data
    wall_seconds: float = 0.0
    seeds: list[int] = field(default_factory=list)  # the seeds behind each number (means over them when several)

    def accuracies(self) -> dict[str, Accuracy]:
        """Scheme name -> its accuracy table."""
        return {name: r.accuracy for name, r in self.schemes.items()}

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**data, "schemes": {name: r.to_json() for name, r in self.schemes.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunResult:
        schemes = {name: SchemeResult.from_json(name, r) for name, r in data["schemes"].items()}
        return cls(**{**data, "schemes": schemes})


def mean_std(tables: list[Accuracy]) -> tuple[Accuracy, Accuracy]:
    """Cell-wise mean and sample standard deviation of several seeds' tables (std empty for one table)."""
    mean: Accuracy = {p: {s: statistics.fmean(t[p][s] for t in tables) for s in by_size}
                      for p, by_size in tables[0].items()}
    if len(tables) < 2:
        return mean, {}
    std: Accuracy = {p: {s: statistics.stdev(t[p][s] for t in tables) for s in by_size}
                     for p, by_size in tables[0].items()}
    return mean, std


def combine_seeds(runs: dict[int, RunResult], *, name: str, config: dict[str, Any], command: str | None,
                  wall_seconds: float) -> RunResult:
    """One result from the same run repeated per seed: means, standard deviations and every seed's values."""
    first = next(iter(runs.values()))
    schemes: dict[str, SchemeResult] = {}
    for entry, r0 in first.schemes.items():
        rows = {seed: run.schemes[entry] for seed, run in runs.items()}
        acc, acc_std = mean_std([r.accuracy for r in rows.values()])
        tuned, tuned_std = mean_std([r.finetuned for r in rows.values()]) if r0.finetuned else ({}, {})
        within = within_of_config(config)
        per_seed = {seed: SeedResult(r.accuracy, r.finetuned, r.train.seconds if r.train else None,
                                     r.finetune_seconds, convergence_dict(r.train, within)) for seed, r in rows.items()}
        schemes[entry] = SchemeResult(r0.scheme, r0.train, acc, max(r.skipped_images for r in rows.values()), tuned,
                                      r0.finetune_seconds, acc_std, tuned_std, per_seed)
    return dataclasses.replace(first, name=name, command=command, schemes=schemes, config=config,
                               wall_seconds=wall_seconds, seeds=list(runs))


def convergence_dict(train: TrainSummary | None, within: float) -> dict[str, Any] | None:
    """A seed's plateau test as plain data for results.json (None: no training, or not checked)."""
    verdict = None if train is None else train.convergence(within)
    return None if verdict is None else dataclasses.asdict(verdict)


def convergences(r: SchemeResult, within: float) -> list[Convergence | None]:
    """An entry's plateau test per seed (one item for a single-seed run); empty for an evaluation-only entry."""
    if r.train is None:
        return []
    if r.per_seed:
        return [None if s.convergence is None else Convergence(**s.convergence) for s in r.per_seed.values()]
    return [r.train.convergence(within)]
