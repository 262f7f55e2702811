"""``python -m train.evaluate``: re-evaluate saved checkpoints at any sizes.

    python -m train.evaluate --checkpoint runs/NAME/rope2d/checkpoint.pt --sizes 28 42 56 \\
        [--protocols resize canvas] [--scaling yarn] [--max-images 2000] [--set eval.canvas_position=random]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

import vispos

from .config.sections import DEFAULT_PROTOCOLS, PROTOCOLS, ConfigError, SchemeConfig, apply_overrides
from .config.validation import check_entry_schemes
from .data.datasets import DataError
from .data.loaders import EvalLoader
from .data.sources import build_data
from .engine import checkpoint as ckpt_io
from .engine.checkpoint import CheckpointError
from .engine.models import build_model, configure_eval, patch_size_of, set_positions
from .engine.progress import CHECKPOINT  # the file a scheme folder holds
from .evaluation.accuracy import eval_sizes, evaluate_model
from .evaluation.report import format_tables
from .evaluation.results import Accuracy, accuracy_to_json
from .experiment.loading import config_from_dict
from .runtime.process import setup, teardown


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.evaluate",
                                description="Re-evaluate saved checkpoints at any resolutions.")
    p.add_argument("--checkpoint", nargs="+", required=True,
                   help="checkpoint files written by the trainer (checkpoint.pt, finetuned.pt), scheme folders "
                        "(their checkpoint.pt) or run folders (every scheme's checkpoint.pt)")
    p.add_argument("--sizes", nargs="+", type=int, required=True, help="evaluation resolutions in pixels")
    p.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=list(DEFAULT_PROTOCOLS),
                   help="zoom: generated datasets (grid tasks) only")
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


def checkpoint_files(arg: str) -> list[Path]:
    """The checkpoint files an argument names: a file, a scheme folder (its checkpoint.pt), or a run folder
    (each scheme's checkpoint.pt)."""
    path = Path(arg)
    if not path.is_dir():
        return [path]
    if (path / CHECKPOINT).is_file():
        return [path / CHECKPOINT]
    found = sorted(path.glob(f"*/{CHECKPOINT}"))
    if not found:
        raise CheckpointError(f"{path} is a folder without {CHECKPOINT} (nor scheme folders holding one); give a "
                              f"checkpoint file, a scheme folder (runs/NAME/SCHEME) or a run folder (runs/NAME)")
    return found


def non_finite(state: dict[str, Any]) -> list[str]:
    """The names of the floating-point tensors of a state dict that hold NaN or inf."""
    return [k for k, v in state.items()
            if torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all())]


def evaluate_checkpoint(path: Path, args: argparse.Namespace) -> tuple[str, Accuracy, int]:
    """Rebuild the model of a trainer checkpoint and evaluate it; (row label, accuracies, train size)."""
    ck = ckpt_io.load(path, required=("model", "config", "scheme"))
    weights = ck["model"] if ck.get("ema") is None else ck["ema"]  # a run with train.ema is evaluated on its EMA
    bad = non_finite(weights)
    if bad:
        print(f"warning: {path} holds non-finite weights ({len(bad)} tensors, e.g. {bad[0]}); "
              "its accuracies are not meaningful", file=sys.stderr)
    overrides = [f"eval.sizes={list(args.sizes)}", "eval.scales=null", f"eval.protocols={list(args.protocols)}",
                 f"device={args.device}", *args.set]
    if args.max_images is not None:
        overrides.append(f"eval.max_images={args.max_images}")
    if args.data_root is not None:
        overrides.append(f"data.root={args.data_root}")
    if args.quiet:
        overrides.append("progress=false")
    cfg = config_from_dict(apply_overrides(ck["config"], overrides))
    scheme = trained = SchemeConfig(**ck["scheme"])
    if args.scaling is not None or args.log_n:
        suffix = (f"+{args.scaling}" if args.scaling else "") + ("+logn" if args.log_n else "")
        scheme = SchemeConfig(name=f"{scheme.name}{suffix}", base=scheme.name, scaling=args.scaling,
                              log_n_attention=args.log_n)
        check_entry_schemes([trained, scheme])
    rt = setup(cfg.device, threads=cfg.threads, progress=cfg.progress, train_precision=cfg.train.precision,
               eval_precision=cfg.eval.precision)
    data = build_data(cfg.data)
    classes = ck.get("classes", data.classes)  # finetuned.pt keeps no class list: the config's data decides
    if list(data.classes) != list(classes):
        raise ConfigError(f"{path}: the dataset's classes differ from the checkpoint's ({len(classes)} "
                          "classes); point --data-root at the data it was trained on")
    model = build_model(cfg.model, trained, img_size=cfg.data.img_size, num_classes=len(classes),
                        in_chans=int(ck.get("in_chans", data.in_chans)), seed=cfg.seed)
    try:
        model.load_state_dict(weights)
    except (RuntimeError, ValueError) as e:  # e.g. a checkpoint of another vispos version
        raise CheckpointError(f"{path}: the weights do not fit the model its config builds: {e}") from None
    model.to(rt.device)
    if trained.drope > 0:
        set_positions(model, False)
    patch = patch_size_of(model)
    grid = (cfg.data.img_size // patch, cfg.data.img_size // patch)
    configure_eval(model, scheme, grid)
    loader = EvalLoader(data, cfg.data, cfg.eval, seed=cfg.seed, dist=rt.dist, patch_size=patch)
    sizes = eval_sizes(cfg.eval, cfg.data.img_size, patch)
    acc, _ = evaluate_model(model, loader, cfg.eval.protocols, sizes, rt, desc=scheme.name,
                            log=lambda msg: print(msg, flush=True))
    return scheme.name + (" (EMA)" if weights is not ck["model"] else ""), acc, cfg.data.img_size


def main(argv: list[str] | None = None) -> int:
    """Evaluate every checkpoint it can; a failing one is named and the exit code is 2 at the end."""
    args = _parse(argv)
    rows: dict[str, Accuracy] = {}
    failed: dict[str, str] = {}
    train_size = None
    try:
        paths: list[Path] = []
        for arg in args.checkpoint:
            try:
                paths.extend(checkpoint_files(arg))
            except CheckpointError as e:
                failed[arg] = str(e)
                print(f"error: {e}", file=sys.stderr)
        for path in paths:
            try:
                label, acc, train_size = evaluate_checkpoint(path, args)
            except (ConfigError, CheckpointError, DataError) as e:
                failed[str(path)] = str(e)
                print(f"error: {e}", file=sys.stderr)
                continue
            if label in rows:
                label = f"{label} ({path.parent.parent.name})"
            rows[label] = acc
    except KeyboardInterrupt:
        print("interrupted: nothing written", file=sys.stderr)
        return 130
    finally:
        teardown()
    if rows:
        print(format_tables({label: [acc] for label, acc in rows.items()}, list(args.protocols),
                            sorted(set(args.sizes)), train_size))
    if args.out:
        accuracy = {label: accuracy_to_json(acc) for label, acc in rows.items()}
        Path(args.out).write_text(json.dumps({"train_size": train_size, "accuracy": accuracy, "failed": failed},
                                             indent=2))
    if failed:
        print(f"error: {len(failed)} of {len(failed) + len(rows)} checkpoint(s) not evaluated: "
              f"{', '.join(failed)}" + (f" (accuracies of the others written to {args.out})" if args.out and rows
                                        else ""), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
