"""EMA of the weights (train.ema, timm's ModelEmaV3): checkpointed, resumed exactly, and what a run evaluates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from train.config.sections import ConfigError
from train.engine import checkpoint as ckpt_io
from train.engine.trainer import StopRequested
from train.evaluate import main as evaluate_main
from train.experiment.run import run_experiment
from train.testing import tiny_config

# 200 images / batch 40 = 5 steps per epoch, 2 epochs; checkpoints every 2 steps and at epoch ends
SCHEMES = ["rope2d", {"name": "learned2d_drope", "pos": "learned2d", "drope": 0.3}]
MODEL = {"drop_path_rate": 0.1}
EMA = {"ema": True, "ema_decay": 0.9}  # low decay: the EMA moves visibly within 10 steps


def _state(run: Path, scheme: str) -> dict:
    return torch.load(run / scheme / "checkpoint.pt", weights_only=True)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(v, b[k]) for k, v in a.items())


def test_ema_run_resumes_exactly_after_a_kill(tmp_path: Path) -> None:
    ref = run_experiment(tiny_config(tmp_path / "ref", schemes=SCHEMES, model=MODEL, train=EMA))
    with pytest.raises(StopRequested):
        run_experiment(tiny_config(tmp_path / "cut", schemes=SCHEMES, model=MODEL, train=EMA,
                                   debug={"stop_after_steps": 7}))  # the last checkpoint is at step 6
    cut = _state(tmp_path / "cut", "rope2d")
    assert cut["position"]["global_step"] == 6 and cut["ema"] is not None
    got = run_experiment(tiny_config(tmp_path / "cut", schemes=SCHEMES, model=MODEL, train=EMA))
    for name in ("rope2d", "learned2d_drope"):
        a, b = _state(tmp_path / "ref", name), _state(tmp_path / "cut", name)
        assert _equal(a["model"], b["model"]) and _equal(a["ema"], b["ema"])  # bit for bit
        assert got.schemes[name].accuracy == ref.schemes[name].accuracy
        assert got.schemes[name].train is not None and got.schemes[name].train.weights == "ema"
        # the EMA is an average, not a copy of the last weights
        assert not all(torch.equal(v, a["ema"][k]) for k, v in a["model"].items() if v.is_floating_point())


def test_ema_follows_timms_warmup_formula(tmp_path: Path) -> None:
    """After update 1 the EMA is the weights; after update 2 it is d * ema + (1 - d) * weights with timm's
    warm-up decay d = 1 - (1 + 1) ** (-2/3) (ModelEmaV3 docstring), across a stop and resume in between."""
    sections = {"train": {**EMA, "checkpoint_every": 1}}
    with pytest.raises(StopRequested):
        run_experiment(tiny_config(tmp_path, **sections, debug={"stop_after_steps": 1}))
    one = _state(tmp_path, "rope2d")
    with pytest.raises(StopRequested):
        run_experiment(tiny_config(tmp_path, **sections, debug={"stop_after_steps": 2}))
    two = _state(tmp_path, "rope2d")
    assert (one["position"]["global_step"], two["position"]["global_step"]) == (1, 2)
    floats = [k for k, v in one["model"].items() if v.is_floating_point()]
    assert all(torch.equal(one["ema"][k], one["model"][k]) for k in floats)
    d = 1.0 - 2.0 ** (-2.0 / 3.0)
    for k in floats:
        torch.testing.assert_close(two["ema"][k], d * one["ema"][k] + (1 - d) * two["model"][k], rtol=1e-5, atol=1e-6)
    assert not all(torch.equal(two["ema"][k], two["model"][k]) for k in floats)


def test_evaluation_uses_the_ema_weights_and_says_so(tmp_path: Path) -> None:
    run = tmp_path / "run"
    results = run_experiment(tiny_config(run, schemes=SCHEMES, train={**EMA, "epochs": 1}))
    saved = json.loads((run / "results.json").read_text())
    assert {r["train"]["weights"] for r in saved["schemes"].values()} == {"ema"}
    assert "Evaluated weights: the EMA of the training weights (timm ModelEmaV3, decay 0.9, with its warm-up)" in (
        run / "results.md").read_text()
    out = tmp_path / "again.json"
    paths = [str(run / name / "checkpoint.pt") for name in ("rope2d", "learned2d_drope")]
    assert evaluate_main(["--checkpoint", *paths, "--sizes", "20", "28", "40", "--quiet", "--out", str(out)]) == 0
    again = json.loads(out.read_text())["accuracy"]
    for name in ("rope2d", "learned2d_drope"):  # the run's numbers are the EMA's: re-evaluating it reproduces them
        assert again[f"{name} (EMA)"] == results.to_json()["schemes"][name]["accuracy"]
    # evaluating the last step's weights instead gives other logits (the EMA is what the numbers are of)
    ck = _state(run, "rope2d")
    assert not all(torch.equal(v, ck["ema"][k]) for k, v in ck["model"].items() if v.is_floating_point())


def test_ema_settings_enter_the_fingerprint_only_when_on(tmp_path: Path) -> None:
    off, on = tiny_config(tmp_path), tiny_config(tmp_path, train=EMA)
    assert not [k for k in ckpt_io.fingerprint(off, off.schemes[0])["train"] if k.startswith("ema")]
    assert {"ema", "ema_decay", "ema_warmup"} <= set(ckpt_io.fingerprint(on, on.schemes[0])["train"])
    with pytest.raises(StopRequested):
        run_experiment(tiny_config(tmp_path, debug={"stop_after_steps": 3}))
    with pytest.raises(ConfigError, match=r"different config \(differs in: train\.ema, train\.ema_decay"):
        run_experiment(on)  # a checkpoint without an EMA is not resumed as one with it
    with pytest.raises(ConfigError, match=r"train\.ema_decay must be in \(0, 1\), got 1\.0"):
        tiny_config(tmp_path, train={"ema": True, "ema_decay": 1.0})
