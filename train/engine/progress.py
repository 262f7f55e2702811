"""Where one scheme's training stands (``Progress``, what a checkpoint restores besides the weights) and the files it
leaves in its folder: ``checkpoint.pt`` while it trains and ``summary.json`` once it has finished (``kept_summary``
reads a finished training's back, refusing one of another config)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.sections import ConfigError
from ..evaluation.results import TrainSummary
from . import checkpoint as ckpt_io

CHECKPOINT = "checkpoint.pt"  # a training's weights, optimiser and progress (ckpt_io)
SUMMARY = "summary.json"  # a finished training's TrainSummary and fingerprint, beside its checkpoint


def kept_summary(folder: Path, fingerprint: dict[str, Any]) -> TrainSummary | None:
    """The summary of a training finished in ``folder`` (None: there is none); one of another config is refused, as
    its checkpoint would be (the results it stands for are not overwritten)."""
    path = folder / SUMMARY
    try:
        saved = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    diff = ckpt_io.fingerprint_diff(saved.get("fingerprint", {}), json.loads(json.dumps(fingerprint)))
    if diff:
        raise ConfigError(
            f"{path} is the summary of a training with a different config (differs in: {', '.join(diff)}); "
            "set resume=false to start it over, or choose another out_dir"
        )
    return TrainSummary(**saved["summary"])


@dataclass
class Progress:
    """Where one scheme's training stands: what a checkpoint restores besides the weights."""

    epoch: int = 0  # the epoch in progress
    step: int = 0  # the next step within it
    sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # loss x n, correct, n of this epoch
    history: list[dict[str, Any]] = field(default_factory=list)  # one row (log.LOG_FIELDS) per finished epoch
    skipped: int = 0  # unreadable images so far
    seconds: float = 0.0  # training time spent by earlier processes of a resumed run
    drawn: list[int] = field(default_factory=list)  # the training size of every step so far (px)
    curve: list[list] = field(default_factory=list)  # [global step, val acc] of every validation so far, in order


def size_counts(sizes: list[int]) -> str:
    """How often each training size was drawn, for the log: '16:20 20:19 28:39'."""
    return " ".join(f"{s}:{sizes.count(s)}" for s in sorted(set(sizes)))
