"""The convergence check: the validation curve (train.val_every), the plateau test on it, and the reports that
print its verdict per trained model."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from train import grid_report
from train.config.sections import ConfigError
from train.engine import checkpoint as ckpt_io
from train.engine.schedule import warmup_cosine, warmup_steps
from train.engine.trainer import StopRequested
from train.evaluation.convergence import Convergence, lr_window, plateau, rule_text, verdict_cell
from train.evaluation.report import write_outputs
from train.evaluation.results import RunResult, combine_seeds, lr_window_of_config
from train.experiment.run import run_experiment
from train.testing import tiny_config

# 200 images / batch 40 = 5 steps per epoch, 2 epochs: 10 steps; checkpoints every 2 steps and at epoch ends
MODEL = {"drop_path_rate": 0.1}  # randomness inside the step: validation between steps must not disturb it
CURVE_STEPS = [2, 4, 5, 6, 8, 10]  # val_every=2 and the epoch ends 5 and 10 (10 once)


def _state(run: Path) -> dict:
    return torch.load(run / "rope2d" / "checkpoint.pt", weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, RunResult, list[str]]]:
    """The same tiny training without and with validation every 2 steps (and each run's log lines)."""
    out = {}
    for name, every in (("plain", 0), ("every2", 2)):
        folder, lines = tmp_path_factory.mktemp(name), []
        result = run_experiment(tiny_config(folder, model=MODEL, train={"val_every": every, "log_every": 2}),
                                log=lines.append)
        out[name] = folder, result, lines
    return out


# -- the plateau test


def test_plateau_of_a_rising_curve_is_not_converged_with_its_gain() -> None:
    curve = [[step, step / 10] for step in range(10, 101, 10)]  # +1 point per 10 steps of 100
    verdict = plateau(curve, 100, within=0.5)
    # last fifth: steps 90, 100 (mean 9.5); the fifth before: 70, 80 (mean 7.5)
    # noise: differences of 1 within each fifth give one point's variance 1/2, the gain's sqrt(1/2 x (1/2 + 1/2))
    assert verdict == Convergence(gain=pytest.approx(2.0), last=pytest.approx(9.5), points=4, converged=False,
                                  noise=pytest.approx(math.sqrt(0.5)))
    assert plateau(curve, 100, within=2.01 - 2 * math.sqrt(0.5)).converged  # the bound: gain <= within + 2 noise
    assert not plateau(curve, 100, within=1.99 - 2 * math.sqrt(0.5)).converged


def test_plateau_allows_point_to_point_noise_but_not_a_trend_of_the_same_gain() -> None:
    """A model at chance on a small validation set jumps by a few images between points: its gain of 1 point
    is noise. A steady rise with the same gain between the two fifths is learning."""
    jumps = [24.0, 27.0, 23.0, 26.0, 25.0, 28.0, 24.0, 27.0]  # last four mean 26.0, the four before 25.0
    noisy = plateau([[61 + 5 * i, acc] for i, acc in enumerate(jumps)], 100, within=0.5)
    assert noisy is not None and noisy.gain == pytest.approx(1.0) and noisy.noise > 1.0 and noisy.converged
    rising = plateau([[61 + 5 * i, 24.0 + 2 * i / 7] for i in range(8)], 100, within=0.5)  # +2/7 per point
    assert rising is not None and rising.gain == pytest.approx(8 / 7) and not rising.converged


def test_plateau_of_a_flat_curve_is_converged() -> None:
    verdict = plateau([[step, 71.5] for step in range(5, 101, 5)], 100, within=0.5)
    assert verdict is not None and verdict.converged and verdict.gain == 0.0 and verdict.points == 8


def test_plateau_needs_a_point_in_each_of_the_last_two_fifths() -> None:
    assert plateau([[50, 60.0], [100, 70.0]], 100, within=0.5) is None  # nothing in (60, 80]
    assert plateau([[60, 60.0], [100, 70.0]], 100, within=0.5) is None  # 60 is not in (60, 80]
    assert plateau([[70, 60.0], [80, 70.0]], 100, within=0.5) is None  # nothing past 80
    assert plateau([], 100, within=0.5) is None and plateau([[80, 1.0], [100, 2.0]], None, within=0.5) is None


def test_plateau_flat_only_in_the_last_fifth_is_not_converged() -> None:
    """Still gaining in the fifth before and flat only once the learning rate is nearly gone: the rule compares
    the two fifths' means, so the gain made in the fifth before counts against the model."""
    curve = [[step, min(step, 80) / 2] for step in range(65, 101, 5)]  # rising to step 80, flat after
    verdict = plateau(curve, 100, within=0.5)
    assert verdict is not None and not verdict.converged
    assert verdict.gain == pytest.approx(40.0 - (32.5 + 35 + 37.5 + 40) / 4)
    # the same tail after a curve that was already flat in the fifth before is converged
    assert plateau([[step, 40.0] for step in range(65, 101, 5)], 100, within=0.5).converged


def test_verdict_cells_for_one_seed_and_several() -> None:
    yes, no = Convergence(0.24, 70.0, 4, True, 0.31), Convergence(3.06, 60.0, 4, False)
    assert verdict_cell([yes]) == "yes (+0.2 ± 0.3)" and verdict_cell([no]) == "no (+3.1 ± 0.0)"
    assert verdict_cell([None]) == "–"
    assert verdict_cell([yes, dataclasses.replace(yes, gain=0.4), no]) == "2/3 (+3.1 max)"
    assert verdict_cell([yes, None]) == "1/1 (+0.2 max; 1 not checked)" and verdict_cell([None, None]) == "–"


@pytest.mark.parametrize(("warmup", "floor"), [(0.1, 0.0), (0.0, 0.0), (0.25, 0.1)])
def test_lr_window_is_the_trainers_schedule_over_the_fifth_before_the_last(warmup: float, floor: float) -> None:
    total = 100_000  # steps as fine as fractions: the schedule itself, at 60 % and 80 % of the run
    w = warmup_steps(warmup, total)
    low, high = lr_window(warmup, floor)
    assert low == pytest.approx(warmup_cosine(int(0.8 * total), total, w, floor=floor), abs=1e-4)
    assert high == pytest.approx(warmup_cosine(int(0.6 * total), total, w, floor=floor), abs=1e-4)


def test_the_reports_rule_states_the_window_of_the_runs_schedule() -> None:
    assert "the learning rate is still 12-41 % of its peak" in rule_text(1.0, lr_window_of_config({}))
    assert "still 10-35 % of its peak" in rule_text(1.0, lr_window_of_config({"train": {"warmup": 0.0}}))
    half = lr_window_of_config({"train": {"warmup": 0.0, "lr": 1e-3, "min_lr": 5e-4}})
    assert "still 55-67 % of its peak" in rule_text(1.0, half)


# -- the curve in training


def test_val_every_records_the_curve_and_leaves_training_unchanged(runs) -> None:
    (plain_dir, plain, _), (every_dir, every, lines) = runs["plain"], runs["every2"]
    curve = every.schemes["rope2d"].train.curve
    assert [step for step, _ in curve] == CURVE_STEPS
    assert [step for step, _ in plain.schemes["rope2d"].train.curve] == [5, 10]  # the epoch ends only
    history = every.schemes["rope2d"].train.history
    assert [acc for step, acc in curve if step in (5, 10)] == [r["val_acc"] for r in history]
    assert "[rope2d] step 2/10: val acc" in "\n".join(lines)  # at the progress lines' pace (log_every)
    # validation between steps changes nothing the training computes
    assert [r["train_loss"] for r in history] == [r["train_loss"] for r in plain.schemes["rope2d"].train.history]
    a, b = _state(plain_dir)["model"], _state(every_dir)["model"]
    assert all(torch.equal(v, b[k]) for k, v in a.items() if torch.is_tensor(v))
    assert every.schemes["rope2d"].accuracy == plain.schemes["rope2d"].accuracy
    assert _state(every_dir)["curve"] == curve and every.schemes["rope2d"].train.total_steps == 10


def test_val_every_without_epoch_end_validation(tmp_path: Path) -> None:
    """train.val_every_epoch=false: only the steps on the val_every grid validate (an epoch end among them)."""
    cfg = tiny_config(tmp_path, train={"val_every_epoch": False, "val_every": 2, "epochs": 2})
    train = run_experiment(cfg, log=lambda msg: None).schemes["rope2d"].train
    assert [step for step, _ in train.curve] == [2, 4, 6, 8, 10]
    assert [r["val_acc"] for r in train.history] == [None, train.curve[-1][1]]  # epoch 1 ends at step 5


def test_validation_leaves_every_rng_as_it_found_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step reseeds the RNGs, so this is stricter than training needs: an evaluation that draws random
    numbers (torch, numpy, Python) leaves the state each step starts from as it is without validation."""
    import hashlib
    import random

    import numpy as np

    from train.engine import trainer

    def noisy_top1(*args, **kwargs):
        torch.rand(3), np.random.rand(3), random.random()
        return real_top1(*args, **kwargs)

    def recording_step(self, *args, **kwargs):
        state = (torch.get_rng_state().numpy().tobytes(), np.random.get_state()[1].tobytes(),
                 repr(random.getstate()).encode())
        starts.append(hashlib.sha256(b"".join(state)).hexdigest())
        return real_step(self, *args, **kwargs)

    real_top1, real_step = trainer.top1, trainer.SchemeTrainer._step
    monkeypatch.setattr(trainer, "top1", noisy_top1)
    monkeypatch.setattr(trainer.SchemeTrainer, "_step", recording_step)
    seen = {}
    for every in (0, 2):
        starts: list[str] = []
        run_experiment(tiny_config(tmp_path / str(every), train={"epochs": 1, "val_every": every}),
                       log=lambda msg: None)
        seen[every] = starts
    # the first step starts from whatever ran before training; each later one from the step before it
    assert len(seen[0]) == 5 and seen[2][1:] == seen[0][1:]


def test_resumed_run_keeps_its_curve(runs, tmp_path: Path) -> None:
    sections = {"model": MODEL, "train": {"val_every": 2}}
    with pytest.raises(StopRequested):
        run_experiment(tiny_config(tmp_path, **sections, debug={"stop_after_steps": 7}), log=lambda msg: None)
    assert [step for step, _ in _state(tmp_path)["curve"]] == [2, 4, 5, 6]  # the checkpoint at step 6
    # resumed under another val_every and tolerance: neither changes the weights, so the checkpoint is accepted
    got = run_experiment(tiny_config(tmp_path, model=MODEL, train={"val_every": 4, "converged_within": 2.0}),
                         log=lambda msg: None)
    assert [step for step, _ in got.schemes["rope2d"].train.curve] == [2, 4, 5, 6, 8, 10]
    ref = runs["every2"][1].schemes["rope2d"].train.curve
    assert got.schemes["rope2d"].train.curve == ref  # the same points as the uninterrupted run's


def test_val_every_and_the_tolerance_stay_out_of_the_fingerprint(tmp_path: Path) -> None:
    a = tiny_config(tmp_path)
    b = tiny_config(tmp_path, train={"val_every": 3, "converged_within": 1.5})
    assert ckpt_io.fingerprint(a, a.schemes[0]) == ckpt_io.fingerprint(b, b.schemes[0])


def test_a_checkpoint_without_a_curve_gives_its_epoch_ends(runs, tmp_path: Path) -> None:
    folder = tmp_path / "old"
    (folder / "rope2d").mkdir(parents=True)
    ck = _state(runs["every2"][0])
    del ck["curve"]
    torch.save(ck, folder / "rope2d" / "checkpoint.pt")
    got = run_experiment(tiny_config(folder, model=MODEL, train={"val_every": 2}), log=lambda msg: None)
    history = got.schemes["rope2d"].train.history
    assert got.schemes["rope2d"].train.curve == [[r["step"], r["val_acc"]] for r in history]


# -- the reports


def test_trainer_log_prints_the_verdict(runs) -> None:
    every, plain = runs["every2"][1].schemes["rope2d"].train, runs["plain"][2]
    verdict = plateau(every.curve, 10, 0.5)
    assert verdict is not None
    word = "yes" if verdict.converged else "no"
    assert (f"[rope2d] converged: {word} (gain {verdict.gain:+.1f} ± {verdict.noise:.1f} points over the last fifth)"
            in runs["every2"][2])
    assert "[rope2d] converged: not checked: validate more often (train.val_every)" in plain


def test_results_md_has_the_convergence_column(runs) -> None:
    (every_dir, every, _), (plain_dir, _, _) = runs["every2"], runs["plain"]
    verdict = every.schemes["rope2d"].train.convergence(0.5)
    assert verdict is not None and verdict.points == 2  # step 8 before, step 10 in the last fifth
    md = (every_dir / "results.md").read_text()
    assert "| val acc (train size) | converged (gain over the last fifth ± noise) |" in md
    row = next(line for line in md.splitlines() if line.startswith("| rope2d |") and "converged" not in line
               and line.count("|") == 7)
    assert row.endswith(f" | {'yes' if verdict.converged else 'no'} ({verdict.gain:+.1f} ± {verdict.noise:.1f}) |")
    assert "gains at most 0.5 points (train.converged_within)" in md and "not checked" not in md
    plain_md = (plain_dir / "results.md").read_text()
    assert " | – |\n" in plain_md and "–: not checked: validate more often (train.val_every)" in plain_md


def test_results_json_round_trips_with_the_curve_and_older_files_load(runs) -> None:
    every_dir, every, _ = runs["every2"]
    saved = json.loads((every_dir / "results.json").read_text())
    assert [p[0] for p in saved["schemes"]["rope2d"]["train"]["curve"]] == CURVE_STEPS
    assert RunResult.from_json(saved) == every
    old = copy.deepcopy(saved)  # as written before the curve: no curve, total_steps or convergence keys
    for key in ("curve", "total_steps"):
        del old["schemes"]["rope2d"]["train"][key]
    del old["config"]["train"]["val_every"], old["config"]["train"]["converged_within"]
    loaded = RunResult.from_json(old)
    assert loaded.schemes["rope2d"].train.curve == [] and loaded.schemes["rope2d"].train.convergence(0.5) is None


def test_several_seeds_count_the_converged_ones(runs, tmp_path: Path) -> None:
    _, every, _ = runs["every2"]
    slow = copy.deepcopy(every)
    train = slow.schemes["rope2d"].train
    train.curve = [[8, 10.0], [10, 20.0]]  # a seed that gained 10 points over the last fifth
    both = combine_seeds({0: every, 1: slow}, name="two", config=every.config, command=None, wall_seconds=1.0)
    gains = [every.schemes["rope2d"].train.convergence(0.5).gain, 10.0]
    assert both.schemes["rope2d"].per_seed[1].convergence == {"gain": 10.0, "last": 20.0, "points": 2,
                                                              "converged": False, "noise": 0.0}
    assert RunResult.from_json(json.loads(json.dumps(both.to_json()))) == both
    old = both.to_json()
    for seed in old["schemes"]["rope2d"]["per_seed"].values():
        del seed["convergence"]
    assert RunResult.from_json(old).schemes["rope2d"].per_seed[0].convergence is None
    write_outputs(both, tmp_path)
    converged = int(every.schemes["rope2d"].train.convergence(0.5).converged)
    assert f"| {converged}/2 ({max(gains):+.1f} max) |" in (tmp_path / "results.md").read_text()


def test_grid_report_prints_a_convergence_section(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, data={"dataset": "grid_lookup", "img_size": 32, "train_per_class": 10,
                                      "val_per_class": 3},
                      eval={"sizes": [32, 48], "batch_size": 7, "protocols": ["resize", "canvas"]},
                      train={"batch_size": 8, "val_every": 2, "checkpoint_every": 0})  # 5 steps an epoch
    result = run_experiment(cfg, log=lambda msg: None)
    verdict = result.schemes["rope2d"].train.convergence(0.5)
    assert verdict is not None
    md = grid_report.format_report({"grid_lookup": result}, "python -m train.grid_report", 1.0)
    section = md.split("## convergence")[1].split("\n## ")[0]
    cell = f"{'yes' if verdict.converged else 'no'} ({verdict.gain:+.1f} ± {verdict.noise:.1f})"
    assert f"| grid_lookup | rope2d | {cell} | " in section
    assert "gains at most 0.5 points (train.converged_within) plus twice the gain's standard error" in section
    # learnt: above chance (25 %) by three standard errors of chance on the 12 images, 25 + 37.5 points
    for acc, word in ((62.4, "no"), (62.6, "yes")):
        result.schemes["rope2d"].accuracy["resize"][32] = acc
        md = grid_report.format_report({"grid_lookup": result}, "python -m train.grid_report", 1.0)
        assert f"| {cell} | {word} ({acc:.1f}) |" in md


# -- the settings


def test_val_every_and_converged_within_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"train\.val_every must be >= 0"):
        tiny_config(tmp_path, train={"val_every": -1})
    for bad in (0.0, -1.0):
        with pytest.raises(ConfigError, match=r"train\.converged_within must be > 0"):
            tiny_config(tmp_path, train={"converged_within": bad})
