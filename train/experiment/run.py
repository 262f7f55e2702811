"""One experiment: train every scheme under identical settings, evaluate each, write the report.

Config in, ``RunResult`` out: ``run_experiment`` builds the data and the runtime, trains each entry
(``train.engine.trainer``), evaluates it (``train.evaluation.accuracy``; cached per entry in eval.json),
fine-tunes it at the target size when configured (``train.engine.finetune``; cached in finetune.json), and
writes the run folder (``train.evaluation.report``).
With ``seeds``, the whole run is repeated in ``seed_<k>/`` sub-folders and the run folder gets their
means and standard deviations (``results.combine_seeds``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from torch import nn
from tqdm import tqdm

from ..config.sections import ExperimentConfig, SchemeConfig, scheme_config, to_dict
from ..data.datasets import DataBundle
from ..data.loaders import EvalLoader, TrainLoader, train_sizes
from ..data.sources import build_data
from ..engine import checkpoint as ckpt_io
from ..engine.finetune import finetune
from ..engine.finetune import fingerprint as finetune_fingerprint
from ..engine.models import build_model, configure_eval, preflight, set_positions
from ..engine.progress import CHECKPOINT, SUMMARY
from ..engine.sharded import full_state
from ..engine.trainer import train_scheme
from ..evaluation.accuracy import eval_sizes, evaluate_model
from ..evaluation.convergence import NOT_CHECKED, Convergence
from ..evaluation.report import write_outputs
from ..evaluation.results import (
    Accuracy,
    RunResult,
    SchemeResult,
    TrainSummary,
    accuracy_from_json,
    accuracy_to_json,
    combine_seeds,
)
from ..runtime.process import Runtime, main_first, setup, teardown

Log = Callable[[str], None]


def scheme_folder(run_dir: Path, name: str) -> Path:
    """A file-system-safe folder per scheme entry."""
    return run_dir / re.sub(r"[^A-Za-z0-9._+-]", "_", name)


def run_experiment(cfg: ExperimentConfig, log: Log | None = None, command: str | None = None,
                   report: bool = True) -> RunResult:
    """Train and evaluate every scheme of ``cfg``; write the run folder; return the results.

    ``command`` (the command line that made the run) is recorded in results.json and results.md. Without
    ``report`` the entries' own files are written but not the run's report (results.json, results.md, the plot):
    a part of a run trained in a process of its own leaves the report to the run that assembles it.
    """
    t_start = time.time()
    rt = setup(cfg.device, threads=cfg.threads, progress=cfg.progress, train_precision=cfg.train.precision,
               eval_precision=cfg.eval.precision)
    say = log or (lambda msg: _say(msg) if rt.is_main else None)
    try:
        if cfg.seeds is None:
            return Experiment(cfg, rt, say).run(t_start, command, report)
        runs = {}
        for seed in cfg.seeds:
            one = dataclasses.replace(cfg, seed=seed, seeds=None, out_dir=str(cfg.run_dir / f"seed_{seed}"))
            runs[seed] = Experiment(one, rt, say).run(time.time(), command)
        results = combine_seeds(runs, name=cfg.name, config=to_dict(cfg), command=command,
                                wall_seconds=round(time.time() - t_start, 1))
        if rt.is_main:
            (cfg.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            table = write_outputs(results, cfg.run_dir)
            say(f"\n{cfg.name}, mean +- std over seeds {', '.join(map(str, cfg.seeds))}:\n" + table +
                f"\n\nwritten: {cfg.run_dir}/results.json, results.md, accuracy.png ({results.wall_seconds:.0f} s)")
        return results
    finally:
        teardown()


class Experiment:
    """The shared pieces of one run (data, evaluation sizes and loader) and the loop over its entries."""

    def __init__(self, cfg: ExperimentConfig, rt: Runtime, say: Log) -> None:
        self.cfg, self.rt, self.say = cfg, rt, say
        patch = preflight(cfg)  # config_from_dict ran it too; cheap (meta device), and cfg may be built by hand
        self.data: DataBundle = build_data(cfg.data)
        self.sizes = eval_sizes(cfg.eval, cfg.data.img_size, patch)
        self.train_sizes = train_sizes(cfg.train, cfg.data.img_size, patch)
        for bs in {cfg.train.batch_size, cfg.finetune.batch_size or cfg.train.batch_size}:  # checks the data size
            TrainLoader(self.data, cfg.data, batch_size=bs, seed=cfg.seed, dist=rt.dist)
        self.grid = (cfg.data.img_size // patch, cfg.data.img_size // patch)
        self.loader = EvalLoader(self.data, cfg.data, cfg.eval, seed=cfg.seed, dist=rt.dist, patch_size=patch)

    def _model(self, scheme: SchemeConfig) -> nn.Module:
        return build_model(self.cfg.model, scheme, img_size=self.cfg.data.img_size,
                           num_classes=self.data.num_classes, in_chans=self.data.in_chans, seed=self.cfg.seed)

    def run(self, t_start: float, command: str | None, report: bool = True) -> RunResult:
        cfg, rt, run_dir = self.cfg, self.rt, self.cfg.run_dir
        with main_first(rt):
            run_dir.mkdir(parents=True, exist_ok=True)
        if rt.is_main:
            (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        self.say(f"{cfg.name} (seed {cfg.seed}): {len(self.data.train)} training images at {self.train_sizes} px, "
                 f"{self.data.num_classes} classes, {len(self.loader)} evaluation images at {self.sizes} px "
                 f"({', '.join(cfg.eval.protocols)}); "
                 f"{sum(s.trains for s in cfg.schemes)} schemes to train, run folder {run_dir}, device {rt.device}, "
                 f"{rt.dist.world} process(es)")
        results = RunResult(
            name=cfg.name, train_size=cfg.data.img_size, sizes=self.sizes, protocols=list(cfg.eval.protocols),
            eval_images=len(self.loader), canvas=self.data.canvas or _canvas_text(cfg), device=str(rt.device),
            processes=rt.dist.world, command=command, schemes={}, config=to_dict(cfg), seeds=[cfg.seed],
        )
        for s in cfg.schemes:
            results.schemes[s.name] = r = self.entry(s)
            top, train = max(self.sizes), cfg.data.img_size
            self.say(f"[{s.name}] accuracy at {train} / {top} px: " + ", ".join(
                f"{p} {r.accuracy[p].get(train, float('nan')):.1f} / {r.accuracy[p][top]:.1f}"
                for p in cfg.eval.protocols) + "".join(
                f"; fine-tuned at {size} px: {acc:.1f}" for size, acc in r.finetuned.get("resize", {}).items()))
            if r.train is not None:
                self.say(f"[{s.name}] converged: {converged_text(r.train.convergence(cfg.train.converged_within))}")
        results.wall_seconds = round(time.time() - t_start, 1)
        if rt.is_main and report:
            table = write_outputs(results, run_dir)
            self.say("\n" + table + f"\n\nwritten: {run_dir}/results.json, results.md, accuracy.png "
                     f"({results.wall_seconds:.0f} s)")
        return results

    def entry(self, s: SchemeConfig) -> SchemeResult:
        """Train the entry (or load its base model) and evaluate it, reusing a matching eval.json."""
        folder = scheme_folder(self.cfg.run_dir, s.name)
        fp = self._eval_fingerprint(s)
        cached = _cached(folder / "eval.json", fp) if self.cfg.resume else None
        summary: TrainSummary | None = None
        model: nn.Module | None = None
        if s.trains:  # the weights only where this run evaluates or fine-tunes them (else a kept summary will do)
            needed = cached is None or self.cfg.finetune.size is not None
            trained = train_scheme(self.cfg, s, self.data, self.rt, folder, log=self.say, need_weights=needed)
            model, summary = trained.model, trained.summary
        if cached is not None:
            acc, skipped = accuracy_from_json(cached["accuracy"]), cached["skipped_images"]
        else:
            if model is None:
                model = self._load_trained(self.cfg.scheme(s.base))  # type: ignore[arg-type]
            configure_eval(model, s, self.grid)
            acc, skipped = evaluate_model(model, self.loader, self.cfg.eval.protocols, self.sizes, self.rt,
                                          desc=f"eval {s.name}", log=self.say)
            if self.rt.is_main:
                _write_cache(folder / "eval.json", fp, acc, skipped)
        result = SchemeResult(s, summary, acc, skipped)
        if self.cfg.finetune.size is not None and s.trains:
            assert model is not None
            result.finetuned, result.finetune_seconds = self.finetuned(s, model, folder)
        return result

    def finetuned(self, s: SchemeConfig, model: nn.Module, folder: Path) -> tuple[Accuracy, float]:
        """Fine-tune a copy of the trained model at the target size and evaluate it there (resize protocol);
        reuses a matching finetune.json."""
        size = self.cfg.finetune.size
        assert size is not None
        ev = {k: v for k, v in to_dict(self.cfg.eval).items() if k != "batch_size"}
        fp = {**finetune_fingerprint(self.cfg, s), "eval": ev}
        cached = _cached(folder / "finetune.json", fp) if self.cfg.resume else None
        if cached is not None:
            return accuracy_from_json(cached["accuracy"]), float(cached["seconds"])
        tuned, seconds = finetune(scheme_config(self.cfg, s), s, model, self.data, self.rt, folder, log=self.say)
        acc, _ = evaluate_model(tuned, self.loader, ["resize"], [size], self.rt, desc=f"eval {s.name} fine-tuned")
        if self.rt.is_main:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "finetune.json").write_text(json.dumps(
                {"fingerprint": fp, "accuracy": accuracy_to_json(acc), "seconds": seconds}, indent=2))
        return acc, seconds

    def _eval_fingerprint(self, scheme: SchemeConfig) -> dict[str, Any]:
        """What determines an entry's accuracies: its trained model's fingerprint and the evaluation settings."""
        cfg = self.cfg
        base = cfg.scheme(scheme.base) if scheme.base else scheme
        ev = {k: v for k, v in to_dict(cfg.eval).items() if k != "batch_size"}
        return {"train": ckpt_io.fingerprint(cfg, base), "eval": ev, "sizes": self.sizes, "scaling": scheme.scaling,
                "scaling_options": scheme.scaling_options, "log_n_attention": scheme.log_n_attention}

    def _load_trained(self, base: SchemeConfig) -> nn.Module:
        """The final weights of a trained scheme of this run (for evaluation-only entries); trained again when the
        run folder keeps only its summary (``train.engine.progress.SUMMARY``)."""
        folder = scheme_folder(self.cfg.run_dir, base.name)
        path = folder / CHECKPOINT
        if not path.exists() and (folder / SUMMARY).exists():
            self.say(f"[{base.name}] trained again: its weights are not kept in {folder} (summary.json only)")
            model = train_scheme(self.cfg, base, self.data, self.rt, folder, log=self.say).model
            assert model is not None
            return model
        ck = ckpt_io.load(path)
        if not ck["finished"]:
            raise ckpt_io.CheckpointError(f"{path} is not a finished training run; rerun the config to finish it")
        model = self._model(base)
        if ck.get("shards"):  # an fsdp run's: its weights read from the shard folder
            model.load_state_dict(full_state(path.parent / ck["shards"]))
        else:
            model.load_state_dict(ck["model"] if ck.get("ema") is None else ck["ema"])  # the EMA's with train.ema
        if base.drope > 0:
            set_positions(model, False)
        return model.to(self.rt.device)


def converged_text(verdict: Convergence | None) -> str:
    """The log's convergence verdict: ``yes (gain +0.2 ± 0.3 points over the last fifth)``."""
    if verdict is None:
        return NOT_CHECKED
    return (f"{'yes' if verdict.converged else 'no'} (gain {verdict.gain:+.1f} ± {verdict.noise:.1f} points over "
            "the last fifth)")


def _say(msg: str) -> None:
    """A log line on stdout, around any progress bar, flushed: a log file (nohup, slurm) gets it at once."""
    tqdm.write(msg)
    sys.stdout.flush()


def _canvas_text(cfg: ExperimentConfig) -> str:
    fill = "the dataset background" if cfg.eval.canvas_fill is None else f"value {cfg.eval.canvas_fill}"
    snap = ", offsets snapped to the patch grid" if cfg.eval.canvas_snap else ""
    return (f"{cfg.eval.canvas_position} placement on {fill}{snap}; below the training size the image is "
            f"{'centre' if cfg.eval.canvas_position == 'center' else 'randomly'}-cropped at training scale")


def _cached(path: Path, fp: dict[str, Any]) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return saved if saved.get("fingerprint") == json.loads(json.dumps(fp)) else None


def _write_cache(path: Path, fp: dict[str, Any], acc: Accuracy, skipped: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"fingerprint": fp, "accuracy": accuracy_to_json(acc), "skipped_images": skipped},
                               indent=2))
