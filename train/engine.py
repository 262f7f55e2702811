"""Training one scheme: AdamW + warm-up/cosine, checkpoints, exact resume, DroPE, NaN guard, CSV log."""

from __future__ import annotations

import csv
import io
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from . import checkpoint as ckpt_io
from .config import ConfigError, ExperimentConfig, SchemeConfig, to_dict
from .data import DataBundle
from .evaluate import accuracy
from .loaders import EvalLoader, TrainLoader
from .models import build_model, patch_size_of, set_positions
from .runtime import Runtime

LOG_FIELDS = ("epoch", "step", "lr", "train_loss", "train_acc", "val_acc", "skipped", "drope", "seconds")


class NonFiniteLossError(RuntimeError):
    """The loss (or gradient norm) became NaN/inf; the last good checkpoint is kept."""


class StopRequested(RuntimeError):
    """debug.stop_after_steps reached: simulates a run killed mid-epoch."""


@dataclass
class TrainResult:
    model: nn.Module
    history: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0
    seconds: float = 0.0


def fingerprint(cfg: ExperimentConfig, scheme: SchemeConfig) -> dict[str, Any]:
    """What determines the trained weights; a checkpoint is resumed only when this matches."""
    data = {k: v for k, v in to_dict(cfg.data).items() if k != "workers"}
    train = {k: v for k, v in to_dict(cfg.train).items() if k not in ("checkpoint_every", "compile")}
    sch = {k: v for k, v in to_dict(scheme).items() if k in ("pos", "options", "drope")}
    return {"seed": cfg.seed, "data": data, "model": to_dict(cfg.model), "train": train, "scheme": sch}


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else k))
    return out


def fingerprint_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    fa, fb = _flat(a), _flat(b)
    return sorted(k for k in set(fa) | set(fb) if fa.get(k) != fb.get(k))


def make_optimizer(model: nn.Module, cfg: ExperimentConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on 1-D parameters (norms, biases) and on what the model lists as such."""
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name in skip else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(0.9, 0.999))


def lr_factor(step: int, total: int, warmup: float, min_ratio: float) -> float:
    """Linear warm-up over ``warmup * total`` steps, then cosine from 1 to ``min_ratio``."""
    w = int(round(warmup * total))
    if step < w:
        return (step + 1) / w
    t = (step - w) / max(1, total - w)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(t, 1.0)))


def write_csv(path: Path, history: list[dict[str, Any]]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=LOG_FIELDS)
    writer.writeheader()
    for row in history:
        writer.writerow({k: row.get(k, "") for k in LOG_FIELDS})
    tmp = path.with_suffix(".csv.tmp")
    tmp.write_text(buf.getvalue())
    tmp.replace(path)


def _step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 4099 + rank) % (2**31)


def _seed_step(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def train_scheme(cfg: ExperimentConfig, scheme: SchemeConfig, data: DataBundle, rt: Runtime, folder: Path,
                 log: Any = print) -> TrainResult:
    """Train one scheme (or resume it, or load it when already finished); returns the trained model."""
    model = build_model(cfg, scheme, num_classes=data.num_classes, in_chans=data.in_chans).to(rt.device)
    opt = make_optimizer(model, cfg)
    loader = TrainLoader(data, cfg, rt.dist)
    steps, epochs = len(loader), cfg.train.epochs
    total = steps * epochs
    min_ratio = cfg.train.min_lr / cfg.train.lr if cfg.train.lr > 0 else 0.0
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, total, cfg.train.warmup, min_ratio))
    drope_start = total - int(round(scheme.drope * total)) if scheme.drope > 0 else None
    fp = fingerprint(cfg, scheme)
    path = folder / "checkpoint.pt"
    if rt.is_main:
        folder.mkdir(parents=True, exist_ok=True)

    first_epoch, start_step, sums, history, skipped, seconds_before = 0, 0, [0.0, 0.0, 0.0], [], 0, 0.0
    if path.exists() and cfg.resume:
        ck = ckpt_io.load(path)
        diff = fingerprint_diff(ck["fingerprint"], fp)
        if diff:
            raise ConfigError(
                f"{path} was trained with a different config (differs in: {', '.join(diff)}); "
                "set resume=false to start it over, or choose another out_dir"
            )
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        ckpt_io.set_rng_state(ck["rng"])
        first_epoch, start_step = ck["position"]["epoch"], ck["position"]["step"]
        sums, history, skipped = list(ck["epoch_sums"]), list(ck["history"]), int(ck["skipped"])
        seconds_before = float(ck["seconds"])
        if ck["finished"]:
            if drope_start is not None:
                set_positions(model, False)
            return TrainResult(model, history, skipped, float(ck["seconds"]))
        log(f"[{scheme.name}] resuming from {path} at epoch {first_epoch + 1}, step {start_step}")

    train_model: nn.Module = model
    if cfg.train.compile:
        train_model = torch.compile(model)  # type: ignore[assignment]
    if rt.distributed:
        # DroPE leaves the scheme's own parameters (if any) without gradients once positions are off
        pos_params = getattr(model, "vispos", None)
        unused = drope_start is not None and pos_params is not None and any(
            p.requires_grad for p in pos_params.parameters())
        train_model = DistributedDataParallel(train_model, device_ids=[rt.device.index] if rt.device.type == "cuda"
                                              else None, find_unused_parameters=unused)
    mixup = None
    if cfg.train.mixup > 0 or cfg.train.cutmix > 0:
        from timm.data import Mixup

        mixup = Mixup(mixup_alpha=cfg.train.mixup, cutmix_alpha=cfg.train.cutmix,
                      label_smoothing=cfg.train.label_smoothing, num_classes=data.num_classes)
    eval_loader = EvalLoader(data, cfg, rt.dist, patch_size_of(model)) if cfg.train.val_every_epoch else None
    t0 = time.time()

    def save(pos_epoch: int, pos_step: int, finished: bool) -> None:
        if rt.is_main:
            ckpt_io.atomic_save({
                "format": ckpt_io.FORMAT, "model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "rng": ckpt_io.rng_state(),
                "position": {"epoch": pos_epoch, "step": pos_step, "global_step": pos_epoch * steps + pos_step},
                "epoch_sums": list(sums), "history": history, "skipped": skipped, "finished": finished,
                "seconds": seconds_before + time.time() - t0, "fingerprint": fp, "config": to_dict(cfg),
                "scheme": to_dict(scheme), "classes": list(data.classes), "in_chans": data.in_chans,
                "mean": list(data.mean), "std": list(data.std), "background": list(data.background),
            }, path)
        rt.barrier()

    positions_on = True
    for epoch in range(first_epoch, epochs):
        model.train()
        bar = tqdm(total=steps, initial=start_step, desc=f"{scheme.name} {epoch + 1}/{epochs}", leave=False,
                   disable=not rt.progress, dynamic_ncols=True)
        for batch in loader.epoch(epoch, start_step):
            gstep = epoch * steps + batch.step
            if drope_start is not None and gstep >= drope_start and positions_on:
                set_positions(model, False)
                positions_on = False
            _seed_step(_step_seed(cfg.seed, gstep, rt.dist.rank))  # dropout, mixup: a function of the step
            x, y = batch.x.to(rt.device, non_blocking=True), batch.y.to(rt.device, non_blocking=True)
            target = y
            if mixup is not None and len(y) > 1:
                if len(y) % 2:  # timm's Mixup pairs samples; odd only after an unreadable file was skipped
                    x, y = x[:-1], y[:-1]
                x, target = mixup(x, y)
            with rt.autocast(rt.train_dtype):
                logits = train_model(x)
            if not len(y):
                loss = logits.sum() * 0.0
            elif mixup is not None and target.dim() == 2:
                loss = torch.sum(-target * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()
            else:
                loss = F.cross_entropy(logits.float(), y, label_smoothing=cfg.train.label_smoothing)
            if cfg.debug.nan_at_step is not None and gstep == cfg.debug.nan_at_step:
                loss = loss * float("nan")
            n = torch.tensor(float(len(y)), device=rt.device)
            stats = rt.all_reduce(torch.stack([loss.detach().float() * n, (logits.argmax(-1) == y).sum().float(), n]))
            if not torch.isfinite(stats[0]):
                raise NonFiniteLossError(_nan_message(scheme, "loss", stats[0].item(), epoch, batch.step, path))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.train.grad_clip:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
                if not torch.isfinite(norm):
                    raise NonFiniteLossError(_nan_message(scheme, "gradient norm", norm.item(), epoch, batch.step,
                                                          path))
            opt.step()
            sched.step()
            sums = [a + b for a, b in zip(sums, stats.tolist(), strict=True)]
            skipped += len(batch.skipped)
            bar.update(1)
            bar.set_postfix(loss=f"{sums[0] / max(sums[2], 1):.3f}")
            done = gstep + 1
            if cfg.train.checkpoint_every and done % cfg.train.checkpoint_every == 0 and batch.step + 1 < steps:
                save(epoch, batch.step + 1, finished=False)
            if cfg.debug.stop_after_steps is not None and done >= cfg.debug.stop_after_steps:
                bar.close()
                raise StopRequested(f"stopped after {done} steps (debug.stop_after_steps)")
        bar.close()
        start_step = 0
        val = None
        if eval_loader is not None:
            val, _, _ = accuracy(model, eval_loader, "resize", cfg.data.img_size, rt)
        row = {
            "epoch": epoch + 1, "step": (epoch + 1) * steps, "lr": opt.param_groups[0]["lr"],
            "train_loss": sums[0] / max(sums[2], 1), "train_acc": 100.0 * sums[1] / max(sums[2], 1),
            "val_acc": val, "skipped": skipped, "drope": not positions_on,
            "seconds": round(seconds_before + time.time() - t0, 1),
        }
        history.append(row)
        sums = [0.0, 0.0, 0.0]
        val_txt = f", val acc {val:.2f}" if val is not None else ""
        log(f"[{scheme.name}] epoch {epoch + 1}/{epochs}: loss {row['train_loss']:.4f}, train acc "
            f"{row['train_acc']:.2f}{val_txt}{', skipped ' + str(skipped) if skipped else ''} ({row['seconds']} s)")
        if rt.is_main:
            write_csv(folder / "log.csv", history)
        save(epoch + 1, 0, finished=epoch + 1 == epochs)
    return TrainResult(model, history, skipped, seconds_before + time.time() - t0)


def _nan_message(scheme: SchemeConfig, what: str, value: float, epoch: int, step: int, path: Path) -> str:
    kept = f"the last good checkpoint is kept: {path}" if path.exists() else "no checkpoint was written yet"
    return (f"[{scheme.name}] {what} became {value} at epoch {epoch + 1}, step {step}; training stopped and "
            f"{kept}. Lower train.lr, set train.grad_clip, or use train.precision=fp32.")
