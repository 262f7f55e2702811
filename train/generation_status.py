"""``python -m train.generation_status --config configs/fmnist_dit.yaml``: where a generation run stands, per seed and
entry: sampled and scored (its ``scores.json`` matches the config), training (the step of its checkpoint), trained
but not yet sampled, or not started; printed as a markdown table (docs/generation.md quotes it)."""

from __future__ import annotations

import argparse
import sys

from .config.generation import GenerationConfig, with_seed
from .data.sources import FMNIST_CLASSES
from .engine.checkpoint import CheckpointError, load
from .engine.diffusion import CHECKPOINT
from .experiment.loading import load_config
from .experiment.run import scheme_folder

FMNIST_PER_CLASS = 6000  # Fashion-MNIST's training images per class


def state(cfg: GenerationConfig, name: str) -> str:
    """One entry's state in one seed's run folder."""
    entry = cfg.scheme(name)
    folder = scheme_folder(cfg.run_dir, name)
    if (folder / "scores.json").is_file():
        return "scored"
    base = scheme_folder(cfg.run_dir, entry.base or name)
    path = base / CHECKPOINT
    if not path.is_file():
        return "trained, not sampled" if (base / "summary.json").is_file() else "not started"
    try:
        ck = load(path, required=("step",))
    except CheckpointError:
        return "unreadable checkpoint"
    if ck.get("finished"):
        return "trained, not sampled"
    images = len(FMNIST_CLASSES) * min(cfg.data.train_per_class or FMNIST_PER_CLASS, FMNIST_PER_CLASS)
    per_epoch = -(-images // cfg.train.batch_size)
    return f"training: step {ck['step']} of {cfg.train.epochs * per_epoch}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.generation_status", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="the generation run's YAML config")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides (e.g. out_dir=...)")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if not isinstance(cfg, GenerationConfig):
        print(f"error: {args.config} is not a generation config (task: generation)", file=sys.stderr)
        return 2
    seeds = cfg.seeds or [cfg.seed]
    runs = {s: with_seed(cfg, s, str(cfg.run_dir / f"seed_{s}")) if cfg.seeds else cfg for s in seeds}
    print("| entry | " + " | ".join(f"seed {s}" for s in seeds) + " |")
    print("| --- |" + " --- |" * len(seeds))
    for entry in cfg.schemes:
        print(f"| `{entry.name}` | " + " | ".join(state(runs[s], entry.name) for s in seeds) + " |")
    done = sum(state(runs[s], e.name) == "scored" for s in seeds for e in cfg.schemes)
    print(f"\n{done} of {len(seeds) * len(cfg.schemes)} entries scored, in {cfg.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
