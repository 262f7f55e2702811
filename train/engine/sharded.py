"""Sharded checkpoints of an fsdp run (``torch.distributed.checkpoint``): no process gathers the full model.

Every process writes its own shards of the model and optimiser state (``get_state_dict``) into a temporary
folder beside ``checkpoint.pt``; once all have written, rank 0 renames it to ``shards-<global step>`` and
then replaces ``checkpoint.pt`` atomically (``atomic_save``), which names that folder and holds the rest of
the checkpoint (position, RNG, history, config). A run killed at any point leaves ``checkpoint.pt`` naming
a complete folder; older folders are removed after the switch. ``full_state`` reads the weights of such a
checkpoint in one process (``python -m train.convert``).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from ..runtime.process import Runtime

PREFIX = "shards-"


def save(model: nn.Module, opt: torch.optim.Optimizer, folder: Path, step: int, rt: Runtime) -> str:
    """Write this process's shards (every process calls it); the folder's name, once complete."""
    name = f"{PREFIX}{step}"
    tmp = folder / f".{name}.tmp"
    if rt.is_main and tmp.exists():
        shutil.rmtree(tmp)
    rt.barrier()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp)
    rt.barrier()
    if rt.is_main:
        if (folder / name).exists():
            shutil.rmtree(folder / name)
        tmp.rename(folder / name)
    return name


def prune(folder: Path, keep: str) -> None:
    """Remove the shard folders other than ``keep`` (after ``checkpoint.pt`` names it)."""
    for old in folder.glob(f"{PREFIX}*"):
        if old.name != keep and old.is_dir():
            shutil.rmtree(old)


def load(model: nn.Module, opt: torch.optim.Optimizer, shards: Path) -> None:
    """Read this process's shards of the model and optimiser state (every process calls it)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=shards)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def full_model_state(model: nn.Module) -> dict[str, Any]:
    """The whole model's state dict on every process (a gather: for evaluation, not for checkpoints)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def full_state(shards: Path) -> dict[str, Any]:
    """The model weights of a shard folder, read in one process without a process group."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "full.pt"
        dcp_to_torch_save(shards, out)
        return torch.load(out, weights_only=True)["model"]
