"""What the trainer and the sequence benchmark share: the schedule, the seed rule, scheme entries."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch
from timm.scheduler import CosineLRScheduler

import vispos
from benchmarks.seq1d.config import config_from_dict as seq1d_config
from benchmarks.seq1d.runner import lr_at, seed_for
from train.config.sections import ConfigError, SchemeConfig, TrainConfig
from train.engine.optim import make_optimizer, make_scheduler
from train.engine.schedule import warmup_cosine, warmup_steps
from train.experiment.loading import config_from_dict
from train.runtime.seeds import generator, mix_seed, seeded

BASE = {"name": "t", "schemes": ["rope2d"], "eval": {"sizes": [28, 56]}, "model": {"patch_size": 4}}


def previous_trainer_factor(step: int, total: int, warmup: float, min_ratio: float) -> float:
    """train/engine.py's lr_factor before the schedule was shared, verbatim."""
    w = int(round(warmup * total))
    if step < w:
        return (step + 1) / w
    t = (step - w) / max(1, total - w)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(t, 1.0)))


def previous_seq1d_lr(step: int, lr: float, steps: int, warmup: float, start: int = 0) -> float:
    """benchmarks/seq1d/runner.py's lr_at before the schedule was shared (one segment), verbatim."""
    warm = max(1, round(warmup * steps))
    step -= start
    if step < warm:
        return lr * (step + 1) / warm
    return 0.5 * lr * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


@pytest.mark.parametrize(("total", "warmup", "min_lr"),
                         [(234, 0.1, 0.0), (50, 0.0, 0.0), (97, 0.05, 1e-5), (7, 0.3, 0.0)])
def test_trainer_schedule_equals_the_previous_formula_at_every_step(total: int, warmup: float, min_lr: float) -> None:
    cfg = TrainConfig(lr=2e-3, min_lr=min_lr, warmup=warmup)
    model = torch.nn.Linear(3, 2)
    opt = make_optimizer(model, cfg)
    sched = make_scheduler(opt, cfg, total)
    for step in range(total):
        want = 2e-3 * previous_trainer_factor(step, total, warmup, min_lr / 2e-3)
        assert [g["lr"] for g in opt.param_groups] == [want] * len(opt.param_groups), step
        opt.step()
        sched.step()


def test_seq1d_schedule_equals_the_previous_formula_with_and_without_the_drope_restart() -> None:
    cfg = seq1d_config({"name": "t", "schemes": ["rope"], "train": {"steps": 60, "lr": 3e-3, "warmup": 0.1}})
    f32 = np.float32
    for drop_at in (None, 40):
        for step in range(60):
            start, steps = (40, 20) if drop_at is not None and step >= 40 else (0, 60)
            new, old = lr_at(step, cfg, drop_at), previous_seq1d_lr(step, 3e-3, steps, 0.1, start=start)
            # the cosine's argument is rounded in another order: the last bits of a double may differ,
            # and never what AdamW applies in float32 (the step size lr / (1 - beta1^t), the decay 1 - lr * wd)
            assert new == pytest.approx(old, rel=1e-13, abs=0.0)
            bias = 1 - 0.9 ** (step + 1)
            assert f32(new / bias) == f32(old / bias) and f32(1 - new * 0.01) == f32(1 - old * 0.01)
    assert lr_at(40, cfg, drop_at=40) == pytest.approx(3e-3 / 2)  # the restart begins with a fresh warm-up


def test_schedule_cosine_phase_is_timms_and_only_the_warm_up_differs() -> None:
    total, w, peak, floor = 120, warmup_steps(0.1, 120), 1.0, 0.1
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    timm_sched = CosineLRScheduler(opt, t_initial=total - w, lr_min=floor, warmup_t=w, warmup_prefix=True,
                                   t_in_epochs=False)
    timm_lrs = []
    for step in range(total):
        timm_sched.step_update(step)
        timm_lrs.append(opt.param_groups[0]["lr"])
    ours = [warmup_cosine(step, total, w, peak=peak, floor=floor) for step in range(total)]
    assert ours[w:] == pytest.approx(timm_lrs[w:], rel=1e-12, abs=1e-15)
    # timm's linear warm-up starts at warmup_lr_init and ends one step short of the peak; ours reaches it
    assert ours[w - 1] == peak and timm_lrs[w - 1] < peak


def test_one_seed_rule_reproduces_every_previous_mixing() -> None:
    # train/data/loaders.py's generator keys, the folder dataset's epoch seed and sample seed, seq1d's seed_for
    old_fold = 0
    for key in (3, 5, 11):
        old_fold = (old_fold * 1_000_003 + key) % (2**62)
    assert mix_seed(3, 5, 11) == old_fold
    assert mix_seed(7, 2, modulus=2**31) == (7 * 1_000_003 + 2) % (2**31)
    assert mix_seed(123, 45) == 123 * 1_000_003 + 45
    cfg = seq1d_config({"name": "t", "seed": 4, "schemes": ["rope"]})
    assert seed_for(cfg, "passkey", "train") == (4 * 1_000_003 + zlib.crc32(b"passkey/train")) % (2**63)
    assert torch.equal(torch.rand(4, generator=generator(1, 2)), torch.rand(4, generator=generator(1, 2)))
    assert not torch.equal(torch.rand(4, generator=generator(1, 2)), torch.rand(4, generator=generator(1, 3)))


def test_seeded_block_draws_from_its_seed_and_restores_the_global_rngs() -> None:
    import random

    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    with seeded(42):
        first = (torch.rand(1).item(), random.random(), np.random.rand())
    after = (torch.rand(1).item(), random.random(), np.random.rand())
    with seeded(42):
        again = (torch.rand(1).item(), random.random(), np.random.rand())
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    assert first == again and after == (torch.rand(1).item(), random.random(), np.random.rand())


# ---------------------------------------------------------------------------------------------------
# scheme entries: shorthand sugar and one list of scaling names


def test_shorthand_is_sugar_for_the_explicit_entry() -> None:
    short = config_from_dict({**BASE, "schemes": ["rope2d", "rope2d+yarn+logn", "learned2d+rope2d"]})
    explicit = config_from_dict({**BASE, "schemes": [
        {"name": "rope2d", "pos": "rope2d"},
        {"name": "rope2d+yarn+logn", "base": "rope2d", "scaling": "yarn", "log_n_attention": True},
        {"name": "learned2d+rope2d", "pos": ["learned2d", "rope2d"]},
    ]})
    assert short.schemes == explicit.schemes
    assert short.schemes[1] == SchemeConfig(name="rope2d+yarn+logn", base="rope2d", scaling="yarn",
                                            log_n_attention=True)
    with pytest.raises(ConfigError, match="sets scaling twice"):
        config_from_dict({**BASE, "schemes": ["rope2d", "rope2d+ntk+yarn"]})


def test_scaling_names_come_from_vispos() -> None:
    schemes = ["rope2d", *(f"rope2d+{s}" for s in vispos.SCALING_TYPES if s != "longrope")]
    cfg = config_from_dict({**BASE, "schemes": schemes})
    assert [s.scaling for s in cfg.schemes[1:]] == [s for s in vispos.SCALING_TYPES if s != "longrope"]
    with pytest.raises(ConfigError, match="scaling 'stretch' is not accepted; accepted: " +
                       ", ".join(vispos.SCALING_TYPES)):
        config_from_dict({**BASE, "schemes": ["rope2d", {"name": "v", "base": "rope2d", "scaling": "stretch"}]})
    # longrope has no search in 2D: its factors must be given, and the config says so when it loads
    with pytest.raises(ConfigError, match=r"schemes\[rope2d\+longrope\]: scaling: .*long_factors"):
        config_from_dict({**BASE, "schemes": ["rope2d", "rope2d+longrope"]})
    def longrope(n: int) -> list:
        return ["rope2d", {"name": "lr", "base": "rope2d", "scaling": "longrope",
                           "scaling_options": {"long_factors": [1.0 + i for i in range(n)]}}]

    # the factor count is checked against the model's frequencies when the config loads (head dim 64,
    # half of it per axis: 16 frequencies), not when the entry is evaluated after training
    with pytest.raises(ConfigError, match=r"schemes\[lr\]: .*one entry per rotary frequency .*16.*got 2"):
        config_from_dict({**BASE, "schemes": longrope(2)})
    config_from_dict({**BASE, "schemes": longrope(16)})
    with pytest.raises(ConfigError, match=r"scaling_options given without scaling"):
        config_from_dict({**BASE, "schemes": ["rope2d", {"name": "v", "base": "rope2d",
                                                         "scaling_options": {"factor": 2.0}}]})
