"""One experiment: train every scheme under identical settings, evaluate each, write the report."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm

from . import checkpoint as ckpt_io
from .config import ExperimentConfig, SchemeConfig, to_dict
from .data import build_data
from .engine import fingerprint, train_scheme
from .evaluate import eval_sizes, evaluate_model
from .loaders import EvalLoader
from .models import build_model, check_schemes, configure_eval, patch_size_of, set_positions
from .report import write_outputs
from .runtime import Runtime, main_first, setup, teardown


def scheme_folder(run_dir: Path, name: str) -> Path:
    """A file-system-safe folder per scheme entry."""
    return run_dir / re.sub(r"[^A-Za-z0-9._+-]", "_", name)


def _eval_fingerprint(cfg: ExperimentConfig, scheme: SchemeConfig, sizes: list[int]) -> dict[str, Any]:
    base = cfg.scheme(scheme.base) if scheme.base else scheme
    ev = {k: v for k, v in to_dict(cfg.eval).items() if k not in ("batch_size",)}
    return {"train": fingerprint(cfg, base), "eval": ev, "sizes": sizes, "scaling": scheme.scaling,
            "scaling_options": scheme.scaling_options, "log_n_attention": scheme.log_n_attention}


def _canvas_text(cfg: ExperimentConfig) -> str:
    fill = "the dataset background" if cfg.eval.canvas_fill is None else f"value {cfg.eval.canvas_fill}"
    snap = ", offsets snapped to the patch grid" if cfg.eval.canvas_snap else ""
    return (f"{cfg.eval.canvas_position} placement on {fill}{snap}; below the training size the image is "
            f"{'centre' if cfg.eval.canvas_position == 'center' else 'randomly'}-cropped at training scale")


def run_experiment(cfg: ExperimentConfig, log: Any = None, command: str | None = None) -> dict[str, Any]:
    """Train and evaluate every scheme of ``cfg``; write the run folder; return the results dict.

    ``command`` (the command line that made the run) is recorded in results.json and results.md.
    """
    t_start = time.time()
    rt = setup(cfg)
    say = log or (lambda msg: tqdm.write(msg) if rt.is_main else None)
    try:
        return _run(cfg, rt, say, t_start, command)
    finally:
        teardown()


def _run(cfg: ExperimentConfig, rt: Runtime, say: Any, t_start: float, command: str | None) -> dict[str, Any]:
    check_schemes(cfg)
    data = build_data(cfg.data)
    run_dir = cfg.run_dir
    with main_first(rt):
        run_dir.mkdir(parents=True, exist_ok=True)
    if rt.is_main:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    # build every trained model once before any training: a bad scheme or option fails now, not in an hour
    patch = None
    for s in cfg.schemes:
        if s.trains:
            patch = patch_size_of(build_model(cfg, s, num_classes=data.num_classes, in_chans=data.in_chans))
    assert patch is not None
    if cfg.data.img_size % patch:
        raise ValueError(f"data.img_size={cfg.data.img_size} is not a multiple of the patch size {patch}")
    sizes = eval_sizes(cfg, patch)
    grid = (cfg.data.img_size // patch, cfg.data.img_size // patch)
    loader = EvalLoader(data, cfg, rt.dist, patch)
    say(f"{cfg.name}: {len(data.train)} training images, {data.num_classes} classes, {len(loader)} evaluation "
        f"images at {sizes} px ({', '.join(cfg.eval.protocols)}); {sum(s.trains for s in cfg.schemes)} schemes to "
        f"train, run folder {run_dir}, device {rt.device}, {rt.dist.world} process(es)")

    results: dict[str, Any] = {
        "name": cfg.name, "train_size": cfg.data.img_size, "sizes": sizes, "protocols": list(cfg.eval.protocols),
        "eval_images": len(loader), "canvas": _canvas_text(cfg), "device": str(rt.device),
        "processes": rt.dist.world, "command": command, "schemes": {}, "config": to_dict(cfg),
    }
    for s in cfg.schemes:
        folder = scheme_folder(run_dir, s.name)
        efp = _eval_fingerprint(cfg, s, sizes)
        cached = _cached(folder / "eval.json", efp) if cfg.resume else None
        train_info = None
        if s.trains:
            res = train_scheme(cfg, s, data, rt, folder, log=say)
            last = res.history[-1] if res.history else {}
            train_info = {"seconds": res.seconds, "epochs": cfg.train.epochs, "train_loss": last.get("train_loss"),
                          "train_acc": last.get("train_acc"), "val_acc": last.get("val_acc"),
                          "skipped_images": res.skipped, "history": res.history}
            model = res.model
        elif cached is None:
            model = _load_trained(cfg, cfg.scheme(s.base), data, rt, run_dir)  # type: ignore[arg-type]
        if cached is None:
            configure_eval(model, s, grid)
            acc, skipped = evaluate_model(model, loader, cfg.eval.protocols, sizes, rt, desc=f"eval {s.name}")
            if rt.is_main:
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "eval.json").write_text(json.dumps({"fingerprint": efp, "accuracy": acc,
                                                              "skipped_images": skipped}, indent=2))
        else:
            acc, skipped = cached["accuracy"], cached["skipped_images"]
        results["schemes"][s.name] = {
            "pos": s.pos, "options": s.options, "base": s.base, "scaling": s.scaling,
            "scaling_options": s.scaling_options, "log_n_attention": s.log_n_attention, "drope": s.drope,
            "train": train_info,
            "accuracy": acc, "skipped_images": skipped,
        }
        top = str(max(sizes))
        say(f"[{s.name}] accuracy at {cfg.data.img_size} / {top} px: " + ", ".join(
            f"{p} {acc[p][str(cfg.data.img_size)] if str(cfg.data.img_size) in acc[p] else float('nan'):.1f} / "
            f"{acc[p][top]:.1f}" for p in cfg.eval.protocols))
    results["wall_seconds"] = round(time.time() - t_start, 1)
    if rt.is_main:
        table = write_outputs(results, run_dir)
        say("\n" + table + f"\n\nwritten: {run_dir}/results.json, results.md, accuracy.png "
            f"({results['wall_seconds']:.0f} s)")
    return results


def _cached(path: Path, fp: dict[str, Any]) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return saved if saved.get("fingerprint") == json.loads(json.dumps(fp)) else None


def _load_trained(cfg: ExperimentConfig, base: SchemeConfig, data: Any, rt: Runtime, run_dir: Path) -> Any:
    """The final weights of a trained scheme of this run (for evaluation-only entries)."""
    path = scheme_folder(run_dir, base.name) / "checkpoint.pt"
    ck = ckpt_io.load(path)
    if not ck["finished"]:
        raise RuntimeError(f"{path} is not a finished training run; rerun the config to finish it")
    model = build_model(cfg, base, num_classes=data.num_classes, in_chans=data.in_chans)
    model.load_state_dict(ck["model"])
    if base.drope > 0:
        set_positions(model, False)
    return model.to(rt.device)
