"""A pretrained timm RoPE model at higher resolution, without training: README's "Pretrained models" recipe.

    python -m benchmarks.pretrained_rope [--config configs/pretrained_rope_fmnist.yaml] [--out docs/pretrained_rope]
                                         [key=value ...]      # config overrides, as for python -m train

1. Trains the config's timm RoPE-ViT with timm's own RoPE (the trainer's ``timm`` scheme; no vispos),
   unless the run folder already holds the finished model.
2. Saves its weights as a plain timm state dict (``weights.pth`` in the run folder), as a downloaded
   checkpoint would be, and loads them
   back the way a user loads pretrained weights from a local file: ``timm.create_model(name,
   pretrained=True, pretrained_cfg_overlay=dict(file=...))``.
3. For each recipe, ``vispos.patch(model, "rope2d")`` (inheriting the model's RoPE), then
   ``vispos.configure(model, scaling=..., log_n_attention=...)``, and top-1 accuracy on the test set at
   1x, 1.5x and 2x the training size (resize protocol), beside timm's model itself.

Writes ``results.json`` and ``results.md`` (the table README shows) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import timm
import torch
from torch import nn

import vispos
from train.data.loaders import EvalLoader
from train.data.sources import build_data
from train.engine.models import TIMM_TABLE, timm_kwargs
from train.evaluation.accuracy import top1
from train.experiment.loading import load_config
from train.experiment.run import run_experiment, scheme_folder
from train.runtime.process import setup, teardown

# (row, configure() settings; None: timm's model as it is, unpatched)
RECIPES: list[tuple[str, dict[str, Any] | None]] = [
    ("timm's own model (no vispos)", None),
    ("vispos, inherited RoPE", {}),
    ("+ linear", {"scaling": "linear"}),
    ("+ ntk", {"scaling": "ntk"}),
    ("+ yarn", {"scaling": "yarn"}),
    ("+ log-n", {"log_n_attention": True}),
    ("+ yarn + log-n", {"scaling": "yarn", "log_n_attention": True}),
]


def export_weights(checkpoint: Path) -> Path:
    """The trainer's checkpoint -> a plain timm state dict file beside it (what a model hub would serve)."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
    path = checkpoint.with_name("weights.pth")
    torch.save(state, path)
    return path


def load_pretrained(name: str, weights: Path, kwargs: dict[str, Any]) -> nn.Module:
    """The user's path: timm's pretrained loader, from a local file (nothing is downloaded)."""
    # the checkpoint's own classes and input (else timm drops the classifier and notes the channel count)
    size = (kwargs["in_chans"], kwargs["img_size"], kwargs["img_size"])
    overlay = dict(file=str(weights), num_classes=kwargs["num_classes"], input_size=size)
    return timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs).eval()


def recipe_model(name: str, weights: Path, kwargs: dict[str, Any], settings: dict[str, Any] | None) -> nn.Module:
    model = load_pretrained(name, weights, kwargs | {"dynamic_img_size": True})
    if settings is None:
        return model
    vispos.patch(model, "rope2d")  # inherits the model's RoPE: the same outputs as timm's at every size
    if settings:
        vispos.configure(model, **settings)
    return model


def markdown(sizes: list[int], train_size: int, rows: dict[str, dict[int, float]], n: int) -> str:
    head = " | ".join(f"{s} px ({s / train_size:g}x)" for s in sizes)
    lines = [f"| recipe | {head} |", "| --- |" + " --- |" * len(sizes)]
    for recipe, acc in rows.items():
        lines.append(f"| {recipe} | " + " | ".join(f"{acc[s]:.1f}" for s in sizes) + " |")
    return "\n".join(lines) + f"\n\nTop-1 (%) on {n} Fashion-MNIST test images, resize protocol."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/pretrained_rope_fmnist.yaml")
    parser.add_argument("--out", default="docs/pretrained_rope")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. threads=1 (as for python -m train)")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if [s.pos for s in cfg.schemes] != [[TIMM_TABLE]]:
        raise SystemExit(f"{args.config}: the recipe needs exactly one scheme, {TIMM_TABLE!r} (timm's own RoPE)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    run_experiment(cfg)  # trains timm's RoPE model (a finished run is reused)
    weights = export_weights(scheme_folder(cfg.run_dir, cfg.schemes[0].name) / "checkpoint.pt")

    rt = setup(cfg.device, threads=cfg.threads, progress=False)
    try:
        data = build_data(cfg.data)
        patch = cfg.model.patch_size
        kwargs = timm_kwargs(cfg.model, img_size=cfg.data.img_size, num_classes=data.num_classes,
                             in_chans=data.in_chans)  # fmt: skip
        loader = EvalLoader(data, cfg.data, cfg.eval, seed=cfg.seed, dist=rt.dist, patch_size=patch)
        sizes = sorted(cfg.eval.sizes)
        reference = recipe_model(cfg.model.name, weights, kwargs, None)
        inherited = recipe_model(cfg.model.name, weights, kwargs, {})
        probe = {s: torch.randn(4, data.in_chans, s, s) for s in sizes}
        with torch.inference_mode():  # the inherited model is timm's model at every size
            same = max((reference(x) - inherited(x)).abs().max().item() for x in probe.values())
        rows: dict[str, dict[int, float]] = {}
        for recipe, settings in RECIPES:
            model = recipe_model(cfg.model.name, weights, kwargs, settings)
            rows[recipe] = {s: top1(model, loader, "resize", s, rt)[0] for s in sizes}
            print(f"{recipe:32s}" + "".join(f"{rows[recipe][s]:8.1f}" for s in sizes), flush=True)
    finally:
        teardown()
    table = markdown(sizes, cfg.data.img_size, rows, len(loader))
    command = " ".join(["python -m benchmarks.pretrained_rope", "--config", args.config, "--out", args.out,
                        *args.overrides])
    note = f"inherited vs timm, max |logit difference| over the sizes: {same:.1e}"
    (out / "results.md").write_text(f"{table}\n{note}.\n\nCommand: `{command}` ({time.time() - t0:.0f} s)\n")
    (out / "results.json").write_text(json.dumps({
        "command": command, "model": cfg.model.name, "train_size": cfg.data.img_size, "sizes": sizes,
        "images": len(loader), "accuracy": rows, "inherited_vs_timm_max_abs_logit_difference": same,
        "seconds": round(time.time() - t0, 1),
    }, indent=2))  # fmt: skip
    print(f"\n{table}\n{note}\nwritten: {out}/results.md, results.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
