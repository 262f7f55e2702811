"""Process layout (single process or torchrun + DDP), device and precision."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config.schema import ConfigError


@dataclass(frozen=True)
class Dist:
    """This process's place in a DDP job (rank 0 of 1 without DDP)."""

    rank: int = 0
    world: int = 1


@dataclass
class Runtime:
    device: torch.device
    dist: Dist
    train_dtype: torch.dtype | None  # autocast dtype, None: fp32
    eval_dtype: torch.dtype | None
    progress: bool  # progress bars (stderr is a terminal)
    lines: bool = False  # plain progress lines instead (stderr is a file or pipe: nohup, slurm)

    @property
    def is_main(self) -> bool:
        return self.dist.rank == 0

    @property
    def distributed(self) -> bool:
        return self.dist.world > 1

    def autocast(self, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[None]:
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def _dtype(precision: str, device: torch.device) -> torch.dtype | None:
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def setup(device: str = "auto", *, threads: int | None = None, progress: bool = True, train_precision: str = "auto",
          eval_precision: str = "auto") -> Runtime:
    """Join the torchrun process group when launched by torchrun, pick the device and precision."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    want_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is available; accepted: auto, cpu, cuda")
    if want_cuda:
        torch.cuda.set_device(local_rank)
        where = torch.device("cuda", local_rank)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        where = torch.device("cpu")
    if threads is not None:
        torch.set_num_threads(threads)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if want_cuda else "gloo", rank=rank, world_size=world)
    shown = progress and rank == 0
    bars = shown and sys.stderr.isatty()
    return Runtime(where, Dist(rank, world), _dtype(train_precision, where), _dtype(eval_precision, where), bars,
                   lines=shown and not bars)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def main_first(rt: Runtime) -> Iterator[None]:
    """Rank 0 runs the block first (e.g. creating folders), the others after it."""
    if not rt.is_main:
        rt.barrier()
    yield
    if rt.is_main:
        rt.barrier()
