"""Top-1 accuracy at several resolutions under the resize and canvas protocols."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from tqdm import tqdm

from ..config.sections import ConfigError, EvalConfig
from ..data.loaders import EvalLoader
from ..runtime.process import Runtime
from .results import Accuracy


def eval_sizes(cfg: EvalConfig, train_size: int, patch: int) -> list[int]:
    """eval.sizes, or eval.scales times the training size rounded to a multiple of the patch size."""
    if cfg.sizes is not None:
        sizes = list(cfg.sizes)
    else:
        sizes = [max(patch, int(round(s * train_size / patch)) * patch) for s in cfg.scales or []]
    bad = [s for s in sizes if s < patch or s % patch]
    if bad:
        raise ConfigError(f"eval sizes {bad} are not positive multiples of the patch size {patch}")
    return sorted(set(sizes))


@torch.inference_mode()
def top1(model: nn.Module, loader: EvalLoader, protocol: str, size: int, rt: Runtime,
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
                   desc: str = "eval", log: Callable[[str], None] | None = None) -> tuple[Accuracy, int]:
    """Accuracy for every (protocol, size); returns the table and the number of unreadable images.

    Without a terminal (``rt.lines``), ``log`` gets one line per (protocol, size) in place of the bar."""
    bar = tqdm(total=loader.num_batches * len(protocols) * len(sizes), desc=desc, leave=False,
               disable=not rt.progress, dynamic_ncols=True)
    out: Accuracy = {}
    skipped = 0
    for protocol in protocols:
        out[protocol] = {}
        for size in sizes:
            acc, _, sk = top1(model, loader, protocol, size, rt, bar)
            out[protocol][size] = acc
            skipped = max(skipped, sk)
            if log is not None and rt.lines:
                log(f"{desc}: {protocol} {size} px: {acc:.2f}")
    bar.close()
    return out, skipped
