"""One entry of the generation trainer: diffusers' ``DiTTransformer2DModel`` in pixel space with the entry's scheme,
trained by flow matching on diffusers' ``FlowMatchEulerDiscreteScheduler`` and sampled with its Euler steps.

- ``build_dit``: the model (fixed ``seed``), patched by ``vispos.patch(model, pos, inherit=...)``: a catalogue
  scheme in the self-attention and patch embedding (``inherit=False``), or DiT's own sin-cos table kept.
- ``train_dit``: flow matching (rectified flow): x_t = (1 - sigma) x_0 + sigma noise at the scheduler's sigma of a
  uniformly drawn training timestep (``FlowMatchEulerDiscreteScheduler.scale_noise``'s formula), the model given
  timestep sigma x 1000 and the class, its output regressed on noise - x_0 (MSE). AdamW, warm-up + cosine, gradient
  clipping, optional EMA (``train`` section). Every draw (data order, noise, timesteps) comes from (seed, epoch,
  step) alone, and ``checkpoint.pt`` (atomic) holds the optimiser, schedule, EMA and position, so a killed run
  resumes where it stopped and ends with the weights of an uninterrupted one. Under torchrun (DDP) each process
  trains on its share of every batch, drawing that share's noise and DiT's class dropout from the same keys: the
  single-process run in distribution, not bit for bit; one process samples and scores.
- ``sample``: class-conditional images from pure noise in ``steps`` Euler steps at any size (optionally with
  classifier-free guidance against DiT's null class), each batch's noise drawn from (seed, size, batch).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import DiTTransformer2DModel, FlowMatchEulerDiscreteScheduler
from torch import Tensor, nn

import vispos

from ..config.generation import DitConfig, GenerationConfig, GenSchemeConfig
from ..config.sections import to_dict
from ..runtime.process import Runtime
from ..runtime.seeds import generator, mix_seed, seeded
from .checkpoint import FORMAT, CheckpointError, atomic_save, load
from .optim import make_optimizer, make_scheduler
from .trainer import NonFiniteLossError

TRAIN_TIMESTEPS = 1000  # the scheduler's training timesteps; the model reads timestep = sigma x 1000
CHECKPOINT = "checkpoint.pt"
Log = Callable[[str], None]


def build_dit(m: DitConfig, entry: GenSchemeConfig, *, img_size: int, num_classes: int, seed: int,
              device: torch.device | str = "cpu") -> nn.Module:  # fmt: skip
    """The entry's DiT (single-channel pixels, ``num_classes`` classes plus DiT's null class), weights from ``seed``."""
    with seeded(seed), torch.device(device):
        model = DiTTransformer2DModel(num_attention_heads=m.num_heads, attention_head_dim=m.head_dim, in_channels=1,
                                      out_channels=1, num_layers=m.depth, sample_size=img_size,
                                      patch_size=m.patch_size, num_embeds_ada_norm=num_classes,
                                      norm_num_groups=1)  # fmt: skip
        vispos.patch(model, entry.pos, inherit=entry.inherit, **entry.options)
    return model


def fingerprint(cfg: GenerationConfig, entry: GenSchemeConfig) -> dict[str, Any]:
    """What determines an entry's trained weights; a checkpoint is resumed only when this matches."""
    unused = ("checkpoint_every", "log_every", "val_every", "converged_within", "val_every_epoch")
    train = {k: v for k, v in to_dict(cfg.train).items() if k not in unused}
    data = {k: v for k, v in to_dict(cfg.data).items() if k in ("img_size", "train_per_class", "classes",
                                                                 "num_classes", "root")}  # fmt: skip
    return {"seed": cfg.seed, "data": data, "model": to_dict(cfg.model), "train": train,
            "scheme": {"pos": entry.pos, "options": entry.options, "inherit": entry.inherit}}  # fmt: skip


@dataclass
class Trained:
    model: nn.Module  # the weights sampled from: the EMA's with train.ema
    seconds: float
    loss: list[list[float]]  # [global step, mean training loss over the steps since the last point]


def _noised(sched: FlowMatchEulerDiscreteScheduler, x0: Tensor, rng: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """(x_t, timestep, target) for clean images x0 at uniformly drawn training timesteps."""
    index = torch.randint(0, TRAIN_TIMESTEPS, (len(x0),), generator=rng)
    sigma = sched.sigmas[index].to(x0)
    noise = torch.randn(x0.shape, generator=rng).to(x0)
    s = sigma[:, None, None, None]
    return (1 - s) * x0 + s * noise, sigma * TRAIN_TIMESTEPS, noise - x0


def train_dit(cfg: GenerationConfig, entry: GenSchemeConfig, images: Tensor, labels: Tensor, num_classes: int,
              rt: Runtime, folder: Path, log: Log) -> Trained:  # fmt: skip
    """Train (or resume, or load the finished) entry on ``images`` [N, 1, S, S] in [-1, 1] with ``labels`` [N]."""
    t = cfg.train
    model = build_dit(cfg.model, entry, img_size=cfg.data.img_size, num_classes=num_classes, seed=cfg.seed)
    model.to(rt.device)
    ema = copy.deepcopy(model).requires_grad_(False) if t.ema else None
    opt = make_optimizer(model, t)
    per_epoch = math.ceil(len(labels) / t.batch_size)
    total = t.epochs * per_epoch
    sched = make_scheduler(opt, t, total)
    flow = FlowMatchEulerDiscreteScheduler(num_train_timesteps=TRAIN_TIMESTEPS)
    fp = fingerprint(cfg, entry)
    path = folder / CHECKPOINT
    step, seconds, history, running = 0, 0.0, [], [0.0, 0]
    if cfg.resume and path.is_file():
        ck = load(path, required=("fingerprint", "model", "step"))
        if ck["fingerprint"] != fp:
            raise CheckpointError(f"{path} was trained with other settings; delete it or set out_dir elsewhere")
        model.load_state_dict(ck["model"])
        if ema is not None:
            ema.load_state_dict(ck["ema"])
        if not ck["finished"]:
            opt.load_state_dict(ck["optimizer"])
            sched.load_state_dict(ck["scheduler"])
        step, seconds, history = ck["step"], ck["seconds"], ck["loss"]
        if ck["finished"]:
            return Trained(ema if ema is not None else model, seconds, history)
        log(f"[{entry.name}] resumed at step {step} of {total}")

    def save(finished: bool) -> None:
        if rt.is_main:
            atomic_save({"format": FORMAT, "fingerprint": fp, "model": model.state_dict(),
                         "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                         "ema": None if ema is None else ema.state_dict(), "step": step, "seconds": seconds,
                         "loss": history, "finished": finished}, path)  # fmt: skip

    forward = model
    if rt.distributed:
        forward = nn.parallel.DistributedDataParallel(model)
    model.train()
    start = time.time()
    every = t.checkpoint_every or per_epoch
    log_every = max(1, total // 25)
    while step < total:
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(len(labels), generator=generator(cfg.seed, epoch))
        index = order[i * t.batch_size : (i + 1) * t.batch_size]
        index = index[rt.dist.rank :: rt.dist.world]
        rng = generator(cfg.seed, epoch, i, 1)
        x0, y = images[index].to(rt.device), labels[index].to(rt.device)
        xt, timestep, target = _noised(flow, x0, rng)
        with seeded(mix_seed(cfg.seed, step)), rt.autocast(rt.train_dtype):  # DiT's class dropout draws from here
            loss = F.mse_loss(forward(xt, timestep=timestep, class_labels=y).sample.float(), target)
        if not torch.isfinite(loss):
            raise NonFiniteLossError(f"[{entry.name}] non-finite loss {loss.item()} at step {step}; the last "
                                     f"checkpoint ({path}) is kept: lower train.lr and resume")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if t.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        sched.step()
        step += 1
        if ema is not None:
            decay = min(t.ema_decay, 1 - (1 + step) ** (-2 / 3)) if t.ema_warmup else t.ema_decay
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                    e.lerp_(p, 1 - decay)
        running[0] += float(loss)
        running[1] += 1
        if step % log_every == 0 or step == total:
            history.append([step, round(running[0] / running[1], 5)])
            running = [0.0, 0]
            log(f"[{entry.name}] step {step}/{total} loss {history[-1][1]:.4f}")
        if step % every == 0 and step < total:
            seconds, start = seconds + time.time() - start, time.time()
            save(False)
    seconds += time.time() - start
    save(True)
    return Trained(ema if ema is not None else model, seconds, history)


@torch.no_grad()
def sample(model: nn.Module, labels: Tensor, size: int, *, steps: int, guidance: float, seed: int, batch_size: int,
           num_classes: int, device: torch.device) -> Tensor:  # fmt: skip
    """Images [N, 1, size, size] in [0, 1] of the classes ``labels`` [N], from noise drawn from (seed, size, batch)."""
    model.eval()
    out = []
    for b, start in enumerate(range(0, len(labels), batch_size)):
        y = labels[start : start + batch_size].to(device)
        x = torch.randn((len(y), 1, size, size), generator=generator(seed, size, b)).to(device)
        flow = FlowMatchEulerDiscreteScheduler(num_train_timesteps=TRAIN_TIMESTEPS)
        flow.set_timesteps(steps, device=device)
        for t in flow.timesteps:
            timestep = t.expand(len(y)).float()
            if guidance > 1.0:
                null = torch.full_like(y, num_classes)
                both = model(torch.cat((x, x)), timestep=torch.cat((timestep, timestep)),
                             class_labels=torch.cat((y, null))).sample  # fmt: skip
                cond, uncond = both.chunk(2)
                v = uncond + guidance * (cond - uncond)
            else:
                v = model(x, timestep=timestep, class_labels=y).sample
            x = flow.step(v, t, x).prev_sample
        out.append(((x.float().clamp(-1, 1) + 1) / 2).cpu())
    return torch.cat(out)
