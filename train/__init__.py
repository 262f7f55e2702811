"""vispos trainer: train several positional schemes on one timm ViT, evaluate their resolution
extrapolation (resize and canvas protocols), and report tables and a plot.

    python -m train --config configs/fmnist_extrapolation.yaml [key=value ...]
    python -m train.evaluate --checkpoint runs/NAME/SCHEME/checkpoint.pt --sizes 28 56

Layout, config in and typed results out, one idea per module: ``config`` (the experiment schema, on
``schema`` and ``entries``, which the sequence benchmark shares with ``schedule`` and ``seeds``),
``loading`` (a config read and checked against the data and the models), ``datasets`` (what every
dataset gives) with ``data`` and ``grid_tasks`` (the datasets), ``transforms`` / ``loaders`` (images to
batches), ``models`` and ``optim`` (what trains),
``engine`` (one scheme's training and checkpoints), ``accuracy`` (the evaluation protocols),
``experiment`` (the whole run), ``results`` and ``report`` (what it produced); ``__main__`` and
``evaluate`` are the two command lines. No two modules import each other, directly or through others
(an import-linter contract, ``make lint``).
"""

from __future__ import annotations

from .config import ConfigError, ExperimentConfig, SchemeConfig
from .experiment import run_experiment
from .loading import config_from_dict, load_config
from .results import RunResult, SchemeResult, TrainSummary

__all__ = [
    "ConfigError", "ExperimentConfig", "RunResult", "SchemeConfig", "SchemeResult", "TrainSummary",
    "config_from_dict", "load_config", "run_experiment",
]
