"""One generation run (``task: generation``): every entry's DiT trained (``train.engine.diffusion``), sampled at each
size under each entry's inference setting, scored (``train.evaluation.scores``), reported
(``train.evaluation.generation_report``).

The data protocol is the classifier's native one: the DiT trains on Fashion-MNIST downsampled to ``data.img_size``
(antialiased), and the samples at each size are compared with the test set at that size: downsampled below 28 px,
Fashion-MNIST's own images at 28 px, upsampled (bicubic) above. Each entry folder keeps ``scores.json`` (its scores
per size with the fingerprint that made them: a rerun skips a matching one), ``summary.json`` (training time, loss)
and a sample grid per size (``samples_<size>.png``, one row per class); checkpoints stay uncommitted. The scorer is
trained once per run folder (``scorer.pt``, keyed by its settings) and shared by the seeds and parallel jobs.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor, nn
from torchvision.utils import save_image

import vispos

from ..config.generation import GenerationConfig, GenSchemeConfig, with_seed
from ..config.schema import ConfigError
from ..config.sections import to_dict
from ..data.sources import FMNIST_CLASSES, find_fashion_mnist, first_per_class, load_fashion_mnist
from ..engine.checkpoint import FORMAT, atomic_save, load
from ..engine.diffusion import build_dit, fingerprint, sample, train_dit
from ..evaluation.generation_report import combine, write_report
from ..evaluation.scores import ScorerNet, resample, score_images, train_scorer
from ..runtime.process import Runtime, main_first, setup, teardown
from .run import _cached, _say, scheme_folder

Log = Callable[[str], None]
SCORER = "scorer.pt"
REFERENCE_TEXT = ("the Fashion-MNIST test set at each size: downsampled (antialiased) below 28 px, its own 28 px "
                  "images at 28 px, upsampled (bicubic) above; the DiT trains on the training set downsampled to the "
                  "training size (the classifier's native protocol)")  # fmt: skip


def scorer_path(cfg: GenerationConfig) -> Path:
    """Where the run's scorer is cached: the run folder of the whole run (above ``seed_<k>/``)."""
    run_dir = cfg.run_dir
    return (run_dir.parent if run_dir.name.startswith("seed_") else run_dir) / SCORER


def get_scorer(cfg: GenerationConfig, log: Log) -> ScorerNet:
    """The cached scorer when its settings match, else trained (fixed seed) and cached."""
    path, settings = scorer_path(cfg), to_dict(cfg.scores) | {"root": cfg.data.root}
    settings.pop("reference_images")
    if path.is_file():
        saved = load(path, required=("settings", "model"))
        if saved["settings"] == settings:
            net = ScorerNet()
            net.load_state_dict(saved["model"])
            return net.eval()
    log(f"training the scorer ({cfg.scores.epochs} epochs on Fashion-MNIST at 28 px, seed {cfg.scores.seed})")
    images, labels = load_fashion_mnist(find_fashion_mnist(cfg.data.root), "train")
    if cfg.scores.train_images is not None:
        images, labels = images[: cfg.scores.train_images], labels[: cfg.scores.train_images]
    net = train_scorer(images, labels, epochs=cfg.scores.epochs, seed=cfg.scores.seed)
    atomic_save({"format": FORMAT, "settings": settings, "model": net.state_dict()}, path)
    return net


def balanced_labels(n: int, classes: int) -> Tensor:
    """n labels cycling through the classes (each class n / classes times)."""
    return torch.arange(n) % classes


class GenerationRun:
    """One seed's run: the data, the scorer, the reference sets and floors, and the loop over the entries."""

    def __init__(self, cfg: GenerationConfig, rt: Runtime, say: Log) -> None:
        self.cfg, self.rt, self.say = cfg, rt, say
        folder = find_fashion_mnist(cfg.data.root)
        images, labels = load_fashion_mnist(folder, "train")
        keep = first_per_class(labels.tolist(), cfg.data.train_per_class)
        small = resample(images[keep].float() / 255, cfg.data.img_size)
        self.images, self.labels = small * 2 - 1, labels[keep]
        self.num_classes = len(FMNIST_CLASSES)
        test, self.test_labels = load_fashion_mnist(folder, "val")
        self.test = test.float() / 255
        half = len(self.test) // 2
        n_ref = min(cfg.scores.reference_images, half)
        self.first, self.second = slice(0, min(cfg.sample.images, half)), slice(half, half + n_ref)
        with main_first(rt):  # trained (or read) by one process, then read by the others
            self.scorer = get_scorer(cfg, say)
        self.reference = {size: resample(self.test[self.second], size) for size in cfg.sizes}

    def floors(self) -> dict[str, dict[str, float]]:
        """Each score of real images (the test set's first half) against the reference (its second half)."""
        out = {}
        for size in self.cfg.sizes:
            real = resample(self.test[self.first], size)
            scores = score_images(self.scorer, real, self.test_labels[self.first], self.reference[size],
                                  crop=self.cfg.data.img_size, seed=self.cfg.seed)  # fmt: skip
            out[str(size)] = scores.to_json()
        return out

    def run(self, command: str | None) -> dict[str, Any]:
        cfg, run_dir = self.cfg, self.cfg.run_dir
        with main_first(self.rt):
            run_dir.mkdir(parents=True, exist_ok=True)
        if self.rt.is_main:
            (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        self.say(f"{cfg.name} (seed {cfg.seed}): {len(self.labels)} training images at {cfg.data.img_size} px, "
                 f"samples at {cfg.sizes} px, {sum(s.trains for s in cfg.schemes)} entries to train, run folder "
                 f"{run_dir}")  # fmt: skip
        results: dict[str, Any] = {
            "name": cfg.name, "task": "generation", "command": command, "seeds": [cfg.seed],
            "train_size": cfg.data.img_size, "sizes": cfg.sizes, "reference": REFERENCE_TEXT,
            "images": cfg.sample.images, "reference_images": len(self.reference[cfg.sizes[0]]),
            "floor": self.floors(), "config": to_dict(cfg), "schemes": {},
        }  # fmt: skip
        models: dict[str, nn.Module] = {}
        for entry in cfg.schemes:
            results["schemes"][entry.name] = self.entry(entry, models)
        return results

    def _sample_fingerprint(self, entry: GenSchemeConfig) -> dict[str, Any]:
        base = self.cfg.scheme(entry.base) if entry.base else entry
        return {"train": fingerprint(self.cfg, base), "sample": to_dict(self.cfg.sample),
                "scores": to_dict(self.cfg.scores), "scaling": entry.scaling,
                "scaling_options": entry.scaling_options, "log_n_attention": entry.log_n_attention}  # fmt: skip

    def _trained(self, entry: GenSchemeConfig, models: dict[str, nn.Module]) -> nn.Module:
        name = entry.base or entry.name
        if name not in models:
            base = self.cfg.scheme(name)
            folder = scheme_folder(self.cfg.run_dir, name)
            trained = train_dit(self.cfg, base, self.images, self.labels, self.num_classes, self.rt, folder, self.say)
            summary = {"fingerprint": fingerprint(self.cfg, base), "seconds": round(trained.seconds, 1),
                       "loss": trained.loss}
            if self.rt.is_main:
                _write_json(folder / "summary.json", summary)
            self.rt.barrier()
            models[name] = trained.model
        return models[name]

    def entry(self, entry: GenSchemeConfig, models: dict[str, nn.Module]) -> dict[str, Any]:
        """Train (or resume) the entry's model, then sample and score it at every size, reusing a matching
        scores.json."""
        cfg, folder = self.cfg, scheme_folder(self.cfg.run_dir, entry.name)
        fp = self._sample_fingerprint(entry)
        cached = _cached(folder / "scores.json", fp) if cfg.resume else None
        base_folder = scheme_folder(cfg.run_dir, entry.base or entry.name)
        if cached is None:
            model = self._trained(entry, models)  # under torchrun: every process trains (DDP)
            if self.rt.is_main:  # one process samples and scores; the others read its scores
                scores = self.sample_and_score(entry, model, folder)
                _write_json(folder / "scores.json", {"fingerprint": fp, "scores": scores})
            self.rt.barrier()
            if not self.rt.is_main:
                scores = json.loads((folder / "scores.json").read_text())["scores"]
        else:
            scores = cached["scores"]
        summary_path = base_folder / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        top = str(max(cfg.sizes))
        self.say(f"[{entry.name}] FID at " + ", ".join(f"{s} px {scores[str(s)]['fid']:.1f}" for s in cfg.sizes)
                 + f"; accuracy at {top} px {scores[top]['accuracy']:.1f}%")  # fmt: skip
        record: dict[str, Any] = {"base": entry.base, "scores": {str(cfg.seed): scores}}
        if entry.trains:
            record |= {"train_seconds": {str(cfg.seed): summary.get("seconds")},
                       "loss": {str(cfg.seed): summary.get("loss")}}  # fmt: skip
        return record

    def sample_and_score(self, entry: GenSchemeConfig, model: nn.Module, folder: Path) -> dict[str, Any]:
        cfg, s = self.cfg, self.cfg.sample
        setting = entry.scaling is not None or entry.log_n_attention
        if setting:
            vispos.configure(model, scaling=entry.scaling, log_n_attention=entry.log_n_attention,
                             **entry.scaling_options)  # fmt: skip
        try:
            labels = balanced_labels(s.images, self.num_classes)
            out = {}
            for size in cfg.sizes:
                start = time.time()
                images = sample(model, labels, size, steps=s.steps, guidance=s.guidance, seed=cfg.seed,
                                batch_size=s.batch_size, num_classes=self.num_classes,
                                device=self.rt.device)  # fmt: skip
                scores = score_images(self.scorer, images, labels, self.reference[size], crop=cfg.data.img_size,
                                      seed=cfg.seed).to_json()  # fmt: skip
                out[str(size)] = scores | {"seconds": round(time.time() - start, 1)}
                rows = [images[labels == c][:8] for c in range(self.num_classes)]  # one row per class, white-padded
                grid = torch.cat([torch.cat((r, r.new_ones((8 - len(r), *r.shape[1:])))) for r in rows])
                folder.mkdir(parents=True, exist_ok=True)
                save_image(grid, folder / f"samples_{size}.png", nrow=8, padding=1, pad_value=1.0)
            return out
        finally:
            if setting:
                vispos.configure(model, scaling=None, log_n_attention=False)


def run_generation(cfg: GenerationConfig, command: str | None = None, report: bool = True,
                   log: Log | None = None) -> dict[str, Any]:  # fmt: skip
    """Train, sample and score every entry of ``cfg`` (per seed with ``seeds``); write the report."""
    t0 = time.time()
    rt = setup(cfg.device, threads=cfg.threads, progress=cfg.progress, train_precision=cfg.train.precision,
               eval_precision="auto")  # fmt: skip
    say = log or (lambda msg: _say(msg) if rt.is_main else None)
    try:
        seeds = cfg.seeds or [cfg.seed]
        runs = []
        for seed in seeds:
            one = with_seed(cfg, seed, str(cfg.run_dir / f"seed_{seed}")) if cfg.seeds else cfg
            result = GenerationRun(one, rt, say).run(command)
            if cfg.seeds and rt.is_main and report:
                write_report(result, one.run_dir)
            runs.append(result)
        results = combine(runs, command=command) | {"wall_seconds": round(time.time() - t0, 1)}
        if rt.is_main and report:
            tables = write_report(results, cfg.run_dir)
            say("\n" + tables + f"\n\nwritten: {cfg.run_dir}/results.json, results.md, scores.png")
        return results
    finally:
        teardown()


def preflight(cfg: GenerationConfig) -> None:
    """Every trained entry's model built on the meta device with each of its inference settings switched on: a scheme
    the DiT refuses, or a setting its scheme does not take, fails when the config loads, naming the entry."""
    for entry in (e for e in cfg.schemes if e.trains):
        for setting in (e for e in cfg.schemes if e is entry or e.base == entry.name):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # a scheme's own advice is shown when the real model is built
                    model = build_dit(cfg.model, entry, img_size=cfg.data.img_size, num_classes=len(FMNIST_CLASSES),
                                      seed=0, device="meta")  # fmt: skip
                if setting.scaling is not None or setting.log_n_attention:
                    vispos.configure(model, scaling=setting.scaling, log_n_attention=setting.log_n_attention,
                                     **setting.scaling_options)  # fmt: skip
            except (ValueError, TypeError) as err:
                raise ConfigError(f"schemes[{setting.name}]: {err}") from None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)

