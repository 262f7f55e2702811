"""vispos trainer: train several positional schemes on one timm ViT, evaluate their resolution
extrapolation (resize and canvas protocols), and report tables and a plot.

    python -m train --config configs/fmnist_extrapolation.yaml [key=value ...]
    python -m train.evaluate --checkpoint runs/NAME/SCHEME/checkpoint.pt --sizes 28 56

Layout, one subpackage per stage, each importing only those after it in this list (an import-linter
layers contract, ``make lint``): ``experiment`` (a config loaded and checked, the whole run), ``engine``
(models, optimiser and schedule, checkpoints, one scheme's training, fine-tuning), ``evaluation``
(accuracy per protocol, typed results, the report), ``data`` (datasets, transforms, loaders),
``runtime`` (processes, seeds, ddp / fsdp) and ``config`` (the schema, the entries, the checks). The
command lines sit on top of them all: ``__main__`` (train), ``evaluate`` (re-evaluate checkpoints),
``grid_report`` (every grid task, one report) and ``convert`` (a sharded checkpoint as plain weights);
``testing`` holds small fixtures for tests.
"""

from __future__ import annotations

from .config.sections import ConfigError, ExperimentConfig, SchemeConfig
from .evaluation.results import RunResult, SchemeResult, TrainSummary
from .experiment.loading import config_from_dict, load_config
from .experiment.run import run_experiment

__all__ = [
    "ConfigError", "ExperimentConfig", "RunResult", "SchemeConfig", "SchemeResult", "TrainSummary",
    "config_from_dict", "load_config", "run_experiment",
]
