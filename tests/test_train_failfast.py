"""Bad input fails before training, in one `error:` line; Ctrl-C says how to resume; progress reaches a log file;
`train.evaluate` evaluates what it can and names what failed."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import train
from train.__main__ import main as train_main
from train.config.sections import ConfigError
from train.engine.trainer import SchemeTrainer
from train.evaluate import main as evaluate_main
from train.experiment.loading import config_from_dict
from train.experiment.run import run_experiment
from train.testing import TINY, _merge, tiny_config

ROOT = Path(train.__file__).resolve().parents[1]


def write_config(tmp_path: Path, **sections: Any) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_merge(TINY, {"out_dir": str(tmp_path / "run"), **sections})))
    return path


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


# ---------------------------------------------------------------------------------------------------
# 1. every config error when the config is read


def scaled(pos: str) -> list[Any]:
    return [pos, {"name": f"{pos}+yarn", "base": pos, "scaling": "yarn"}]


READ_TIME_ERRORS = [
    # a scaling on an entry without RoPE (trained or evaluation-only): the registry's scalable flag
    ({"schemes": [{"name": "r", "pos": "relbias2d", "scaling": "yarn"}]},
     r"schemes\[r\]: scaling 'yarn' .*relbias2d has none to stretch \(scalable: rope2d"),
    ({"schemes": scaled("relbias2d")}, r"schemes\[relbias2d\+yarn\]: scaling 'yarn' .*relbias2d has none"),
    ({"schemes": scaled("timm")}, r"timm has none to stretch"),
    ({"schemes": ["alibi2d", {"name": "a+logn", "base": "alibi2d", "log_n_attention": True}, "timm",
                  {"name": "t+logn", "base": "timm", "log_n_attention": True}]},
     r"schemes\[t\+logn\]: vispos.configure failed: no vispos positional scheme"),
    # options the scheme does not accept: the registry's option list
    ({"schemes": [{"name": "r", "pos": "rope2d", "options": {"thetaa": 10.0}}]},
     r"schemes\[r\]: option\(s\) thetaa not accepted by rope2d; accepted: .*theta"),
    ({"schemes": [{"name": "a", "pos": "alibi2d", "options": {"theta": 10.0}}]},
     r"option\(s\) theta not accepted by alibi2d; accepted: inherit"),
    # values the scheme refuses (found by building the model on the meta device)
    ({"schemes": [{"name": "r", "pos": "rope2d", "options": {"layout": "diagonal"}}]},
     r"schemes\[r\]: vispos.patch failed: .*diagonal"),
    ({"train": {"lr": -1}}, r"train\.lr must be > 0, got -1"),
    ({"train": {"min_lr": 1.0}}, r"train\.min_lr must be in \[0, train\.lr=0\.002\]"),
    ({"train": {"weight_decay": -0.1}}, r"train\.weight_decay must be >= 0"),
    ({"train": {"grad_clip": 0.0}}, r"train\.grad_clip must be > 0, or null"),
    ({"train": {"label_smoothing": 1.0}}, r"train\.label_smoothing must be in \[0, 1\)"),
    ({"train": {"mixup": 0.8, "batch_size": 41}}, r"train\.batch_size must be even with mixup"),
    ({"train": {"log_every": -1}}, r"train\.log_every must be >= 0"),
    ({"data": {"img_size": 30}}, r"data\.img_size=30 must be a multiple of the patch size 4 .* e\.g\. 28"),
    ({"data": {"img_size": 2}}, r"data\.img_size=2 must be a multiple of the patch size 4"),
    ({"data": {"crop_pct": 0.0}}, r"data\.crop_pct must be in \(0, 1\]"),
    ({"data": {"mean": [0.5, 0.5, 0.5], "std": [0.2, 0.2, 0.2]}}, r"fashion_mnist images have 1 channel"),
    ({"data": {"mean": [0.5], "std": [0.0]}}, r"data\.std must be > 0"),
    ({"data": {"classes": ["Trouser", "Sock"]}}, r"data: unknown class\(es\) Sock; available: T-shirt/top"),
    ({"data": {"num_classes": 11}}, r"data\.num_classes=11 but only 10 classes"),
    ({"data": {"dataset": "folder", "root": "/nonexistent", "auto_augment": "rand-x9"}},
     r"data\.auto_augment 'rand-x9' is not a timm augmentation string"),
    ({"finetune": {"size": 30}}, r"finetune\.size=30 must be a multiple of the patch size 4, e\.g\. 28 or 32"),
    ({"finetune": {"size": 32, "lr": 0.0}}, r"finetune\.lr must be > 0"),
    ({"eval": {"sizes": [28, 30]}}, r"eval sizes \[30\] are not positive multiples of the patch size 4"),
    ({"eval": {"canvas_fill": 2.0}}, r"eval\.canvas_fill must be in \[0, 1\]"),
    ({"train": {"sizes": [16, 18]}}, r"train\.sizes \[18\] are not multiples of the patch size 4"),
    ({"model": {"num_heads": 3}}, r"model: timm\.create_model\(.*failed: dim should be divisible by num_heads"),
    ({"model": {"name": "vit_nonexistent"}}, r"model: timm\.create_model\('vit_nonexistent'.*Unknown model"),
    ({"model": {"drop_path_rate": 1.5}}, r"model\.drop_path_rate must be in \[0, 1\)"),
    ({"model": {"depth": 0}}, r"model\.depth must be >= 1"),
    ({"threads": 0}, r"threads must be >= 1"),
    ({"debug": {"stop_after_steps": 0}}, r"debug\.stop_after_steps must be >= 1"),
    # timm rates through model.kwargs (timm's PatchDropout asserts without a message)
    ({"model": {"kwargs": {"patch_drop_rate": 1.5}}},
     r"model\.kwargs\.patch_drop_rate must be a number in \[0, 1\), got 1\.5"),
    ({"model": {"kwargs": {"attn_drop_rate": -0.1}}}, r"model\.kwargs\.attn_drop_rate must be a number in \[0, 1\)"),
    # a grid task drawn at an evaluation grid its rule cannot draw (canvas protocol), or trained on one
    ({"data": {"dataset": "grid_lookup", "img_size": 32}, "eval": {"sizes": [12, 32]}},
     r"eval size 12 px .*grid_lookup needs a grid larger than its offsets \[\(2, 2\), \(-1, 3\)\]: at least 4 x 4 "
     r"cells \(16 px\), got 12 px \(3 x 3 cells\)"),
    ({"data": {"dataset": "grid_lookup_shuffled", "img_size": 32}, "eval": {"sizes": None, "scales": [0.25, 1]}},
     r"eval size 8 px .*grid_lookup_shuffled needs a grid larger than its offsets"),
    ({"data": {"dataset": "grid_direction", "img_size": 32}, "eval": {"sizes": [4]}},
     r"eval size 4 px .*grid_direction needs two distinct cells .*got 4 px \(1 x 1 cells\)"),
    ({"data": {"dataset": "grid_placement", "img_size": 32}, "eval": {"sizes": [12]}},
     r"grid_placement needs one cell per region \(4 per axis\): at least 4 x 4 cells"),
    ({"data": {"dataset": "grid_count", "img_size": 8}}, r"data\.img_size: grid_count needs a marker's 8 neighbours"),
    ({"data": {"dataset": "grid_count", "img_size": 24}, "eval": {"sizes": [24, 30]}, "model": {"patch_size": 6}},
     r"eval size 30 px .*grid tasks draw 4 px cells, so image sizes are positive multiples of 4 px, got 30"),
]


@pytest.mark.parametrize(("sections", "match"), READ_TIME_ERRORS)
def test_config_errors_are_found_when_the_config_is_read(sections: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        config_from_dict(_merge(TINY, sections))


def test_a_grid_task_evaluated_by_resizing_only_may_go_below_its_grid() -> None:
    """The resize protocol resizes the training images (nothing drawn at the evaluation grid)."""
    cfg = config_from_dict(_merge(TINY, {"data": {"dataset": "grid_lookup", "img_size": 32},
                                         "eval": {"sizes": [12, 32], "protocols": ["resize"]}}))
    assert cfg.eval.sizes == [12, 32]


def test_reading_a_config_leaves_the_global_rng_alone() -> None:
    before = torch.get_rng_state()
    config_from_dict(_merge(TINY, {"schemes": ["learned2d", "rope2d", "rope2d+yarn", "relbias2d"]}))
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize(("override", "match"), [
    ("train.lr=-1", r"train\.lr must be > 0"),
    ("data.img_size=30", r"data\.img_size=30 must be a multiple of the patch size 4"),
    ("finetune.size=30", r"finetune\.size=30 must be a multiple of the patch size 4"),
    ("eval.sizes=[28,", r"override 'eval\.sizes=\[28,': '\[28,' is not a YAML value .*expected list of int"),
    ("schemes=[relbias2d,relbias2d+yarn]", r"relbias2d has none to stretch"),
    ("=3", r"override '=3': no key before '='"),
])
def test_cli_config_errors_are_one_line_and_exit_2_before_training(override: str, match: str, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    assert train_main(["--config", str(write_config(tmp_path)), override]) == 2
    captured = capsys.readouterr()
    line = one_error_line(captured.err)
    assert re.search(match, line), line
    assert not (tmp_path / "run").exists()  # nothing was trained, not even the run folder made


def test_cli_names_what_it_expects_for_a_folder_or_missing_config(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    assert train_main(["--config", str(tmp_path)]) == 2
    assert "is a folder; give a YAML file" in one_error_line(capsys.readouterr().err)
    assert train_main(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in one_error_line(capsys.readouterr().err)


def test_a_batch_larger_than_the_data_fails_before_any_scheme_trains(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    # 200 training images: the fine-tune batch cannot be 400, and that is known before the first scheme trains
    path = write_config(tmp_path, schemes=["rope2d", "nope"], finetune={"size": 32, "batch_size": 400})
    assert train_main(["--config", str(path)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "batch size 400 (train.batch_size / finetune.batch_size) is larger than the 200 training images" in line
    assert not (tmp_path / "run" / "rope2d" / "checkpoint.pt").exists()


# ---------------------------------------------------------------------------------------------------
# 2. train.evaluate: bad input named, every checkpoint it can evaluated


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run")
    run_experiment(tiny_config(out, schemes=["learned2d", "rope2d"], train={"epochs": 1, "checkpoint_every": 0}))
    return out


def evaluate(*args: str) -> int:
    return evaluate_main(["--sizes", "28", "40", "--protocols", "resize", "--quiet", *args])


def test_evaluate_writes_what_it_could_and_names_what_failed(trained: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "acc.json"
    learned, rope = trained / "learned2d" / "checkpoint.pt", trained / "rope2d" / "checkpoint.pt"
    assert evaluate("--checkpoint", str(learned), str(rope), "--scaling", "yarn", "--out", str(out)) == 2
    captured = capsys.readouterr()
    assert "| rope2d+yarn |" in captured.out  # the one that could be evaluated is printed and written
    saved = json.loads(out.read_text())
    assert list(saved["accuracy"]) == ["rope2d+yarn"] and set(saved["accuracy"]["rope2d+yarn"]["resize"]) == {
        "28", "40"}
    assert list(saved["failed"]) == [str(learned)] and "learned2d has none to stretch" in saved["failed"][str(learned)]
    assert "Traceback" not in captured.err
    assert f"error: 1 of 2 checkpoint(s) not evaluated: {learned}" in captured.err


def test_evaluate_accepts_scheme_and_run_folders(trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "acc.json"
    assert evaluate("--checkpoint", str(trained / "rope2d"), "--out", str(out)) == 0
    one = json.loads(out.read_text())["accuracy"]
    assert evaluate("--checkpoint", str(trained), "--out", str(out)) == 0
    both = json.loads(out.read_text())["accuracy"]
    assert list(both) == ["learned2d", "rope2d"] and both["rope2d"] == one["rope2d"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert evaluate("--checkpoint", str(empty)) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: {empty} is a folder without checkpoint.pt (nor scheme folders holding one); give a "
                   "checkpoint file, a scheme folder (runs/NAME/SCHEME) or a run folder (runs/NAME)",
                   f"error: 1 of 1 checkpoint(s) not evaluated: {empty}"]


@pytest.mark.parametrize("case", ["missing", "no_config", "directory_file"])
def test_evaluate_names_a_bad_checkpoint(case: str, trained: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "ck.pt"
    expected = f"checkpoint {path} does not exist"
    if case == "no_config":
        ck = torch.load(trained / "rope2d" / "checkpoint.pt", weights_only=True)
        del ck["config"]
        torch.save(ck, path)
        expected = f"{path} has no config entry"
    elif case == "directory_file":  # a folder named like a file
        path.mkdir()
        expected = f"{path} is a folder without checkpoint.pt"
    assert evaluate("--checkpoint", str(path)) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err and "KeyError" not in err


def test_evaluate_warns_about_non_finite_weights(trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ck = torch.load(trained / "rope2d" / "checkpoint.pt", weights_only=True)
    ck["model"]["head.weight"][0, 0] = float("nan")
    path = tmp_path / "nan.pt"
    torch.save(ck, path)
    assert evaluate("--checkpoint", str(path)) == 0
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]
    assert warnings == [f"warning: {path} holds non-finite weights (1 tensors, e.g. head.weight); "
                        "its accuracies are not meaningful"]
    assert evaluate("--checkpoint", str(trained / "rope2d" / "checkpoint.pt")) == 0
    assert "warning" not in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# 3. Ctrl-C


def test_ctrl_c_exits_130_with_the_resume_command_and_an_intact_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_config(tmp_path)  # 5 steps per epoch, checkpoints every 2 steps
    step = SchemeTrainer._step

    def interrupted(self: SchemeTrainer, forward: Any, mixup: Any, batch: Any, epoch: int) -> None:
        if epoch * self.steps + batch.step == 7:
            raise KeyboardInterrupt
        step(self, forward, mixup, batch, epoch)

    monkeypatch.setattr(SchemeTrainer, "_step", interrupted)
    assert train_main(["--config", str(path), "resume=false", "train.lr=0.002"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == (f"interrupted: the last checkpoint is kept; resume with: python -m train --config {path} "
                           "train.lr=0.002 resume=true")
    ck = torch.load(tmp_path / "run" / "rope2d" / "checkpoint.pt", weights_only=True)
    assert ck["position"]["global_step"] == 6 and not ck["finished"]
    monkeypatch.setattr(SchemeTrainer, "_step", step)
    command = shlex.split(err.split("resume with: ")[1])
    assert command[:4] == ["python", "-m", "train", "--config"]
    assert train_main(command[3:]) == 0
    assert "resuming from" in capsys.readouterr().out
    done = torch.load(tmp_path / "run" / "rope2d" / "checkpoint.pt", weights_only=True)
    assert done["finished"] and done["position"]["global_step"] == 10


def _sigint_as_at_a_terminal() -> None:
    """In the child before exec: SIGINT at its default, so Python raises KeyboardInterrupt on it even when the
    suite itself runs in a background job (where the shell hands every child SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def interruptible():
    """SIGINT raises KeyboardInterrupt in this process for the test's duration, whatever it inherited."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_sigint_in_a_real_process(tmp_path: Path) -> None:
    """The signal itself, wherever it lands (a step, a save, the loader): exit 130, one line, a loadable checkpoint."""
    path = write_config(tmp_path, train={"epochs": 200, "checkpoint_every": 1, "val_every_epoch": False})
    ck_path = tmp_path / "run" / "rope2d" / "checkpoint.pt"
    proc = subprocess.Popen([sys.executable, "-m", "train", "--config", str(path)], cwd=ROOT, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_sigint_as_at_a_terminal)
    try:
        deadline = time.monotonic() + 240
        while not ck_path.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ck_path.exists() and proc.poll() is None, "training did not start"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == [f"interrupted: the last checkpoint is kept; resume with: "
                                        f"python -m train --config {path}"]
    ck = torch.load(ck_path, weights_only=True)
    assert not ck["finished"] and ck["position"]["global_step"] >= 1
    assert not [p for p in ck_path.parent.iterdir() if p.name.endswith(".tmp")]


# ---------------------------------------------------------------------------------------------------
# 4. progress lines without a terminal


def test_progress_lines_reach_a_log_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_experiment(tiny_config(tmp_path, progress=True, train={"log_every": 3}))  # stderr is captured: no TTY
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ", step " in ln]
    # 10 steps: lines at global steps 3, 6 and 9
    assert [ln.split(": loss")[0] for ln in lines] == ["[rope2d] epoch 1/2, step 3/5 (3/10)",
                                                      "[rope2d] epoch 2/2, step 1/5 (6/10)",
                                                      "[rope2d] epoch 2/2, step 4/5 (9/10)"]
    assert all(" lr " in ln and ln.endswith(" s)") for ln in lines)
    assert "eval rope2d: resize 40 px:" in out and "eval rope2d: canvas 20 px:" in out
    run_experiment(tiny_config(tmp_path / "quiet", progress=True, train={"log_every": 0}))
    assert ", step " not in capsys.readouterr().out


def test_progress_lines_in_a_redirected_process(tmp_path: Path) -> None:
    """nohup python -m train ... > log: the lines are in the file (flushed), not only at the end."""
    path = write_config(tmp_path, progress=True, train={"epochs": 1, "log_every": 2, "val_every_epoch": False},
                        eval={"sizes": [28]})
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "-m", "train", "--config", str(path)], cwd=ROOT, stdout=f,
                              stderr=subprocess.STDOUT, timeout=300)
    text = log.read_text()
    assert done.returncode == 0, text[-2000:]
    assert "[rope2d] epoch 1/1, step 2/5 (2/5): loss" in text and "[rope2d] epoch 1/1, step 4/5 (4/5): loss" in text
    assert "\r" not in text  # no bar redraws in the file


def test_ctrl_c_during_a_checkpoint_write_lands_after_the_file_is_in_place(tmp_path: Path, interruptible) -> None:
    """SIGINT may reach any thread while torch.save runs; the write finishes, then the interrupt is raised."""
    import threading

    from train.engine.checkpoint import atomic_save

    target = tmp_path / "checkpoint.pt"
    timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))  # sent from another thread
    timer.start()
    saved = 0
    with pytest.raises(KeyboardInterrupt):
        for saved in range(1, 100_000):
            atomic_save({"step": saved, "x": torch.randn(100_000)}, target)
    timer.join()
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    # the interrupt lands after the write it interrupted, or before the next one began
    assert torch.load(target, weights_only=True)["step"] in (saved - 1, saved)
