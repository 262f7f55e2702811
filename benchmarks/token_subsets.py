"""Token subsets and ragged batches: what keeping fewer tokens saves, per positional scheme.

    python -m benchmarks.token_subsets [--reps 5] [--batch 16] [--schemes rope2d,relbias2d,...]
                                       [--parts dropout,ragged] [--no-memory] [--device cpu|cuda]
                                       [--json out.json] [--dry-run]

(a) ``dropout``: timm's patch dropout at 50 % against none, ``vit_small_patch16_224`` at 224 px: the
time of a training step (forward + backward, ``model(x).sum()``) without dropout divided by the time
with it, per scheme (a speed-up: FLIP reports about 2x); timm's own model (learned ``pos_embed``) for
comparison. Positions follow the kept tokens (rotations and bias masks gathered at timm's keep indices).

(b) ``ragged``: a batch of images of sizes drawn from 112 to 224 px per side (multiples of 16, so mixed
aspect ratios; seeded), on ``vit_small_patch16_224`` without class token (average pooling, so that rows
may be packed). Baseline: every image zero-padded to the batch's largest height and width and run as one
dense batch (timm's forward). Against it: ``ragged rows``, one image per row, rows padded to the longest
token count, positions from ``Positions.ragged_context``; ``packed rows``, images packed first-fit
decreasing into rows as long as the baseline's (the largest height x width in tokens), with segment
ids. Both embed pixel patches cut in the data pipeline (as timm's NaFlex transform does) with the patch
embedding's weights, run the model's blocks with the ragged context and pool each image's own tokens.
Reported: training-step time and peak memory, each as a ratio to the baseline (below 1: cheaper).

Timing: repetitions are interleaved (each round times every configuration once) and ratios are medians
of per-round ratios, so machine noise hits all rows alike. Peak memory: on CPU each configuration's step
runs in a fresh process (``benchmarks.position_memory``'s high-water-mark method); on GPU
``max_memory_allocated``. The command line runs fp32 with SDPA; ``run_part`` also takes an autocast dtype,
``attention="flex"`` and a probe of the attention kernel each step reaches, which ``benchmarks.gpu_check``
uses to run (a) and (b) on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable

import timm
import torch
from torch import nn

import vispos
from benchmarks.patch_overhead import _time
from benchmarks.position_memory import _peak
from benchmarks.ragged_batches import (
    draw_sizes,
    padded_images,
    ragged_batch,
    ragged_logits,
)
from vispos.diagnostics.kernels import sdpa_kernels

MODEL = "vit_small_patch16_224"
SCHEMES = ["rope2d", "rope2d_mixed", "relbias2d", "cpb2d", "alibi2d", "learned2d", "nope"]


def build(
    scheme: str | None, *, drop: float = 0.0, pooled: bool = False, dry_run: bool = False, attention: str = "sdpa"
) -> nn.Module:
    """ViT-S/16 (``scheme`` None: timm's own), patch dropout ``drop``; ``pooled``: no class token, average pool;
    ``attention="flex"``: relative biases through FlexAttention (``vispos.configure``)."""
    torch.manual_seed(0)
    kwargs: dict[str, object] = {"patch_drop_rate": drop, "num_classes": 10}
    if pooled:
        kwargs |= {"class_token": False, "global_pool": "avg"}
    if dry_run:
        kwargs["depth"] = 1
    if scheme is None:
        return timm.create_model(MODEL, **kwargs)
    model = vispos.create_model(MODEL, pos=scheme, **kwargs)
    return model if attention == "sdpa" else vispos.configure(model, attention=attention)


# --- (b) ragged batches -------------------------------------------------------------------------------------


def training_step(
    model: nn.Module, run: Callable[[], torch.Tensor], autocast: torch.dtype | None = None
) -> Callable[[], None]:
    """-> a training step: ``run()`` (under autocast to ``autocast`` on the model's device, if given) summed,
    then the backward pass."""
    device_type = next(model.parameters()).device.type

    def step() -> None:
        model.train()
        model.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=autocast, enabled=autocast is not None):
            loss = run().sum()
        loss.backward()

    return step


def configurations(  # noqa: ANN201
    part: str,
    scheme: str,
    batch: int,
    device: torch.device,
    dry_run: bool,
    *,
    attention: str = "sdpa",
    autocast: torch.dtype | None = None,
):
    """label -> (model, step) for one scheme of one part; the first label is the part's baseline.
    ``attention`` applies to (b) only (``build``); ``autocast``: the forward's autocast dtype (None: fp32)."""
    g = torch.Generator().manual_seed(1)
    if part == "dropout":
        x = torch.randn(batch, 3, 224, 224, generator=g).to(device)
        plain = build(None if scheme == "timm" else scheme, dry_run=dry_run).to(device)
        dropping = build(None if scheme == "timm" else scheme, drop=0.5, dry_run=dry_run).to(device)
        dropping.load_state_dict(plain.state_dict())
        return {
            "no dropout": (plain, training_step(plain, lambda: plain(x), autocast)),
            "patch dropout 50%": (dropping, training_step(dropping, lambda: dropping(x), autocast)),
        }
    images = [torch.randn(3, h, w, generator=g) for h, w in draw_sizes(batch, seed=2)]
    model = build(scheme, pooled=True, dry_run=dry_run, attention=attention).to(device)
    padded = padded_images(images).to(device)
    rows, packed = ragged_batch(images, packed=False).to(device), ragged_batch(images, packed=True).to(device)
    return {
        "padded to the largest": (model, training_step(model, lambda: model(padded), autocast)),
        "ragged rows": (model, training_step(model, lambda: ragged_logits(model, rows), autocast)),
        "packed rows": (model, training_step(model, lambda: ragged_logits(model, packed), autocast)),
    }


def peak_memory(
    part: str,
    scheme: str,
    label: str,
    batch: int,
    device_name: str,
    dry_run: bool,
    attention: str = "sdpa",
    autocast: torch.dtype | None = None,
) -> int:
    """Peak extra bytes of one training step of one configuration, measured in this process."""
    device = torch.device(device_name)
    _, step = configurations(part, scheme, batch, device, dry_run, attention=attention, autocast=autocast)[label]
    step()  # warm-up: gradients allocated, kernels chosen
    return _peak(step, device)


def measure_memory(
    part: str,
    scheme: str,
    label: str,
    batch: int,
    device: torch.device,
    dry_run: bool,
    *,
    attention: str = "sdpa",
    autocast: torch.dtype | None = None,
) -> int:
    """Peak extra bytes of one training step (``peak_memory``): on CPU in a fresh process (the high-water mark
    must see this step alone), here on GPU (``max_memory_allocated`` after ``reset_peak_memory_stats``)."""
    if device.type == "cuda":
        return peak_memory(part, scheme, label, batch, device.type, dry_run, attention, autocast)
    code = (
        "import json, torch; from benchmarks.token_subsets import peak_memory; "
        f"print(json.dumps(peak_memory({part!r}, {scheme!r}, {label!r}, {batch}, 'cpu', {dry_run}, "
        f"{attention!r}, {autocast!r})))"
    )
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def attention_path(step: Callable[[], None]) -> str:
    """The SDPA kernel(s) one call of ``step`` reaches (profiler op names), or "none (FlexAttention)"."""
    return ", ".join(sorted(sdpa_kernels(step))) or "none (FlexAttention)"


def run_part(
    part: str,
    schemes: list[str],
    batch: int,
    reps: int,
    device: torch.device,
    memory: bool,
    dry_run: bool,
    *,
    attention: str = "sdpa",
    autocast: torch.dtype | None = None,
    kernels: bool = False,
) -> dict[str, dict[str, dict[str, float | str]]]:
    """scheme -> configuration -> {ms, ratio (to the part's baseline, per-round medians), peak_mib, memory_ratio
    (``memory``, (b) only), attention (``kernels``: ``attention_path`` of the step)}."""
    setting = {"attention": attention, "autocast": autocast}
    steps = {s: configurations(part, s, batch, device, dry_run, **setting) for s in schemes}
    times = {s: {label: [] for label in configs} for s, configs in steps.items()}
    for configs in steps.values():
        for _, step in configs.values():
            step()  # warm-up
    for _ in range(reps):
        for s, configs in steps.items():
            for label, (_, step) in configs.items():
                times[s][label].append(_time(step, device))
    results: dict[str, dict[str, dict[str, float]]] = {}
    for s, configs in steps.items():
        base = next(iter(configs))
        results[s] = {}
        for label in configs:
            pairs = zip(times[s][label], times[s][base], strict=True)
            ratios = [b / t if part == "dropout" else t / b for t, b in pairs]
            results[s][label] = {"ms": 1000 * statistics.median(times[s][label]), "ratio": statistics.median(ratios)}
            if kernels:
                results[s][label]["attention"] = attention_path(configs[label][1])
        if memory and part == "ragged":
            peaks = {label: measure_memory(part, s, label, batch, device, dry_run, **setting) for label in configs}
            for label, peak in peaks.items():
                results[s][label] |= {"peak_mib": peak / 2**20, "memory_ratio": peak / max(peaks[base], 1)}
    return results


def table(part: str, results: dict[str, dict[str, dict[str, float | str]]]) -> str:
    """A markdown table of one part's results; (b) with memory and attention columns where measured."""
    if part == "dropout":
        lines = ["| scheme | step ms, no dropout | step ms, 50 % dropout | speed-up |", "| --- | ---: | ---: | ---: |"]
        for s, row in results.items():
            a, b = row["no dropout"], row["patch dropout 50%"]
            lines.append(f"| {s} | {a['ms']:.0f} | {b['ms']:.0f} | {b['ratio']:.2f}x |")
        return "\n".join(lines)
    first = next(iter(next(iter(results.values())).values()))
    memory, kernels = "peak_mib" in first, "attention" in first
    head = "| scheme | configuration | step ms | time ratio |" + (" peak MiB | memory ratio |" if memory else "")
    lines = [
        head + (" attention |" if kernels else ""),
        "| --- | --- | ---: | ---: |" + (" ---: | ---: |" if memory else "") + (" --- |" if kernels else ""),
    ]
    for s, row in results.items():
        for label, r in row.items():
            cells = [s, label, f"{r['ms']:.0f}", f"{r['ratio']:.2f}"]
            if memory:
                cells += [f"{r['peak_mib']:.0f}", f"{r['memory_ratio']:.2f}"]
            if kernels:
                cells.append(str(r["attention"]))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated vispos 2D schemes")
    parser.add_argument("--parts", default="dropout,ragged", help="dropout, ragged or both (comma-separated)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements of (b)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--dry-run", action="store_true", help="one block, batch 2, one round, no memory: "
                        "proves the script runs")  # fmt: skip
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    schemes = [vispos.get_info(s, 2).name for s in args.schemes.split(",")]
    parts = args.parts.split(",")
    for part in parts:
        if part not in ("dropout", "ragged"):
            parser.error(f"unknown part {part!r}; known: dropout, ragged")
    batch, reps = (2, 1) if args.dry_run else (args.batch, args.reps)
    report: dict[str, object] = {"device": device.type, "batch": batch, "reps": reps, "dry_run": args.dry_run}
    torch.manual_seed(0)
    for part in parts:
        rows = [*schemes, "timm"] if part == "dropout" else schemes
        memory = not (args.no_memory or args.dry_run)
        results = run_part(part, rows, batch, reps, device, memory, args.dry_run)
        report[part] = results
        if part == "dropout":
            print(f"(a) {MODEL} at 224 px, batch {batch}, fp32, {device.type}, {reps} interleaved rounds: training "
                  "step without patch dropout / with 50 % (timm: its own learned pos_embed)")  # fmt: skip
        else:
            sizes = draw_sizes(batch, seed=2)
            print(f"(b) {MODEL} (no class token, average pool), {batch} images of "
                  f"{', '.join(f'{h}x{w}' for h, w in sizes)} px, fp32, {device.type}, {reps} interleaved "
                  "rounds: training step, ratios to padding every image to the largest")  # fmt: skip
        print(table(part, results), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
