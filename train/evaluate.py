"""Accuracy at several resolutions under the resize and canvas protocols; the re-evaluation entry point.

    python -m train.evaluate --checkpoint runs/NAME/rope2d/checkpoint.pt --sizes 28 42 56 \\
        [--protocols resize canvas] [--scaling yarn] [--max-images 2000] [--set eval.canvas_position=random]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from .config import PROTOCOLS, SCALINGS, ConfigError, ExperimentConfig, SchemeConfig, apply_overrides, config_from_dict
from .loaders import EvalLoader
from .runtime import Runtime

Accuracies = dict[str, dict[str, float]]  # protocol -> str(size) -> top-1 accuracy in percent


def eval_sizes(cfg: ExperimentConfig, patch: int) -> list[int]:
    """eval.sizes, or eval.scales times the training size rounded to a multiple of the patch size."""
    if cfg.eval.sizes is not None:
        sizes = list(cfg.eval.sizes)
    else:
        sizes = [max(patch, int(round(s * cfg.data.img_size / patch)) * patch) for s in cfg.eval.scales or []]
    bad = [s for s in sizes if s < patch or s % patch]
    if bad:
        raise ConfigError(f"eval sizes {bad} are not positive multiples of the patch size {patch}")
    return sorted(set(sizes))


@torch.inference_mode()
def accuracy(model: nn.Module, loader: EvalLoader, protocol: str, size: int, rt: Runtime,
             bar: tqdm | None = None) -> tuple[float, int, int]:
    """Top-1 accuracy (percent) over the loader's subset, summed over DDP processes; (acc, n, skipped)."""
    was_training = model.training
    model.eval()
    counts = torch.zeros(3, dtype=torch.float64)
    for batch in loader.batches(protocol, size):
        if len(batch.y):
            with rt.autocast(rt.eval_dtype):
                logits = model(batch.x.to(rt.device, non_blocking=True))
            counts[0] += (logits.argmax(-1).cpu() == batch.y).sum().item()
            counts[1] += len(batch.y)
        counts[2] += len(batch.skipped)
        if bar is not None:
            bar.update(1)
    model.train(was_training)
    counts = rt.all_reduce(counts.to(rt.device)).cpu()
    correct, n, skipped = counts.tolist()
    return 100.0 * correct / max(n, 1.0), int(n), int(skipped)


def evaluate_model(model: nn.Module, loader: EvalLoader, protocols: list[str], sizes: list[int], rt: Runtime,
                   desc: str = "eval") -> tuple[Accuracies, int]:
    """Accuracy for every (protocol, size); returns the table and the number of unreadable images."""
    per_pass = -(-len(loader.local) // loader.cfg.eval.batch_size)
    bar = tqdm(total=per_pass * len(protocols) * len(sizes), desc=desc, leave=False, disable=not rt.progress,
               dynamic_ncols=True)
    out: Accuracies = {}
    skipped = 0
    for protocol in protocols:
        out[protocol] = {}
        for size in sizes:
            acc, _, sk = accuracy(model, loader, protocol, size, rt, bar)
            out[protocol][str(size)] = acc
            skipped = max(skipped, sk)
    bar.close()
    return out, skipped


# ----------------------------------------------------------------------------------------------------
# entry point


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.evaluate",
                                description="Re-evaluate saved checkpoints at any resolutions.")
    p.add_argument("--checkpoint", nargs="+", required=True, help="checkpoint.pt file(s) written by the trainer")
    p.add_argument("--sizes", nargs="+", type=int, required=True, help="evaluation resolutions in pixels")
    p.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS))
    p.add_argument("--scaling", choices=SCALINGS, default=None, help="RoPE scaling applied at evaluation")
    p.add_argument("--log-n", action="store_true", help="log-n attention scaling above the training grid")
    p.add_argument("--max-images", type=int, default=None, help="evaluate on a fixed subset of this size")
    p.add_argument("--data-root", default=None, help="dataset location, if it moved since training")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="further config overrides, e.g. eval.canvas_position=random eval.batch_size=512")
    p.add_argument("--out", default=None, help="write the accuracies to this JSON file")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def evaluate_checkpoint(path: Path, args: argparse.Namespace) -> tuple[str, Accuracies, int]:
    """Rebuild the model of a trainer checkpoint and evaluate it; (row label, accuracies, train size)."""
    from . import checkpoint as ckpt_io
    from .data import build_data
    from .models import build_model, configure_eval, patch_size_of, set_positions
    from .runtime import setup

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
    rt = setup(cfg)
    data = build_data(cfg.data)
    if list(data.classes) != list(ck["classes"]):
        raise ConfigError(f"{path}: the dataset's classes differ from the checkpoint's ({len(ck['classes'])} "
                          "classes); point --data-root at the data it was trained on")
    model = build_model(cfg, scheme, num_classes=len(ck["classes"]), in_chans=int(ck["in_chans"]))
    model.load_state_dict(ck["model"])
    model.to(rt.device)
    if scheme.drope > 0:
        set_positions(model, False)
    label = scheme.name
    patch = patch_size_of(model)
    grid = (cfg.data.img_size // patch, cfg.data.img_size // patch)
    if args.scaling is not None or args.log_n:
        suffix = (f"+{args.scaling}" if args.scaling else "") + ("+logn" if args.log_n else "")
        scheme = SchemeConfig(name=f"{scheme.name}{suffix}", base=scheme.name, scaling=args.scaling,
                              log_n_attention=args.log_n)
        label = scheme.name
    configure_eval(model, scheme, grid)
    loader = EvalLoader(data, cfg, rt.dist, patch)
    acc, _ = evaluate_model(model, loader, cfg.eval.protocols, eval_sizes(cfg, patch), rt, desc=label)
    return label, acc, cfg.data.img_size


def main(argv: list[str] | None = None) -> int:
    from .report import format_tables
    from .runtime import teardown

    args = _parse(argv)
    rows: dict[str, Accuracies] = {}
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
    print(format_tables(rows, list(args.protocols), sorted(set(args.sizes)), train_size))
    if args.out:
        Path(args.out).write_text(json.dumps({"train_size": train_size, "accuracy": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
