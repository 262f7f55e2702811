"""Training one scheme: checkpoints, exact resume, DroPE, multi-resolution steps, EMA, NaN guard, per-epoch CSV log,
the validation curve.

``SchemeTrainer`` holds what one scheme's training needs (model, its EMA, optimiser, schedule, loader) and
where it stands (``Progress``); a checkpoint stores both, so a killed run resumes at the step it stopped.

A finished training also writes ``summary.json`` (how it went, with its config's fingerprint) beside the checkpoint.
The summary and the entry's ``eval.json`` are a few kilobytes: a run folder kept without its checkpoints (committed
with the results, carried to another machine) still counts its entries as finished, and they are trained again
only where their weights are needed (an evaluation the cache does not hold).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from timm.utils import ModelEmaV3
from torch import nn
from tqdm import tqdm

from ..config.sections import ConfigError, ExperimentConfig, SchemeConfig, scheme_config, to_dict
from ..data.datasets import DataBundle
from ..data.loaders import Batch, EvalLoader, TrainLoader, train_sizes
from ..evaluation.accuracy import top1
from ..evaluation.results import TrainSummary
from ..runtime.parallel import shard, wrap
from ..runtime.process import Runtime
from ..runtime.seeds import mix_seed, seed_everything
from . import checkpoint as ckpt_io
from . import sharded
from .log import write_csv
from .models import build_model, patch_size_of, set_positions
from .optim import make_optimizer, make_scheduler
from .progress import CHECKPOINT, SUMMARY, Progress, kept_summary, size_counts


class NonFiniteLossError(RuntimeError):
    """The loss (or gradient norm) became NaN/inf; the last good checkpoint is kept."""


class StopRequested(RuntimeError):
    """debug.stop_after_steps reached: simulates a run killed mid-epoch."""


@dataclass
class TrainResult:
    model: nn.Module | None  # the weights to evaluate (their EMA with train.ema), positions switched off for a DroPE
    summary: TrainSummary  # entry; None: the training finished elsewhere and only its summary is kept (summary.json)


def loss_of(logits: torch.Tensor, y: torch.Tensor, target: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """Cross-entropy on hard labels or mixed soft targets ([B, classes]); 0 for an empty batch."""
    if not len(y):
        return logits.sum() * 0.0
    if target.dim() == 2:
        return torch.sum(-target * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()
    return F.cross_entropy(logits.float(), y, label_smoothing=label_smoothing)


def train_scheme(cfg: ExperimentConfig, scheme: SchemeConfig, data: DataBundle, rt: Runtime, folder: Path,
                 log: Callable[[str], None] = print, *, need_weights: bool = True) -> TrainResult:
    """Train one scheme (or resume it, or load it when already finished). Without ``need_weights``, a training
    finished in a folder whose checkpoint is gone (its ``summary.json`` kept) gives its summary and no model."""
    if cfg.resume and not (folder / CHECKPOINT).exists():  # before building anything for the training
        summary = kept_summary(folder, ckpt_io.fingerprint(cfg, scheme))
        if summary is not None and not need_weights:
            return TrainResult(None, summary)
    return SchemeTrainer(cfg, scheme, data, rt, folder, log).run()


class SchemeTrainer:
    """One scheme's training under the experiment's shared settings."""

    def __init__(self, cfg: ExperimentConfig, scheme: SchemeConfig, data: DataBundle, rt: Runtime, folder: Path,
                 log: Callable[[str], None]) -> None:
        cfg = scheme_config(cfg, scheme)  # the entry's own training levers, if any
        self.cfg, self.scheme, self.data, self.rt, self.folder, self.log = cfg, scheme, data, rt, folder, log
        self.path = folder / CHECKPOINT
        self.model = build_model(cfg.model, scheme, img_size=cfg.data.img_size, num_classes=data.num_classes,
                                 in_chans=data.in_chans, seed=cfg.seed).to(rt.device)
        # timm's EMA (as train.py --model-ema), a copy of the model averaged after every optimiser step
        self.ema = ModelEmaV3(self.model, decay=cfg.train.ema_decay, use_warmup=cfg.train.ema_warmup) \
            if cfg.train.ema else None
        self.fsdp = cfg.train.strategy == "fsdp"
        if self.fsdp:  # before the optimiser: it holds the shards
            shard(self.model, cfg.train, rt)
        self.opt = make_optimizer(self.model, cfg.train)
        sizes = train_sizes(cfg.train, cfg.data.img_size, patch_size_of(self.model))
        self.loader = TrainLoader(data, cfg.data, batch_size=cfg.train.batch_size, seed=cfg.seed, dist=rt.dist,
                                  sizes=sizes)
        self.steps = len(self.loader)
        self.total = self.steps * cfg.train.epochs
        self.sched = make_scheduler(self.opt, cfg.train, self.total)
        self.drope_start = self.total - int(round(scheme.drope * self.total)) if scheme.drope > 0 else None
        self.positions_on = True
        self.fingerprint = ckpt_io.fingerprint(cfg, scheme)
        self.progress = Progress()
        self.started: float | None = None  # when this process started training (None: not yet)
        if rt.is_main:
            folder.mkdir(parents=True, exist_ok=True)

    # -- checkpoints

    def _restore(self) -> bool:
        """Load the checkpoint when there is one to continue; True when it is a finished run."""
        if not (self.path.exists() and self.cfg.resume):
            return False
        ck = ckpt_io.load(self.path)
        diff = ckpt_io.fingerprint_diff(ck["fingerprint"], self.fingerprint)
        if diff:
            raise ConfigError(
                f"{self.path} was trained with a different config (differs in: {', '.join(diff)}); "
                "set resume=false to start it over, or choose another out_dir"
            )
        if self.fsdp:  # a sharded checkpoint: each process reads its shards of the weights and optimiser state
            sharded.load(self.model, self.opt, self.folder / ck["shards"])
        else:
            self.model.load_state_dict(ck["model"])
        if self.ema is not None:  # the fingerprint includes train.ema: the checkpoint holds the EMA
            self.ema.module.load_state_dict(ck["ema"])
        pos = ck["position"]
        history = list(ck["history"])  # a checkpoint made before the curve: its epoch ends
        curve = ck.get("curve", [[r["step"], r["val_acc"]] for r in history if r.get("val_acc") is not None])
        self.progress = Progress(pos["epoch"], pos["step"], list(ck["epoch_sums"]), history, int(ck["skipped"]),
                                 float(ck["seconds"]), [int(s) for s in ck["sizes_drawn"]], [list(c) for c in curve])
        if ck["finished"]:  # the weights are all that is needed
            if self.drope_start is not None:
                self._positions_off()
            return True
        if not self.fsdp:
            self.opt.load_state_dict(ck["optimizer"])
        self.sched.load_state_dict(ck["scheduler"])
        ckpt_io.set_rng_state(ck["rng"])
        self.log(f"[{self.scheme.name}] resuming from {self.path} at epoch {pos['epoch'] + 1}, step {pos['step']}")
        return False

    def _seconds(self) -> float:
        return self.progress.seconds + (time.time() - self.started if self.started is not None else 0.0)

    def _save(self, epoch: int, step: int, finished: bool) -> None:
        p, data, gstep = self.progress, self.data, epoch * self.steps + step
        if finished:  # the clock stops here, so the summary states the checkpoint's time (a rerun rewrites it equal)
            p.seconds, self.started = self._seconds(), None
        shards = sharded.save(self.model, self.opt, self.folder, gstep, self.rt) if self.fsdp else None
        if self.rt.is_main:
            ckpt_io.atomic_save({
                "format": ckpt_io.FORMAT, "shards": shards, "model": None if shards else self.model.state_dict(),
                "optimizer": None if shards else self.opt.state_dict(),
                "ema": None if self.ema is None else self.ema.module.state_dict(),
                "scheduler": self.sched.state_dict(), "rng": ckpt_io.rng_state(),
                "position": {"epoch": epoch, "step": step, "global_step": gstep},
                "epoch_sums": list(p.sums), "history": p.history, "skipped": p.skipped, "finished": finished,
                "sizes_drawn": list(p.drawn), "curve": [list(c) for c in p.curve],
                "seconds": self._seconds(), "fingerprint": self.fingerprint, "config": to_dict(self.cfg),
                "scheme": to_dict(self.scheme), "classes": list(data.classes), "in_chans": data.in_chans,
                "mean": list(data.mean), "std": list(data.std), "background": list(data.background),
            }, self.path)
            if shards:
                sharded.prune(self.folder, shards)
        self.rt.barrier()

    # -- training

    def _wrapped(self) -> nn.Module:
        """The module the forward pass runs through: compiled and / or DDP-wrapped as configured."""
        # DroPE leaves the scheme's own parameters (if any) without gradients once positions are off
        pos_params = getattr(self.model, "vispos", None)
        unused = self.drope_start is not None and pos_params is not None and any(
            p.requires_grad for p in pos_params.parameters())
        return wrap(self.model, self.cfg.train, self.rt, unused_parameters=unused)

    def _mixup(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
        t = self.cfg.train
        if t.mixup <= 0 and t.cutmix <= 0:
            return None
        from timm.data import Mixup

        return Mixup(mixup_alpha=t.mixup, cutmix_alpha=t.cutmix, label_smoothing=t.label_smoothing,
                     num_classes=self.data.num_classes)

    def _step(self, forward: nn.Module, mixup: Any, batch: Batch, epoch: int) -> None:
        """One optimiser step on ``batch``; adds its loss and accuracy to the epoch's sums."""
        cfg, rt = self.cfg, self.rt
        gstep = epoch * self.steps + batch.step
        if self.drope_start is not None and gstep >= self.drope_start and self.positions_on:
            self._positions_off()
        seed_everything(mix_seed(cfg.seed, gstep, rt.dist.rank, modulus=2**31))  # dropout, mixup: per step
        x, y = batch.x.to(rt.device, non_blocking=True), batch.y.to(rt.device, non_blocking=True)
        target = y
        if mixup is not None and len(y) > 1:
            if len(y) % 2:  # timm's Mixup pairs samples; odd only after an unreadable file was skipped
                x, y = x[:-1], y[:-1]
            x, target = mixup(x, y)
        with rt.autocast(rt.train_dtype):
            logits = forward(x)
        loss = loss_of(logits, y, target, cfg.train.label_smoothing)
        if cfg.debug.nan_at_step is not None and gstep == cfg.debug.nan_at_step:
            loss = loss * float("nan")
        n = torch.tensor(float(len(y)), device=rt.device)
        stats = rt.all_reduce(torch.stack([loss.detach().float() * n, (logits.argmax(-1) == y).sum().float(), n]))
        if not torch.isfinite(stats[0]):
            raise NonFiniteLossError(self._nan_message("loss", stats[0].item(), epoch, batch.step))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.train.grad_clip:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.train.grad_clip)
            if not torch.isfinite(norm):
                raise NonFiniteLossError(self._nan_message("gradient norm", norm.item(), epoch, batch.step))
        self.opt.step()
        self.sched.step()
        if self.ema is not None:
            self.ema.update(self.model, step=gstep + 1)  # as timm's train.py: the number of updates so far
        self.progress.sums = [a + b for a, b in zip(self.progress.sums, stats.tolist(), strict=True)]
        self.progress.skipped += len(batch.skipped)
        self.progress.drawn.append(batch.x.shape[-1])

    def _validate(self, eval_loader: EvalLoader, done: int) -> float:
        """Top-1 at the training size after ``done`` steps, added to the curve; every RNG left as it was."""
        rng = ckpt_io.rng_state()
        val = top1(self.evaluated, eval_loader, "resize", self.cfg.data.img_size, self.rt)[0]
        ckpt_io.set_rng_state(rng)
        self.progress.curve.append([done, val])
        return val

    def _end_epoch(self, epoch: int, eval_loader: EvalLoader | None) -> None:
        """Validation at the training size, the log row, the CSV and an end-of-epoch checkpoint."""
        p, t = self.progress, self.cfg.train
        done, val = (epoch + 1) * self.steps, None
        if eval_loader is not None and (t.val_every_epoch or (t.val_every and done % t.val_every == 0)):
            val = self._validate(eval_loader, done)
        loss_sum, correct, n = p.sums
        row = {
            "epoch": epoch + 1, "step": done, "lr": self.opt.param_groups[0]["lr"],
            "train_loss": loss_sum / max(n, 1), "train_acc": 100.0 * correct / max(n, 1), "val_acc": val,
            "skipped": p.skipped, "drope": not self.positions_on, "sizes": size_counts(p.drawn[-self.steps:]),
            "seconds": round(self._seconds(), 1),
        }
        p.history.append(row)
        p.sums = [0.0, 0.0, 0.0]
        val_txt = f", val acc{' (EMA)' if self.ema is not None else ''} {val:.2f}" if val is not None else ""
        skipped_txt = f", skipped {p.skipped}" if p.skipped else ""
        self.log(f"[{self.scheme.name}] epoch {epoch + 1}/{t.epochs}: loss {row['train_loss']:.4f}, train acc "
                 f"{row['train_acc']:.2f}{val_txt}{skipped_txt} ({row['seconds']} s)")
        if self.rt.is_main:
            write_csv(self.folder / "log.csv", p.history)
        self._save(epoch + 1, 0, finished=epoch + 1 == t.epochs)

    def run(self) -> TrainResult:
        if self._restore():
            return self._result()
        forward, mixup = self._wrapped(), self._mixup()
        eval_loader = None
        if self.cfg.train.val_every_epoch or self.cfg.train.val_every:
            eval_loader = EvalLoader(self.data, self.cfg.data, self.cfg.eval, seed=self.cfg.seed, dist=self.rt.dist,
                                     patch_size=patch_size_of(self.model))
        t, debug, p = self.cfg.train, self.cfg.debug, self.progress
        self.started = time.time()
        for epoch in range(p.epoch, t.epochs):
            self.model.train()
            bar = tqdm(total=self.steps, initial=p.step, desc=f"{self.scheme.name} {epoch + 1}/{t.epochs}",
                       leave=False, disable=not self.rt.progress, dynamic_ncols=True)
            for batch in self.loader.epoch(epoch, p.step):
                self._step(forward, mixup, batch, epoch)
                bar.update(1)
                bar.set_postfix(loss=f"{p.sums[0] / max(p.sums[2], 1):.3f}")
                done = epoch * self.steps + batch.step + 1
                if self.rt.lines and t.log_every and done % t.log_every == 0:
                    self._progress_line(epoch, batch.step + 1, done)
                if eval_loader is not None and t.val_every and done % t.val_every == 0 and batch.step + 1 < self.steps:
                    val = self._validate(eval_loader, done)  # (the epoch's last step: its end validates)
                    if t.log_every and done % t.log_every == 0:  # in the log at the progress lines' pace
                        self.log(f"[{self.scheme.name}] step {done}/{self.total}: val acc {val:.2f}")
                if t.checkpoint_every and done % t.checkpoint_every == 0 and batch.step + 1 < self.steps:
                    self._save(epoch, batch.step + 1, finished=False)
                if debug.stop_after_steps is not None and done >= debug.stop_after_steps:
                    bar.close()
                    raise StopRequested(f"stopped after {done} steps (debug.stop_after_steps)")
            bar.close()
            p.step = 0
            self._end_epoch(epoch, eval_loader)
        return self._result()

    @property
    def evaluated(self) -> nn.Module:
        """The weights evaluated: the EMA's with train.ema, an unsharded copy with fsdp, else the model's own."""
        if self.fsdp:
            return self._full_copy()
        return self.model if self.ema is None else self.ema.module

    def _full_copy(self) -> nn.Module:
        """An fsdp model's weights gathered into a plain model on every process (evaluation runs it alone)."""
        cfg, data = self.cfg, self.data
        model = build_model(cfg.model, self.scheme, img_size=cfg.data.img_size, num_classes=data.num_classes,
                            in_chans=data.in_chans, seed=cfg.seed)
        model.load_state_dict(sharded.full_model_state(self.model))
        if not self.positions_on:
            set_positions(model, False)
        return model.to(self.rt.device)

    def _positions_off(self) -> None:
        """DroPE: the scheme switched off in the model and its EMA."""
        for model in (self.model, *([] if self.ema is None else [self.ema.module])):
            set_positions(model, False)
        self.positions_on = False

    def _progress_line(self, epoch: int, step: int, done: int) -> None:
        """A plain line for a log file (nohup, slurm), where tqdm's bar is not shown."""
        p = self.progress
        self.log(f"[{self.scheme.name}] epoch {epoch + 1}/{self.cfg.train.epochs}, step {step}/{self.steps} "
                 f"({done}/{self.total}): loss {p.sums[0] / max(p.sums[2], 1):.4f}, "
                 f"lr {self.opt.param_groups[0]['lr']:.3g} ({self._seconds():.0f} s)")

    def _result(self) -> TrainResult:
        p = self.progress
        last = p.history[-1] if p.history else {}
        summary = TrainSummary(seconds=self._seconds(), epochs=self.cfg.train.epochs,
                               train_loss=last.get("train_loss"), train_acc=last.get("train_acc"),
                               val_acc=last.get("val_acc"), skipped_images=p.skipped, history=p.history,
                               weights="final" if self.ema is None else "ema", curve=p.curve, total_steps=self.total)
        if self.rt.is_main:  # finished (a training, or a finished checkpoint loaded): its summary, kept without it
            (self.folder / SUMMARY).write_text(json.dumps(
                {"fingerprint": self.fingerprint, "summary": dataclasses.asdict(summary)}, indent=1))
        return TrainResult(self.evaluated, summary)

    def _nan_message(self, what: str, value: float, epoch: int, step: int) -> str:
        kept = "no checkpoint was written yet"
        if self.path.exists():
            kept = f"the last good checkpoint is kept: {self.path}"
        return (f"[{self.scheme.name}] {what} became {value} at epoch {epoch + 1}, step {step}; training stopped "
                f"and {kept}. Lower train.lr, set train.grad_clip, or use train.precision=fp32.")
