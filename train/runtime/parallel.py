"""How the processes of a torchrun job share the model: ``train.strategy``.

``ddp``: every process holds the whole model, its gradients and optimiser state (DistributedDataParallel
averages the gradients). ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) on every transformer block
and on the root model, so each process holds 1/N of the parameters, gradients and optimiser state, and a
block's full weights exist only while it runs. With bf16 precision the gathered weights are bf16 (the
shards, the gradient reduction and the optimiser stay fp32); fp32 otherwise.

The order for fsdp is that of DINOv3's ``ac_compile_parallelize``: activation checkpointing first (it wraps
the block's forward), then ``torch.compile`` of each block in place, then ``fully_shard`` (the sharded
parameters are what the compiled blocks read). The model is sharded before the optimiser is made, so the
optimiser holds the shards.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from ..config.sections import ConfigError, TrainConfig
from .process import Runtime


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a timm ViT / Eva (``model.blocks``)."""
    found = getattr(model, "blocks", None)
    if not isinstance(found, nn.Sequential | nn.ModuleList) or not len(found):
        raise ConfigError(f"train.strategy=fsdp shards a model's transformer blocks; {type(model).__name__} "
                          "has no model.blocks")
    return list(found)


def shard(model: nn.Module, t: TrainConfig, rt: Runtime) -> nn.Module:
    """FSDP2 in place: activation checkpointing, then compile, then ``fully_shard`` per block and on the root."""
    if not rt.distributed:
        raise ConfigError("train.strategy=fsdp needs a distributed launch: torchrun --nproc_per_node=N -m train "
                          "--config ... (one process trains with train.strategy=ddp)")
    if t.activation_checkpointing:
        model.set_grad_checkpointing(True)  # type: ignore[operator]  (timm: checkpoint each block's forward)
    if t.compile:
        for block in blocks(model):
            block.compile()
    bf16 = rt.train_dtype == torch.bfloat16
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                  reduce_dtype=torch.float32 if bf16 else None)
    for block in blocks(model):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def wrap(model: nn.Module, t: TrainConfig, rt: Runtime, *, unused_parameters: bool = False) -> nn.Module:
    """The module the forward pass runs through: an fsdp model as sharded (``shard``), else compiled and / or
    DDP-wrapped as configured."""
    if t.strategy == "fsdp":
        return model
    if t.activation_checkpointing:
        model.set_grad_checkpointing(True)  # type: ignore[operator]
    if t.compile:
        model = torch.compile(model)  # type: ignore[assignment]
    if rt.distributed:
        device_ids = [rt.device.index] if rt.device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=unused_parameters)
    return model
