"""train.strategy=fsdp: two CPU processes (gloo) with FSDP2 shards train as one process does, a sharded
checkpoint (torch.distributed.checkpoint) resumes a killed run exactly, and ``python -m train.convert``
turns it into weights that ``vispos.create_model`` loads. Under fsdp, activation checkpointing recomputes
each block (same losses), bf16 gathers bf16 weights from fp32 shards, and compiled blocks train as eager ones
(hooks in the workers record what each training forward did: ``_probing_shard``)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from train.config.sections import ConfigError
from train.experiment.run import run_experiment
from train.testing import make_image_folder, tiny_config

pytestmark = pytest.mark.slow  # FSDP2 in several processes: make test-slow (a CI step), not make test

SCHEMES = ["rope2d", "rope2d_mixed", "relbias2d", "learned2d"]
# 4 classes x 20 images of 16 px (RGB), batch 16: 5 steps an epoch
TRAIN = {"epochs": 1, "batch_size": 16, "val_every_epoch": False}
EVAL = {"sizes": [16], "batch_size": 40}
TOL = 1e-5  # fp32 on CPU: FSDP's reduce-scatter sums in another order than one process's backward


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_SEEN: list[dict[str, Any]] = []  # in a worker: what each sharded model did in its training forwards


def _probing_shard(model: nn.Module, t: Any, rt: Any) -> nn.Module:
    """train.runtime.parallel.shard, then hooks that record, for each training forward of the whole model,
    how often the first block's first Linear ran (2 per forward when the backward recomputes the block) and
    the dtype of the weight it ran with (the gathered weight, in the MixedPrecisionPolicy's param_dtype).
    In a compiled block the hook's Python runs only while dynamo traces it."""
    from train.runtime.parallel import shard

    shard(model, t, rt)
    seen: dict[str, Any] = {"forwards": 0, "linear_calls": 0, "checkpoint_calls": 0, "weight_dtypes": [],
                            "shard_dtype": str(next(model.parameters()).dtype),
                            "compiled": [b._compiled_call_impl is not None for b in model.blocks]}
    linear = next(m for m in model.blocks[0].modules() if isinstance(m, nn.Linear))

    def on_model(module: nn.Module, args: Any) -> None:
        seen["forwards"] += module.training

    def on_linear(module: nn.Module, args: Any) -> None:
        if module.training:
            seen["linear_calls"] += 1
            seen["weight_dtypes"].append(str(module.weight.dtype))

    model.register_forward_pre_hook(on_model)
    linear.register_forward_pre_hook(on_linear)
    _SEEN.append(seen)
    return model


def _counting_checkpoint(*args: Any, **kwargs: Any) -> Any:
    """torch.utils.checkpoint.checkpoint as the ViT host calls it (one call per block), counted."""
    from torch.utils.checkpoint import checkpoint

    _SEEN[-1]["checkpoint_calls"] += 1
    return checkpoint(*args, **kwargs)


def _worker(rank: int, world: int, port: int, out_dir: str, sections: dict[str, Any], stop: bool,
            probe: bool = False) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import train.engine.trainer as trainer

    if probe:
        import vispos.timm.model as host

        trainer.shard = _probing_shard  # type: ignore[assignment]
        host.checkpoint = _counting_checkpoint  # type: ignore[assignment]
    try:
        run_experiment(tiny_config(out_dir, **sections))
    except trainer.StopRequested:
        if not stop:
            raise
    if probe:
        (Path(out_dir) / f"probe-{rank}.json").write_text(json.dumps(_SEEN))
        _SEEN.clear()


def _worker_each(rank: int, world: int, jobs: list[tuple[int, str, dict[str, Any]]]) -> None:
    for port, out_dir, sections in jobs:  # each run joins (and leaves) a process group of its own
        _worker(rank, world, port, out_dir, sections, False, True)


def _two_each(runs: dict[str, tuple[Path, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Several probed runs, one after the other in the same two processes (one start-up for all)."""
    jobs = [(_free_port(), str(out), sections) for out, sections in runs.values()]
    mp.spawn(_worker_each, args=(2, jobs), nprocs=2, join=True)
    return {k: json.loads((out / "results.json").read_text()) for k, (out, _) in runs.items()}


def _two(out_dir: Path, sections: dict[str, Any], stop: bool = False, probe: bool = False) -> dict[str, Any] | None:
    mp.spawn(_worker, args=(2, _free_port(), str(out_dir), sections, stop, probe), nprocs=2, join=True)
    results = out_dir / "results.json"
    return json.loads(results.read_text()) if results.exists() else None


def _probes(out_dir: Path) -> list[list[dict[str, Any]]]:
    """Per rank, per scheme (in the run's order): what ``_probing_shard`` recorded."""
    return [json.loads((out_dir / f"probe-{r}.json").read_text()) for r in range(2)]


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


# one scheme: every scheme's blocks run through the same checkpointed, sharded path (vispos/timm/model.py)
VARIANTS = {"fp32": {}, "checkpointing": {"activation_checkpointing": True}, "bf16": {"precision": "bf16"},
            "compiled": {"compile": True, "activation_checkpointing": True}}
BF16_TOL = 2e-2  # bf16 keeps 8 significant bits (relative rounding 2**-9 ~ 0.002 per op): ~1% of a loss of ~1.4


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory, images: dict[str, Any]) -> dict[str, Any]:
    """The fsdp run of rope2d in fp32, with activation checkpointing, in bf16 and compiled (with checkpointing):
    results and, per rank, what each training forward did (``_probing_shard``)."""
    root = tmp_path_factory.mktemp("variants")
    runs = {k: (root / k, {"schemes": ["rope2d"], "data": images, "train": {**TRAIN, "strategy": "fsdp", **v},
                           "eval": EVAL}) for k, v in VARIANTS.items()}
    results = _two_each(runs)
    return {k: {"losses": _losses(results[k]["schemes"]["rope2d"]["train"]["history"]),
                "accuracy": results[k]["schemes"]["rope2d"]["accuracy"], "probes": [r[0] for r in _probes(out)]}
            for k, (out, _) in runs.items()}


def test_fsdp_activation_checkpointing_recomputes_blocks_with_equal_losses(variants: dict[str, Any]) -> None:
    plain, ckpt = variants["fp32"], variants["checkpointing"]
    # the recomputation in the backward pass runs each block a second time: 2 calls per training forward
    for seen in plain["probes"]:
        assert seen["forwards"] == 5 and seen["linear_calls"] == 5 and seen["checkpoint_calls"] == 0, seen
    for seen in ckpt["probes"]:  # and torch's checkpoint wrapped each of the 2 blocks in each forward
        assert seen["forwards"] == 5 and seen["linear_calls"] == 10 and seen["checkpoint_calls"] == 10, seen
    assert all(abs(a - b) <= 1e-6 for a, b in zip(plain["losses"], ckpt["losses"], strict=True)), (plain, ckpt)
    assert plain["accuracy"] == ckpt["accuracy"]


def test_fsdp_bf16_gathers_bf16_weights_keeps_fp32_shards(variants: dict[str, Any]) -> None:
    fp32, bf16 = variants["fp32"], variants["bf16"]
    # MixedPrecisionPolicy(param_dtype=bf16): a block's gathered weights are bf16 in the forward (autocast alone
    # would leave them fp32 and cast inside each op); the shards the optimiser updates stay fp32
    for seen in bf16["probes"]:
        assert set(seen["weight_dtypes"]) == {"torch.bfloat16"} and seen["shard_dtype"] == "torch.float32", seen
    for seen in fp32["probes"]:
        assert set(seen["weight_dtypes"]) == {"torch.float32"} and seen["shard_dtype"] == "torch.float32", seen
    assert all(torch.isfinite(torch.tensor(x)) for x in bf16["losses"])
    assert bf16["losses"] != fp32["losses"]  # bf16 rounding did change the arithmetic
    assert all(abs(a - b) < BF16_TOL for a, b in zip(fp32["losses"], bf16["losses"], strict=True)), (fp32, bf16)


def test_fsdp_compiled_checkpointed_blocks_train_as_eager(variants: dict[str, Any]) -> None:
    eager, compiled = variants["fp32"], variants["compiled"]
    # every block compiled in place (before fully_shard); its Python (the probe's hook) ran only while dynamo
    # traced it, not in each of the 5 forwards; torch's checkpoint still wrapped each block in each forward
    for seen in compiled["probes"]:
        assert seen["compiled"] == [True, True] and seen["checkpoint_calls"] == 10, seen
        assert seen["forwards"] == 5 and 0 < seen["linear_calls"] < 5, seen
    assert variants["fp32"]["probes"][0]["compiled"] == [False, False]
    assert all(abs(a - b) < TOL for a, b in zip(eager["losses"], compiled["losses"], strict=True)), (eager, compiled)
