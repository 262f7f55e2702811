"""Optimiser and learning-rate schedule of one scheme's training, from the ``train`` config section."""

from __future__ import annotations

import torch
from timm.optim import create_optimizer_v2
from torch import nn

from ..config.sections import TrainConfig
from .schedule import warmup_cosine, warmup_steps


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """timm's AdamW: no weight decay on 1-D parameters (norms, biases) nor on ``model.no_weight_decay()``."""
    return create_optimizer_v2(model, "adamw", lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999))


def make_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``cfg.warmup`` of the steps, then cosine to ``cfg.min_lr`` (``train.engine.schedule``);
    stepped once per optimiser step."""
    w = warmup_steps(cfg.warmup, total_steps)
    floor = cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: warmup_cosine(step, total_steps, w, floor=floor))
