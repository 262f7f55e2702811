"""A ready GPU check: every scheme's throughput and peak memory at several resolutions, in one script.

    python -m benchmarks.gpu_check [--sizes 224 448 896] [--batch 32] [--no-compile] [--out DIR]
    python -m benchmarks.gpu_check --dry-run          # tiny, on CPU: proves the script runs

For ``vit_small_patch16_224`` under bf16 autocast and ``torch.inference_mode()``: images per second and
peak memory (``torch.cuda.max_memory_allocated``) of the unpatched timm model, timm's own Eva RoPE
model, and the model patched with every 2D scheme; the relative biases twice, through SDPA and through
FlexAttention (``vispos.configure(model, attention="flex")``), and the SDPA kernel each reaches (an eager
forward, read from the profiler's op names). ``torch.compile`` is on unless
``--no-compile``. Writes ``gpu_check.json`` and ``gpu_check.md`` to ``--out``. Sizes the model cannot
fit in memory are reported as such, not fatal.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import timm
import torch
from torch import nn

import vispos
from vispos.diagnostics.kernels import sdpa_kernels

MODEL = "vit_small_patch16_224"


def configurations(model: str, dry_run: bool) -> dict[str, Callable[[int], nn.Module]]:
    """label -> builder(image size)."""
    kwargs = {"depth": 2} if dry_run else {}

    def timm_model(name: str) -> Callable[[int], nn.Module]:
        return lambda size: timm.create_model(name, img_size=size, dynamic_img_size=True, **kwargs)

    def patched(scheme: str, attention: str = "sdpa") -> Callable[[int], nn.Module]:
        def build(size: int) -> nn.Module:
            m = vispos.patch(timm.create_model(model, **kwargs), scheme)  # trained at 224 px, run at `size`
            return vispos.configure(m, attention=attention) if attention != "sdpa" else m

        return build

    configs = {f"timm {name}": timm_model(name) for name in (model, "vit_small_patch16_rope_224")}
    for scheme in vispos.list_encodings(ndim=2):
        configs[f"vispos {scheme}"] = patched(scheme)
    for scheme in vispos.list_encodings(ndim=2, kind="bias"):
        configs[f"vispos {scheme} (flex)"] = patched(scheme, "flex")
    return configs


def measure(model: nn.Module, x: torch.Tensor, reps: int, device: torch.device) -> dict[str, float]:
    """Images per second and peak memory (MiB, CUDA only) of inference-mode forwards."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.inference_mode(), torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
        model(x)  # warm-up (and compilation)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(reps):
            model(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    return {"img_per_s": reps * x.shape[0] / seconds, "peak_mib": peak}


def kernel(model: nn.Module, x: torch.Tensor, device: torch.device) -> str:
    """The SDPA kernel(s) an eager forward reaches (from the profiler's op names), e.g. flash for RoPE and
    memory-efficient for a bias mask on CUDA; FlexAttention reaches none of them."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.inference_mode(), torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
        return ", ".join(sorted(sdpa_kernels(lambda: model(x)))) or "none (FlexAttention)"


def run(sizes: list[int], batch: int, reps: int, compile_model: bool, device: torch.device, dry_run: bool):
    """-> (label -> size -> measurements or "out of memory", label -> SDPA kernel at the first size)."""
    results: dict[str, dict[str, dict[str, float] | str]] = {}
    kernels: dict[str, str] = {}
    for label, build in configurations(MODEL, dry_run).items():
        results[label] = {}
        torch.manual_seed(0)
        kernels[label] = kernel(build(sizes[0]).to(device).eval(), torch.randn(1, 3, sizes[0], sizes[0], device=device),
                                device)  # fmt: skip
        for size in sizes:
            torch.manual_seed(0)
            try:
                model = build(size).to(device).eval()
                if compile_model:
                    model = torch.compile(model)
                x = torch.randn(batch, 3, size, size, device=device)
                results[label][str(size)] = measure(model, x, reps, device)
            except torch.OutOfMemoryError:
                results[label][str(size)] = "out of memory"
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        print(f"{label} ({kernels[label]}): {results[label]}", flush=True)
    return results, kernels


def markdown(results: dict, kernels: dict[str, str], sizes: list[int]) -> str:
    head = " | ".join(f"{s} px img/s | {s} px peak MiB" for s in sizes)
    lines = [f"| configuration | SDPA kernel | {head} |", "| --- | --- |" + " ---: | ---: |" * len(sizes)]
    for label, row in results.items():
        cells = []
        for s in sizes:
            r = row[str(s)]
            cells += [r, ""] if isinstance(r, str) else [f"{r['img_per_s']:.1f}", f"{r['peak_mib']:.0f}"]
        lines.append(f"| {label} | {kernels[label]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[224, 448, 896])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU, two blocks, no compile")
    p.add_argument("--out", default="gpu_check")
    args = p.parse_args(argv)
    if args.dry_run:
        device, sizes, batch, reps, compile_model = torch.device("cpu"), [32, 64], 1, 1, False
    else:
        if not torch.cuda.is_available():
            p.error("no CUDA device; use --dry-run to check the script on CPU")
        device, sizes, batch, reps = torch.device("cuda"), args.sizes, args.batch, args.reps
        compile_model = not args.no_compile
    results, kernels = run(sizes, batch, reps, compile_model, device, args.dry_run)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": MODEL, "device": str(device), "batch": batch, "reps": reps, "compile": compile_model,
            "dtype": "bf16 autocast" if device.type == "cuda" else "fp32", "sizes": sizes}
    (out / "gpu_check.json").write_text(json.dumps({**meta, "results": results, "kernels": kernels}, indent=2))
    (out / "gpu_check.md").write_text(f"{json.dumps(meta)}\n\n{markdown(results, kernels, sizes)}\n")
    print(markdown(results, kernels, sizes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
