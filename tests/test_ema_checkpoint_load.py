"""A trainer checkpoint of a run with ``train.ema`` loads through ``vispos.create_model`` as the weights the run
evaluated and reported (the EMA), and its last step's weights only when asked (``use_ema=False``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import vispos
from train.engine import checkpoint as ckpt_io
from train.engine.models import timm_kwargs
from train.experiment.loading import config_from_dict
from train.experiment.run import run_experiment
from train.testing import tiny_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    run = tmp_path_factory.mktemp("ema_run")
    results = run_experiment(tiny_config(run, train={"ema": True, "ema_decay": 0.9, "epochs": 1}), log=lambda m: None)
    assert results.schemes["rope2d"].train.weights == "ema"  # what the run's numbers describe
    path = run / "rope2d" / "checkpoint.pt"
    return path, ckpt_io.load(path)


def _kwargs(ck: dict) -> tuple[str, dict]:
    cfg = config_from_dict(ck["config"])
    kwargs = timm_kwargs(cfg.model, img_size=cfg.data.img_size, num_classes=len(ck["classes"]),
                         in_chans=int(ck["in_chans"]))  # fmt: skip
    return cfg.model.name, kwargs


def _floats(state: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point()}


def _same(a: dict, b: dict) -> bool:
    a, b = _floats(a), _floats(b)
    return a.keys() == b.keys() and all(torch.equal(v, b[k]) for k, v in a.items())


@pytest.mark.parametrize("how", ["checkpoint_path", "pretrained_cfg_overlay"])
def test_a_trainer_checkpoint_with_ema_loads_the_ema_weights(trained: tuple[Path, dict], how: str) -> None:
    path, ck = trained
    assert ck["ema"] is not None and not _same(ck["ema"], ck["model"])  # the two differ
    name, kwargs = _kwargs(ck)
    if how == "checkpoint_path":
        kwargs["checkpoint_path"] = str(path)
    else:
        kwargs |= dict(pretrained=True, pretrained_cfg_overlay=dict(file=str(path), num_classes=kwargs["num_classes"]))
    model = vispos.create_model(name, pos="rope2d", **kwargs)
    assert _same(model.state_dict(), ck["ema"])


def test_use_ema_false_loads_the_last_steps_weights(trained: tuple[Path, dict]) -> None:
    path, ck = trained
    name, kwargs = _kwargs(ck)
    model = vispos.create_model(name, pos="rope2d", use_ema=False, checkpoint_path=str(path), **kwargs)
    assert _same(model.state_dict(), ck["model"])
    with pytest.raises(TypeError, match="use_ema"):
        vispos.create_model(name, pos="rope2d", use_ema="no", checkpoint_path=str(path), **kwargs)


def test_a_checkpoint_without_ema_loads_its_weights(tmp_path: Path, trained: tuple[Path, dict]) -> None:
    path, ck = trained
    plain = tmp_path / "plain.pt"
    torch.save({**ck, "ema": None}, plain)  # a run without train.ema
    name, kwargs = _kwargs(ck)
    model = vispos.create_model(name, pos="rope2d", checkpoint_path=str(plain), **kwargs)
    assert _same(model.state_dict(), ck["model"])
