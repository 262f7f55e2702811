"""The trainer's optimiser (train/engine/optim.py): timm's AdamW groups, and the positional parameters in a group
of their own when ``train.pos_lr_scale`` / ``train.pos_weight_decay`` are set."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import timm
import torch
from timm.optim import create_optimizer_v2

import vispos
from train.config.sections import ConfigError, TrainConfig
from train.engine.checkpoint import fingerprint
from train.engine.optim import make_optimizer, make_scheduler
from train.experiment.loading import config_from_dict

BASE = {"name": "t", "schemes": ["rope2d"], "eval": {"sizes": [28, 56]}, "model": {"patch_size": 4}}


def model(pos: str | list[str] = ["learned2d", "relbias2d"]) -> torch.nn.Module:  # noqa: B006
    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=2, num_classes=3)
    return vispos.patch(m, pos)


def ids(params: list[torch.Tensor]) -> set[int]:
    return {id(p) for p in params}


def positional(m: torch.nn.Module) -> set[int]:
    return {id(p) for n, p in m.named_parameters() if n.startswith("vispos.")}


def test_by_default_the_groups_are_timms() -> None:
    m = model()
    cfg = TrainConfig()
    ours, timms = make_optimizer(m, cfg), create_optimizer_v2(m, "adamw", lr=cfg.lr, weight_decay=cfg.weight_decay)
    assert [(ids(g["params"]), g["weight_decay"]) for g in ours.param_groups] == [
        (ids(g["params"]), g["weight_decay"]) for g in timms.param_groups
    ]
    undecayed = next(g for g in ours.param_groups if g["weight_decay"] == 0.0)
    assert positional(m) <= ids(undecayed["params"])  # no_weight_decay(): every positional parameter


def test_pape2d_projections_are_decayed_as_its_release_trains_them() -> None:
    """The released PaPE recipe (AdamW over every parameter, weight decay 0.05) decays its projections: they are
    not in ``no_weight_decay()``, and the trainer's AdamW decays them; a table beside them is not decayed."""
    m = model(["learned2d", "pape2d"])
    pape = {n for n, _ in m.named_parameters() if n.startswith("vispos.attention.")}
    assert pape and {n.rsplit(".", 1)[-1] for n in pape} == {"weight"}  # position.weight, ab.weight per layer
    assert not pape & m.no_weight_decay() and "vispos.additive.table" in m.no_weight_decay()
    groups = make_optimizer(m, TrainConfig()).param_groups
    decayed = next(g for g in groups if g["weight_decay"] > 0.0)
    assert {id(p) for n, p in m.named_parameters() if n in pape} <= ids(decayed["params"])


def test_positional_parameters_get_their_own_learning_rate_and_weight_decay() -> None:
    m = model()
    cfg = TrainConfig(lr=1e-3, pos_lr_scale=0.1, pos_weight_decay=0.01)
    opt = make_optimizer(m, cfg)
    *rest, own = opt.param_groups
    assert ids(own["params"]) == positional(m) and len(positional(m)) >= 2  # the table and the bias
    assert own["lr"] == pytest.approx(1e-4) and own["weight_decay"] == 0.01
    everything = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(everything) == sorted(id(p) for p in m.parameters())  # each parameter once
    assert all(g["lr"] == 1e-3 for g in rest)
    timms = create_optimizer_v2(model(), "adamw", lr=1e-3, weight_decay=cfg.weight_decay)
    assert sorted(g["weight_decay"] for g in rest) == sorted(g["weight_decay"] for g in timms.param_groups)
    sched = make_scheduler(opt, cfg, total_steps=20)
    for _ in range(7):
        opt.step()
        sched.step()
    assert own["lr"] == pytest.approx(0.1 * rest[0]["lr"])  # the schedule scales both alike


def test_a_step_moves_the_positional_parameters_by_the_scale() -> None:
    """AdamW's first step moves each weight by about lr (times its sign): the positional ones by lr x scale."""
    x, y = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 0])
    moved = {}
    for scale in (1.0, 0.1):
        m = model()
        before = copy.deepcopy(m.state_dict())
        opt = make_optimizer(m, TrainConfig(lr=1e-3, weight_decay=0.0, pos_lr_scale=scale))
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        moved[scale] = {
            k: (v - before[k]).abs().sum().item() for k, v in m.state_dict().items() if v.is_floating_point()
        }
    for key, step in moved[1.0].items():
        expected = 0.1 * step if key.startswith("vispos.") else step
        assert moved[0.1][key] == pytest.approx(expected, rel=1e-3, abs=1e-9), key
    assert sum(v for k, v in moved[1.0].items() if k.startswith("vispos.")) > 0  # they moved at all


def test_the_settings_are_checked_and_enter_the_fingerprint_only_when_set() -> None:
    with pytest.raises(ConfigError, match=r"train.pos_lr_scale.*> 0"):
        config_from_dict({**BASE, "train": {"pos_lr_scale": 0.0}})
    with pytest.raises(ConfigError, match=r"train.pos_weight_decay.*>= 0"):
        config_from_dict({**BASE, "train": {"pos_weight_decay": -1.0}})
    cfg = config_from_dict(BASE)
    plain = fingerprint(cfg, cfg.schemes[0])["train"]
    assert "pos_lr_scale" not in plain and "pos_weight_decay" not in plain  # earlier runs keep their fingerprint
    scaled = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, pos_lr_scale=10.0))
    assert fingerprint(scaled, scaled.schemes[0])["train"]["pos_lr_scale"] == 10.0
