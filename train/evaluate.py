"""``python -m train.evaluate`` (the ``vispos-evaluate`` script): re-evaluate saved checkpoints at any sizes.

    python -m train.evaluate --checkpoint runs/NAME/rope2d/checkpoint.pt --sizes 28 42 56 \\
        [--protocols resize canvas] [--scaling yarn] [--max-images 2000] [--set eval.canvas_position=random]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import vispos

from . import checkpoint as ckpt_io
from .accuracy import eval_sizes, evaluate_model
from .config import PROTOCOLS, ConfigError, SchemeConfig, apply_overrides, config_from_dict
from .data import build_data
from .loaders import EvalLoader
from .models import build_model, configure_eval, patch_size_of, set_positions
from .report import format_tables
from .results import Accuracy, accuracy_to_json
from .runtime import setup, teardown


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.evaluate",
                                description="Re-evaluate saved checkpoints at any resolutions.")
    p.add_argument("--checkpoint", nargs="+", required=True, help="checkpoint.pt file(s) written by the trainer")
    p.add_argument("--sizes", nargs="+", type=int, required=True, help="evaluation resolutions in pixels")
    p.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS))
    # longrope needs per-frequency factors, which only a config entry's scaling_options can give
    p.add_argument("--scaling", choices=[s for s in vispos.SCALING_TYPES if s != "longrope"], default=None,
                   help="RoPE scaling applied at evaluation")
    p.add_argument("--log-n", action="store_true", help="log-n attention scaling above the training grid")
    p.add_argument("--max-images", type=int, default=None, help="evaluate on a fixed subset of this size")
    p.add_argument("--data-root", default=None, help="dataset location, if it moved since training")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="further config overrides, e.g. eval.canvas_position=random eval.batch_size=512")
    p.add_argument("--out", default=None, help="write the accuracies to this JSON file")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def evaluate_checkpoint(path: Path, args: argparse.Namespace) -> tuple[str, Accuracy, int]:
    """Rebuild the model of a trainer checkpoint and evaluate it; (row label, accuracies, train size)."""
    ck = ckpt_io.load(path)
    overrides = [f"eval.sizes={list(args.sizes)}", "eval.scales=null", f"eval.protocols={list(args.protocols)}",
                 f"device={args.device}", *args.set]
    if args.max_images is not None:
        overrides.append(f"eval.max_images={args.max_images}")
    if args.data_root is not None:
        overrides.append(f"data.root={args.data_root}")
    if args.quiet:
        overrides.append("progress=false")
    cfg = config_from_dict(apply_overrides(ck["config"], overrides))
    scheme = SchemeConfig(**ck["scheme"])
    rt = setup(cfg.device, threads=cfg.threads, progress=cfg.progress, train_precision=cfg.train.precision,
               eval_precision=cfg.eval.precision)
    data = build_data(cfg.data)
    if list(data.classes) != list(ck["classes"]):
        raise ConfigError(f"{path}: the dataset's classes differ from the checkpoint's ({len(ck['classes'])} "
                          "classes); point --data-root at the data it was trained on")
    model = build_model(cfg.model, scheme, img_size=cfg.data.img_size, num_classes=len(ck["classes"]),
                        in_chans=int(ck["in_chans"]), seed=cfg.seed)
    model.load_state_dict(ck["model"])
    model.to(rt.device)
    if scheme.drope > 0:
        set_positions(model, False)
    patch = patch_size_of(model)
    grid = (cfg.data.img_size // patch, cfg.data.img_size // patch)
    if args.scaling is not None or args.log_n:
        suffix = (f"+{args.scaling}" if args.scaling else "") + ("+logn" if args.log_n else "")
        scheme = SchemeConfig(name=f"{scheme.name}{suffix}", base=scheme.name, scaling=args.scaling,
                              log_n_attention=args.log_n)
    configure_eval(model, scheme, grid)
    loader = EvalLoader(data, cfg.data, cfg.eval, seed=cfg.seed, dist=rt.dist, patch_size=patch)
    sizes = eval_sizes(cfg.eval, cfg.data.img_size, patch)
    acc, _ = evaluate_model(model, loader, cfg.eval.protocols, sizes, rt, desc=scheme.name)
    return scheme.name, acc, cfg.data.img_size


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    rows: dict[str, Accuracy] = {}
    train_size = None
    try:
        for path in args.checkpoint:
            label, acc, train_size = evaluate_checkpoint(Path(path), args)
            if label in rows:
                label = f"{label} ({Path(path).parent.parent.name})"
            rows[label] = acc
    except (ConfigError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        teardown()
    print(format_tables({label: [acc] for label, acc in rows.items()}, list(args.protocols),
                        sorted(set(args.sizes)), train_size))
    if args.out:
        accuracy = {label: accuracy_to_json(acc) for label, acc in rows.items()}
        Path(args.out).write_text(json.dumps({"train_size": train_size, "accuracy": accuracy}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
