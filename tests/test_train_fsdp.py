"""train.strategy=fsdp: two CPU processes (gloo) with FSDP2 shards train as one process does, a sharded
checkpoint (torch.distributed.checkpoint) resumes a killed run exactly, and ``python -m train.convert``
turns it into weights that ``vispos.create_model`` loads."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from train.config.sections import ConfigError
from train.experiment.run import run_experiment
from train.testing import make_image_folder, tiny_config

SCHEMES = ["rope2d", "rope2d_mixed", "relbias2d", "learned2d"]
# 4 classes x 20 images of 16 px (RGB), batch 16: 5 steps an epoch
TRAIN = {"epochs": 1, "batch_size": 16, "val_every_epoch": False}
EVAL = {"sizes": [16], "batch_size": 40}
TOL = 1e-5  # fp32 on CPU: FSDP's reduce-scatter sums in another order than one process's backward


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, sections: dict[str, Any], stop: bool) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from train.engine.trainer import StopRequested

    try:
        run_experiment(tiny_config(out_dir, **sections))
    except StopRequested:
        if not stop:
            raise


def _two(out_dir: Path, sections: dict[str, Any], stop: bool = False) -> dict[str, Any] | None:
    mp.spawn(_worker, args=(2, _free_port(), str(out_dir), sections, stop), nprocs=2, join=True)
    results = out_dir / "results.json"
    return json.loads(results.read_text()) if results.exists() else None


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = make_image_folder(tmp_path_factory.mktemp("tree"), classes=4, per_class=20, size=16)
    return {"dataset": "folder", "root": str(root), "img_size": 16, "mean": [0.5] * 3, "std": [0.25] * 3,
            "train_per_class": None, "val_per_class": None}


def _losses(history: list[dict[str, Any]]) -> list[float]:
    return [row["train_loss"] for row in history]


def test_fsdp_losses_match_one_process(tmp_path: Path, images: dict[str, Any]) -> None:
    one = {"schemes": SCHEMES, "data": images, "train": TRAIN, "eval": EVAL}
    single = run_experiment(tiny_config(tmp_path / "one", **one)).to_json()
    double = _two(tmp_path / "two", {**one, "train": {**TRAIN, "strategy": "fsdp"}})
    assert double is not None and double["processes"] == 2
    for name in SCHEMES:
        a, b = single["schemes"][name], double["schemes"][name]
        la, lb = _losses(a["train"]["history"]), _losses(b["train"]["history"])
        assert la and all(abs(x - y) < TOL for x, y in zip(la, lb, strict=True)), (name, la, lb)
        acc_a, acc_b = a["accuracy"], b["accuracy"]
        assert acc_a == acc_b, (name, acc_a, acc_b)


def test_fsdp_kill_and_resume_is_exact_and_converts(tmp_path: Path, images: dict[str, Any]) -> None:
    train = {**TRAIN, "epochs": 2, "strategy": "fsdp", "checkpoint_every": 2, "val_every_epoch": True}
    sections = {"data": images, "train": train, "eval": EVAL}
    ref = _two(tmp_path / "ref", sections)
    assert _two(tmp_path / "cut", {**sections, "debug": {"stop_after_steps": 7}}, stop=True) is None
    meta = torch.load(tmp_path / "cut" / "rope2d" / "checkpoint.pt", weights_only=True)
    assert meta["position"]["global_step"] == 6 and meta["model"] is None and meta["shards"] == "shards-6"
    assert [p.name for p in (tmp_path / "cut" / "rope2d").glob("*shards-*")] == ["shards-6"]
    got = _two(tmp_path / "cut", sections)
    assert ref is not None and got is not None
    h_ref, h_got = ref["schemes"]["rope2d"]["train"]["history"], got["schemes"]["rope2d"]["train"]["history"]
    assert [(r["train_loss"], r["val_acc"]) for r in h_ref] == [(r["train_loss"], r["val_acc"]) for r in h_got]
    assert ref["schemes"]["rope2d"]["accuracy"] == got["schemes"]["rope2d"]["accuracy"]

    from train.convert import convert

    out = tmp_path / "rope2d.safetensors"
    convert(tmp_path / "cut" / "rope2d" / "checkpoint.pt", out)
    import vispos
    from train.engine.models import build_model

    cfg = tiny_config(tmp_path / "x", data=images)
    model = vispos.create_model("vit_base_patch16_224", pos="rope2d", checkpoint_path=str(out), pretrained=False,
                                img_size=16, num_classes=4, patch_size=4, embed_dim=32, depth=2,
                                num_heads=2, class_token=False, global_pool="avg").eval()
    ours = build_model(cfg.model, cfg.schemes[0], img_size=16, num_classes=4, in_chans=3, seed=1).eval()
    ours.load_state_dict(_full(tmp_path / "ref" / "rope2d" / "checkpoint.pt"))  # the uninterrupted run's
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(model(x), ours(x), rtol=0, atol=0)
    # the .pt form is a trainer checkpoint: train.evaluate reproduces the run's accuracy from it
    from train.evaluate import main as evaluate_main

    convert(tmp_path / "cut" / "rope2d" / "checkpoint.pt", tmp_path / "rope2d.pt")
    plain = torch.load(tmp_path / "rope2d.pt", weights_only=True)
    assert plain["shards"] is None and plain["model"].keys() == ours.state_dict().keys()
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in plain["model"].items())
    again = tmp_path / "again.json"
    assert evaluate_main(["--checkpoint", str(tmp_path / "rope2d.pt"), "--sizes", "16", "--quiet", "--out",
                          str(again)]) == 0
    assert json.loads(again.read_text())["accuracy"]["rope2d"] == got["schemes"]["rope2d"]["accuracy"]


def _full(path: Path) -> dict[str, Any]:
    from train.engine.sharded import full_state

    return full_state(path.parent / torch.load(path, weights_only=True)["shards"])


def test_fsdp_refuses_ema_and_a_single_process(tmp_path: Path, images: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"train.strategy=fsdp shards the model; train.ema"):
        tiny_config(tmp_path, train={"strategy": "fsdp", "ema": True})
    with pytest.raises(ConfigError, match=r"needs a distributed launch: torchrun"):
        run_experiment(tiny_config(tmp_path, data=images, train={**TRAIN, "strategy": "fsdp"}, eval=EVAL))
    with pytest.raises(ConfigError, match=r"train.strategy.*ddp.*fsdp"):
        tiny_config(tmp_path, train={"strategy": "zero3"})
