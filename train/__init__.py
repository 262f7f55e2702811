"""vispos trainer: train several positional schemes on one timm ViT, evaluate their resolution
extrapolation (resize and canvas protocols), and report tables and a plot.

    python -m train --config configs/fmnist_extrapolation.yaml [key=value ...]
    python -m train.evaluate --checkpoint runs/NAME/SCHEME/checkpoint.pt --sizes 28 56
"""

from __future__ import annotations

from typing import Any

from .config import ConfigError, ExperimentConfig, SchemeConfig, config_from_dict, load_config

__all__ = ["ConfigError", "ExperimentConfig", "SchemeConfig", "config_from_dict", "load_config", "run_experiment"]


def __getattr__(name: str) -> Any:
    # run_experiment pulls in torch and the evaluation module; imported on first use so that
    # `python -m train.evaluate` does not find its own module pre-imported by the package
    if name == "run_experiment":
        from .experiment import run_experiment

        return run_experiment
    raise AttributeError(f"module 'train' has no attribute {name!r}")
