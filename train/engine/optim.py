"""Optimiser and learning-rate schedule of one scheme's training, from the ``train`` config section."""

from __future__ import annotations

from typing import Any

import torch
from timm.optim import create_optimizer_v2, param_groups_weight_decay
from torch import nn

from ..config.sections import TrainConfig
from .schedule import warmup_cosine, warmup_steps


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """timm's AdamW: no weight decay on 1-D parameters (norms, biases) nor on ``model.no_weight_decay()``. With
    ``train.pos_lr_scale`` or ``train.pos_weight_decay`` set, the positional parameters (``vispos.*``) form a
    group of their own (``positional_groups``)."""
    grouped = cfg.pos_lr_scale != 1.0 or cfg.pos_weight_decay != 0.0
    return create_optimizer_v2(model, "adamw", lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999),
                               param_group_fn=(lambda m: positional_groups(m, cfg)) if grouped else None)  # fmt: skip


def is_positional(name: str) -> bool:
    """A parameter of the model's positions: under ``vispos`` (also inside a wrapper: ``module.vispos.*``)."""
    return "vispos" in name.split(".")


def positional_groups(model: nn.Module, cfg: TrainConfig) -> list[dict[str, Any]]:
    """timm's weight-decay groups (``param_groups_weight_decay``, the rule ``make_optimizer`` uses otherwise)
    without the positional parameters, which come last in a group at ``lr * pos_lr_scale`` with weight decay
    ``pos_weight_decay``. The learning-rate schedule scales every group alike, so the ratio holds all run."""
    no_decay = getattr(model, "no_weight_decay", set)()
    groups = param_groups_weight_decay(model, weight_decay=cfg.weight_decay, no_weight_decay_list=no_decay)
    positional = [p for name, p in model.named_parameters() if p.requires_grad and is_positional(name)]
    taken = {id(p) for p in positional}
    groups = [g | {"params": [p for p in g["params"] if id(p) not in taken]} for g in groups]
    groups = [g for g in groups if g["params"]]
    if positional:
        groups.append({"params": positional, "lr": cfg.lr * cfg.pos_lr_scale, "weight_decay": cfg.pos_weight_decay})
    return groups


def make_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``cfg.warmup`` of the steps, then cosine to ``cfg.min_lr`` (``train.engine.schedule``);
    stepped once per optimiser step."""
    w = warmup_steps(cfg.warmup, total_steps)
    floor = cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: warmup_cosine(step, total_steps, w, floor=floor))
