"""Per-process training memory of ViT-B/16 (rope2d) under DDP and FSDP2, measured in one run.

Two CPU processes (gloo) build ``vit_base_patch16_224`` patched with rope2d (random weights), wrap it as
``train.strategy`` does (``train.runtime.parallel``), take one AdamW step and count the bytes of the tensors each
process holds: parameters, gradients and optimiser state, a DTensor counted by its local shard
(``to_local()``), not the process's RSS. Prints the bytes per rank and the FSDP / DDP ratio.

    python -m benchmarks.train_memory
"""

from __future__ import annotations

import os
import socket

import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import DTensor

import vispos
from train.config.sections import TrainConfig
from train.runtime.parallel import shard, wrap
from train.runtime.process import Dist, Runtime

WORLD = 2
PARTS = ("parameters", "gradients", "optimizer")


def _bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def measure(strategy: str, rt: Runtime) -> dict[str, int]:
    """One AdamW step of ViT-B/16 under ``strategy``; the bytes this process holds, per part."""
    torch.manual_seed(0)
    model: nn.Module = vispos.patch(timm.create_model("vit_base_patch16_224", pretrained=False), "rope2d")
    t = TrainConfig(strategy=strategy)  # type: ignore[arg-type]
    forward = wrap(shard(model, t, rt) if strategy == "fsdp" else model, t, rt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    forward(torch.randn(1, 3, 224, 224)).sum().backward()
    opt.step()
    params = list(model.parameters())
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"parameters": sum(_bytes(p) for p in params), "gradients": sum(_bytes(p.grad) for p in params),
            "optimizer": sum(_bytes(v) for v in states)}


def _worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    rt = Runtime(torch.device("cpu"), Dist(rank, WORLD), None, None, progress=False)
    totals = {}
    for strategy in ("ddp", "fsdp"):
        got = measure(strategy, rt)
        every = [None] * WORLD
        dist.all_gather_object(every, got)
        totals[strategy] = [sum(g.values()) for g in every]  # type: ignore[union-attr]
        if rank == 0:
            for r, g in enumerate(every):
                parts = ", ".join(f"{k} {g[k]:,}" for k in PARTS)  # type: ignore[index]
                print(f"{strategy} rank {r}: {sum(g.values()):,} bytes ({parts})")  # type: ignore[union-attr]
    if rank == 0:
        ratio = max(totals["fsdp"]) / max(totals["ddp"])
        print(f"FSDP / DDP (largest rank): {ratio:.3f}")
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port,), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
