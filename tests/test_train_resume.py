"""Robustness: exact resume after a mid-epoch stop, atomic weights-only checkpoints, NaN guard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from train.config.sections import ConfigError
from train.engine.trainer import NonFiniteLossError, StopRequested
from train.experiment.run import run_experiment
from train.testing import tiny_config

# 200 images / batch 40 = 5 steps per epoch, 2 epochs; checkpoints every 2 steps and at epoch ends
SCHEMES = ["rope2d", {"name": "learned2d_drope", "pos": "learned2d", "drope": 0.3}]
MODEL = {"drop_path_rate": 0.1}  # randomness inside the step must also replay exactly


def _state(run: Path, scheme: str) -> dict:
    return torch.load(run / scheme / "checkpoint.pt", weights_only=True)


def test_resume_after_a_mid_epoch_stop_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    ref = run_experiment(tiny_config(tmp_path / "ref", schemes=SCHEMES, model=MODEL))
    cfg = tiny_config(tmp_path / "cut", schemes=SCHEMES, model=MODEL, debug={"stop_after_steps": 7})
    with pytest.raises(StopRequested):
        run_experiment(cfg)  # stops in epoch 2 at step 7; the last checkpoint is at step 6
    ck = _state(tmp_path / "cut", "rope2d")
    assert ck["position"] == {"epoch": 1, "step": 1, "global_step": 6} and not ck["finished"]
    assert len(ck["history"]) == 1 and ck["epoch_sums"][2] == 40.0
    got = run_experiment(tiny_config(tmp_path / "cut", schemes=SCHEMES, model=MODEL))
    for name in ("rope2d", "learned2d_drope"):
        assert got.schemes[name].accuracy == ref.schemes[name].accuracy
        a, b = _state(tmp_path / "ref", name), _state(tmp_path / "cut", name)
        assert a["model"].keys() == b["model"].keys()
        assert all(torch.equal(v, b["model"][k]) if torch.is_tensor(v) else v == b["model"][k]  # (extra state)
                   for k, v in a["model"].items())
        for ra, rb in zip(a["history"], b["history"], strict=True):
            assert (ra["train_loss"], ra["train_acc"], ra["val_acc"]) == (rb["train_loss"], rb["train_acc"],
                                                                          rb["val_acc"])
    # the second scheme was interrupted before it started, the first one resumed mid-epoch
    assert (tmp_path / "cut" / "rope2d" / "log.csv").read_text().count("\n") == 3


def test_checkpoint_is_weights_only_and_complete(tmp_path: Path) -> None:
    run_experiment(tiny_config(tmp_path, train={"epochs": 1}))
    ck = torch.load(tmp_path / "rope2d" / "checkpoint.pt", weights_only=True)
    assert {"model", "optimizer", "scheduler", "rng", "position", "config", "fingerprint"} <= set(ck)
    assert isinstance(ck["rng"]["torch"], torch.Tensor) and isinstance(ck["rng"]["python"], torch.Tensor)
    assert ck["finished"] and ck["position"]["global_step"] == 5 and ck["scheduler"]["last_epoch"] == 5
    assert not [p for p in (tmp_path / "rope2d").iterdir() if p.name.endswith(".tmp")]


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, debug={"nan_at_step": 5})
    with pytest.raises(NonFiniteLossError, match=r"loss became nan at epoch 2, step 0.*last good checkpoint is kept"):
        run_experiment(cfg)
    ck = _state(tmp_path, "rope2d")
    weights = [v for v in ck["model"].values() if torch.is_tensor(v)]
    assert ck["position"]["global_step"] == 5 and weights and all(torch.isfinite(v).all() for v in weights)
    assert not (tmp_path / "results.json").exists()
    # the kept checkpoint resumes once the cause is gone
    out = run_experiment(tiny_config(tmp_path))
    assert out.schemes["rope2d"].train is not None and out.schemes["rope2d"].train.epochs == 2


def test_changed_config_refuses_to_resume(tmp_path: Path) -> None:
    with pytest.raises(StopRequested):
        run_experiment(tiny_config(tmp_path, debug={"stop_after_steps": 3}))
    from train.config.sections import ConfigError

    with pytest.raises(ConfigError, match=r"different config \(differs in: train\.lr\)"):
        run_experiment(tiny_config(tmp_path, train={"lr": 1e-3}))
    fresh = run_experiment(tiny_config(tmp_path, train={"lr": 1e-3}, resume=False))
    assert json.loads((tmp_path / "results.json").read_text())["schemes"].keys() == fresh.schemes.keys()


def test_multires_resume_draws_the_sizes_of_an_uninterrupted_run(tmp_path: Path) -> None:
    sections = {"schemes": [{"name": "rope2d", "pos": "rope2d", "sizes": [16, 20, 28]}]}  # the entry's own sizes
    run_experiment(tiny_config(tmp_path / "ref", **sections))
    with pytest.raises(StopRequested):
        run_experiment(tiny_config(tmp_path / "cut", **sections, debug={"stop_after_steps": 7}))
    cut = _state(tmp_path / "cut", "rope2d")
    assert cut["position"]["global_step"] == 6 and len(cut["sizes_drawn"]) == 6  # saved with the position
    run_experiment(tiny_config(tmp_path / "cut", **sections))
    a, b = _state(tmp_path / "ref", "rope2d"), _state(tmp_path / "cut", "rope2d")
    assert b["sizes_drawn"] == a["sizes_drawn"] and len(a["sizes_drawn"]) == 10
    assert set(a["sizes_drawn"]) == {16, 20, 28} and b["sizes_drawn"][:6] == cut["sizes_drawn"]
    assert [r["sizes"] for r in a["history"]] == [r["sizes"] for r in b["history"]]
    assert all(torch.equal(v, b["model"][k]) for k, v in a["model"].items() if torch.is_tensor(v))


def test_a_run_folder_kept_without_its_checkpoints_skips_its_finished_entries(tmp_path: Path) -> None:
    """summary.json and eval.json (a few kB, committed with the results) are enough for a rerun to count an entry as
    finished; an entry is trained again only where its weights are needed: an evaluation the cache lacks, or an
    evaluation-only entry built on it."""
    schemes = ["rope2d", {"name": "rope2d+linear", "base": "rope2d", "scaling": "linear"}, "learned2d"]
    first = run_experiment(tiny_config(tmp_path, schemes=schemes))
    summary = json.loads((tmp_path / "rope2d" / "summary.json").read_text())
    assert summary["summary"]["curve"] == [list(c) for c in first.schemes["rope2d"].train.curve]
    # a rerun that loads the finished checkpoint writes the same summary, so a committed run folder stays unchanged
    kept = (tmp_path / "rope2d" / "summary.json").read_bytes()
    run_experiment(tiny_config(tmp_path, schemes=schemes))
    assert (tmp_path / "rope2d" / "summary.json").read_bytes() == kept
    for name in ("rope2d", "learned2d"):
        (tmp_path / name / "checkpoint.pt").unlink()
    again = run_experiment(tiny_config(tmp_path, schemes=schemes))
    assert not (tmp_path / "rope2d" / "checkpoint.pt").exists()  # nothing trained
    for name in ("rope2d", "rope2d+linear", "learned2d"):
        assert again.schemes[name].accuracy == first.schemes[name].accuracy
    assert again.schemes["rope2d"].train.history == first.schemes["rope2d"].train.history
    # the evaluation-only entry's cache gone: its base is trained again (the same run: the same weights)
    (tmp_path / "rope2d+linear" / "eval.json").unlink()
    third = run_experiment(tiny_config(tmp_path, schemes=schemes))
    assert (tmp_path / "rope2d" / "checkpoint.pt").exists() and not (tmp_path / "learned2d" / "checkpoint.pt").exists()
    assert third.schemes["rope2d+linear"].accuracy == first.schemes["rope2d+linear"].accuracy
    # other evaluation settings: the cache does not match, so the entry trains for the weights
    fourth = run_experiment(tiny_config(tmp_path, schemes=schemes, eval={"sizes": [20, 28]}))
    assert (tmp_path / "learned2d" / "checkpoint.pt").exists()
    assert fourth.schemes["learned2d"].accuracy["resize"][28] == first.schemes["learned2d"].accuracy["resize"][28]
    # a summary of another config is not taken for this one's
    with pytest.raises(ConfigError, match=r"summary of a training with a different config \(differs in: train\.lr\)"):
        (tmp_path / "learned2d" / "checkpoint.pt").unlink()
        run_experiment(tiny_config(tmp_path, schemes=["learned2d"], train={"lr": 1e-3}))
