"""What an experiment produces, typed: per scheme its training summary and accuracies, per run the table.

In memory, sizes are ints; in results.json (``to_json`` / ``from_json``) they are strings, as JSON keys
must be. The file keeps one flat object per scheme: the entry's fields, ``train``, ``accuracy``,
``skipped_images``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .config import SchemeConfig

Accuracy = dict[str, dict[int, float]]  # protocol -> evaluation size (px) -> top-1 accuracy (%)


def accuracy_to_json(acc: Accuracy) -> dict[str, dict[str, float]]:
    return {protocol: {str(size): v for size, v in by_size.items()} for protocol, by_size in acc.items()}


def accuracy_from_json(data: dict[str, dict[str, float]]) -> Accuracy:
    return {protocol: {int(size): v for size, v in by_size.items()} for protocol, by_size in data.items()}


@dataclass
class TrainSummary:
    """How training one scheme went; ``history`` holds one row per epoch (engine.LOG_FIELDS)."""

    seconds: float
    epochs: int
    train_loss: float | None
    train_acc: float | None
    val_acc: float | None  # at the training size after the last epoch (train.val_every_epoch)
    skipped_images: int
    history: list[dict[str, Any]]


@dataclass
class SchemeResult:
    """One row of the comparison: the entry, its training (None for evaluation-only entries), its accuracies."""

    scheme: SchemeConfig
    train: TrainSummary | None
    accuracy: Accuracy
    skipped_images: int  # unreadable validation images

    def to_json(self) -> dict[str, Any]:
        entry = {k: v for k, v in dataclasses.asdict(self.scheme).items() if k != "name"}
        train = None if self.train is None else dataclasses.asdict(self.train)
        return {**entry, "train": train, "accuracy": accuracy_to_json(self.accuracy),
                "skipped_images": self.skipped_images}

    @classmethod
    def from_json(cls, name: str, data: dict[str, Any]) -> SchemeResult:
        entry_keys = {f.name for f in dataclasses.fields(SchemeConfig)}
        scheme = SchemeConfig(name=name, **{k: v for k, v in data.items() if k in entry_keys})
        train = None if data["train"] is None else TrainSummary(**data["train"])
        return cls(scheme, train, accuracy_from_json(data["accuracy"]), data["skipped_images"])


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
