"""DDP: two CPU processes (gloo) on the same global batch train the same model as one process, with
multi-resolution steps (both processes draw each step's size without communicating)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from train.experiment.run import run_experiment
from train.testing import tiny_config

pytestmark = pytest.mark.slow  # DDP in several processes: make test-slow (a CI step), not make test

SECTIONS = {"schemes": ["rope2d"], "train": {"epochs": 2, "batch_size": 40, "sizes": [16, 20, 28]},
            "eval": {"sizes": [20, 28, 40]}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    run_experiment(tiny_config(out_dir, **SECTIONS))


def test_two_gloo_processes_match_one_process(tmp_path: Path) -> None:
    single = run_experiment(tiny_config(tmp_path / "one", **SECTIONS))
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path / "two")), nprocs=2, join=True)
    import json

    double = json.loads((tmp_path / "two" / "results.json").read_text())
    assert double["processes"] == 2 and single.processes == 1
    assert double["schemes"]["rope2d"]["accuracy"] == single.to_json()["schemes"]["rope2d"]["accuracy"]
    h1, h2 = single.to_json()["schemes"]["rope2d"]["train"]["history"], double["schemes"]["rope2d"]["train"]["history"]
    for a, b in zip(h1, h2, strict=True):
        assert abs(a["train_loss"] - b["train_loss"]) < 1e-5 and a["train_acc"] == b["train_acc"]
        assert a["sizes"] == b["sizes"]
    assert len({int(s.split(":")[0]) for row in h1 for s in row["sizes"].split()}) > 1  # several sizes drawn
    w1 = torch.load(tmp_path / "one" / "rope2d" / "checkpoint.pt", weights_only=True)["model"]
    w2 = torch.load(tmp_path / "two" / "rope2d" / "checkpoint.pt", weights_only=True)["model"]
    for k in w1:
        if torch.is_tensor(w1[k]):
            torch.testing.assert_close(w1[k], w2[k], rtol=1e-4, atol=1e-5)
        else:  # a module's extra state
            assert w1[k] == w2[k]
