"""Fine-tune-at-target: a trained model trained briefly at a higher resolution, then evaluated there.

How practitioners use a resolution the model was not trained at (FixRes, DeiT III, RoPE-ViT's
multi-resolution tables): a short fine-tune at the new size. Reported beside the zero-shot numbers, it
shows how fast each scheme adapts. The phase starts from a copy of the finished model and writes
``finetuned.pt`` beside ``checkpoint.pt``, which stays the zero-shot model. It continues the training
data stream (the epochs after the last training epoch) with images resized to the target size, under
the optimiser and regularisation of ``train`` except for its own learning rate and schedule; it is short,
so it keeps no mid-phase checkpoint: a killed phase starts over, a finished one is reused.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config.sections import ExperimentConfig, SchemeConfig, to_dict
from ..data.datasets import DataBundle
from ..data.loaders import TrainLoader
from ..runtime.parallel import wrap
from ..runtime.process import Runtime
from ..runtime.seeds import mix_seed, seed_everything
from . import checkpoint as ckpt_io
from .optim import make_optimizer, make_scheduler
from .trainer import NonFiniteLossError, loss_of

FILE = "finetuned.pt"
STEP_KEY = 3  # seed key of the phase's per-step randomness (dropout)


def fingerprint(cfg: ExperimentConfig, scheme: SchemeConfig) -> dict[str, Any]:
    """What determines the fine-tuned weights: the trained model's fingerprint and the phase's settings."""
    return {"train": ckpt_io.fingerprint(cfg, scheme), "finetune": to_dict(cfg.finetune)}


def finetune(cfg: ExperimentConfig, scheme: SchemeConfig, model: nn.Module, data: DataBundle, rt: Runtime,
             folder: Path, log: Callable[[str], None] = print) -> tuple[nn.Module, float]:
    """A fine-tuned copy of ``model`` (``model`` itself is untouched) and the phase's seconds."""
    ft, path, fp = cfg.finetune, folder / FILE, fingerprint(cfg, scheme)
    assert ft.size is not None, "finetune.size is not set"
    tuned = copy.deepcopy(model)
    if cfg.resume and path.exists():
        ck = ckpt_io.load(path)
        if ck["fingerprint"] == fp:
            tuned.load_state_dict(ck["model"])
            return tuned.to(rt.device), float(ck["seconds"])
    started = time.time()
    settings = dataclasses.replace(cfg.train, lr=ft.lr, warmup=ft.warmup, min_lr=0.0)
    opt = make_optimizer(tuned, settings)
    sched = make_scheduler(opt, settings, ft.steps)
    loader = TrainLoader(data, cfg.data, batch_size=ft.batch_size or cfg.train.batch_size, seed=cfg.seed,
                         dist=rt.dist, sizes=[ft.size])
    forward = wrap(tuned, cfg.train, rt)
    tuned.train()
    done, epoch, sums = 0, cfg.train.epochs, torch.zeros(2, dtype=torch.float64)
    while done < ft.steps:
        for batch in loader.epoch(epoch):
            seed_everything(mix_seed(cfg.seed, STEP_KEY, done, rt.dist.rank, modulus=2**31))
            x, y = batch.x.to(rt.device, non_blocking=True), batch.y.to(rt.device, non_blocking=True)
            with rt.autocast(rt.train_dtype):
                logits = forward(x)
            loss = loss_of(logits, y, y, cfg.train.label_smoothing)
            n = torch.tensor(float(len(y)), device=rt.device)
            stats = rt.all_reduce(torch.stack([loss.detach().float() * n, n])).cpu().double()
            if not torch.isfinite(stats[0]):
                raise NonFiniteLossError(f"[{scheme.name}] fine-tune loss became {stats[0].item()} at step {done}; "
                                         "lower finetune.lr")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.train.grad_clip:
                torch.nn.utils.clip_grad_norm_(tuned.parameters(), cfg.train.grad_clip)
            opt.step()
            sched.step()
            sums += stats
            done += 1
            if rt.lines and cfg.train.log_every and done % cfg.train.log_every == 0:
                log(f"[{scheme.name}] fine-tune step {done}/{ft.steps} at {ft.size} px: "
                    f"loss {sums[0] / max(sums[1], 1):.4f}")
            if done == ft.steps:
                break
        epoch += 1
    seconds = time.time() - started
    log(f"[{scheme.name}] fine-tuned {ft.steps} steps at {ft.size} px: loss {sums[0] / max(sums[1], 1):.4f} "
        f"({seconds:.0f} s)")
    if rt.is_main:
        ckpt_io.atomic_save({"format": ckpt_io.FORMAT, "model": tuned.state_dict(), "fingerprint": fp,
                             "seconds": seconds, "config": to_dict(cfg), "scheme": to_dict(scheme)}, path)
    rt.barrier()
    return tuned, seconds
