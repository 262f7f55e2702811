"""A real run's process: Ctrl-C and SIGINT (in a step, a save, the loader) exit 130 with the resume command and
leave a loadable checkpoint; progress lines reach a log file when there is no terminal."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import train
from train.__main__ import main as train_main
from train.engine.trainer import SchemeTrainer
from train.experiment.run import run_experiment
from train.testing import tiny_config
from train.testing import write_tiny_config as write_config

ROOT = Path(train.__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------
# 1. Ctrl-C


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
# 2. progress lines without a terminal


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
